"""KL penalty estimators and controllers for RLHF (Ziegler et al. 2019; Schulman's k1/k3 note).

The per-token penalty compares the policy to the frozen reference on the sampled tokens:
k1 = logp - ref_logp (unbiased, can be negative per token); k2 = 0.5 * (logp - ref_logp)^2 (biased,
>= 0, low variance); k3 = (r - 1) - log r with r = ref/policy (unbiased, always >= 0, lower variance).
The controller sets the coefficient beta.

As a loss term (GRPO's `kl_in: loss`) what matters is the gradient, on tokens the policy sampled:
E[grad k1] = E[grad log pi] = 0, so k1 pulls nothing in expectation; E[grad k2] is exactly the gradient
of KL(pi || ref); E[grad k3] is the gradient of the reverse KL(ref || pi) (Tang & Munos 2025, "On a
few pitfalls in KL divergence gradient estimation for RL"; GRPO and TRL use k3).
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str, mask: torch.Tensor | None = None
               ) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate on the sampled tokens; 0 where `mask` is 0.

    The mask selects the log ratio *before* the estimator: on padding the two log-probs are unrelated
    numbers (a masked reference is 0), k3's expm1(-log_ratio) overflows to inf below -88.7 in fp32, and
    inf * 0 is NaN — in the masked sum and in its gradient. Selected out first, the estimate and its
    gradient there are exactly 0."""
    log_ratio = logp - ref_logp
    if mask is not None:
        log_ratio = log_ratio.masked_fill_(mask == 0, 0.0)  # in place: the gradient there is 0 too
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"kl estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


class FixedKLController:
    """A constant beta."""

    def __init__(self, beta: float):
        self.value = beta

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


class AdaptiveKLController:
    """Ziegler et al. 2019: beta *= 1 + clip(KL / target - 1, -0.2, 0.2) * n_steps / horizon."""

    def __init__(self, beta: float, target: float, horizon: int):
        self.value, self.target, self.horizon = beta, target, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]
