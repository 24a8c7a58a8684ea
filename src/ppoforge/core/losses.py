"""PPO's clipped objectives (Schulman et al. 2017) and their diagnostics.

Every function takes an optional 0/1 `mask` so the same code serves control (no mask) and LM tokens
(response mask). Reductions are masked means over the real tokens of what they are given; how those
means combine across gradient-accumulation micro-batches is `core/accumulation.py`'s contract.
"""

from __future__ import annotations

import torch

from ppoforge.core.stats import masked_mean


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, clip: float,
                mask: torch.Tensor | None = None, with_stats: bool = True
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate: mean(max(-A * r, -A * clip(r, 1 - eps, 1 + eps))), r = exp(logp - old_logp).

    Returns the loss and detached diagnostics: approx_kl (the k3 estimator (r - 1) - log r, unbiased
    and non-negative), clipfrac (share of entries where clipping is active) and the mean ratio.
    `with_stats=False` skips them (an empty dict): they cost ~10% of a tiny control minibatch.
    """
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip, 1.0 + clip)
    loss = masked_mean(torch.maximum(unclipped, clipped), mask)
    if not with_stats:
        return loss, {}
    with torch.no_grad():
        stats = {
            "approx_kl": masked_mean((ratio - 1) - log_ratio, mask),
            "clipfrac": masked_mean(((ratio - 1.0).abs() > clip).to(logp.dtype), mask),
            "ratio": masked_mean(ratio, mask),
        }
    return loss, stats


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               clip: float | None, mask: torch.Tensor | None = None, with_stats: bool = True
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """0.5 * mean((V - R)^2); with `clip`, the max of that and the loss of V clipped to old_V ± clip.

    Stats: clipfrac, the share of entries where the clipped loss is the larger (0 without clip).
    """
    unclipped = (values - returns) ** 2
    if clip is None:
        stats = {"clipfrac": torch.zeros((), device=values.device)} if with_stats else {}
        return 0.5 * masked_mean(unclipped, mask), stats
    clipped_values = old_values + torch.clamp(values - old_values, -clip, clip)
    clipped = (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(unclipped, clipped), mask)
    if not with_stats:
        return loss, {}
    with torch.no_grad():
        clipfrac = masked_mean((clipped > unclipped).to(values.dtype), mask)
    return loss, {"clipfrac": clipfrac}


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution over the last dim, computed in the logits' dtype."""
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)
