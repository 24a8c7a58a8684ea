"""PPO's clipped objectives (Schulman et al. 2017) and their diagnostics.

Every function takes an optional 0/1 `mask` so the same code serves control (no mask) and LM tokens
(response mask). The losses are masked means over the real tokens of what they are given unless a
`reduce` (one of `core/accumulation.py`'s loss aggregations) says otherwise; how they combine across
gradient-accumulation micro-batches is that module's contract.
"""

from __future__ import annotations

import torch

from ppoforge.core.stats import masked_mean


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, clip: float,
                mask: torch.Tensor | None = None, with_stats: bool = True, clip_high: float | None = None,
                reduce=masked_mean) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate: reduce(max(-A * r, -A * clip(r, 1 - eps, 1 + eps_high))), r = exp(logp - old_logp).

    `clip_high` is DAPO's clip-higher (Yu et al. 2025): a wider upper bound lets unlikely tokens with a
    positive advantage grow further, against entropy collapse; None is PPO's symmetric `clip`. `reduce`
    turns per-entry losses into one number (`core/accumulation.py`'s aggregations; default the mean).

    Returns the loss and detached diagnostics: approx_kl (the k3 estimator (r - 1) - log r, unbiased
    and non-negative), clipfrac (share of entries with r outside the clip range) and the mean ratio.
    `with_stats=False` skips them (an empty dict): they cost ~10% of a tiny control minibatch.
    """
    high = clip if clip_high is None else clip_high
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip, 1.0 + high)
    loss = reduce(torch.maximum(unclipped, clipped), mask)
    if not with_stats:
        return loss, {}
    with torch.no_grad():
        excess = ratio - 1.0
        outside = excess.abs() > clip if clip_high is None else (excess > high) | (excess < -clip)
        stats = {
            "approx_kl": masked_mean((ratio - 1) - log_ratio, mask),
            "clipfrac": masked_mean(outside.to(logp.dtype), mask),
            "ratio": masked_mean(ratio, mask),
        }
    return loss, stats


@torch.no_grad()
def clip_stats(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, clip: float,
               clip_high: float | None = None, mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """TRL's GRPO clip metrics: shares of entries where the clip is active (the surrogate's gradient is 0):
    low (r < 1 - eps with A < 0), high (r > 1 + eps_high with A > 0) and region (either)."""
    high = clip if clip_high is None else clip_high
    excess = torch.exp(logp - old_logp) - 1.0
    low_active, high_active = (excess < -clip) & (adv < 0), (excess > high) & (adv > 0)
    return {"low": masked_mean(low_active.to(logp.dtype), mask),
            "high": masked_mean(high_active.to(logp.dtype), mask),
            "region": masked_mean((low_active | high_active).to(logp.dtype), mask)}


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               clip: float | None, mask: torch.Tensor | None = None, with_stats: bool = True,
               reduce=masked_mean) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """0.5 * mean((V - R)^2); with `clip`, the max of that and the loss of V clipped to old_V ± clip.
    `reduce` replaces the mean as in `policy_loss`.

    Stats: clipfrac, the share of entries where the clipped loss is the larger (0 without clip).
    """
    unclipped = (values - returns) ** 2
    if clip is None:
        stats = {"clipfrac": torch.zeros((), device=values.device)} if with_stats else {}
        return 0.5 * reduce(unclipped, mask), stats
    clipped_values = old_values + torch.clamp(values - old_values, -clip, clip)
    clipped = (clipped_values - returns) ** 2
    loss = 0.5 * reduce(torch.maximum(unclipped, clipped), mask)
    if not with_stats:
        return loss, {}
    with torch.no_grad():
        clipfrac = masked_mean((clipped > unclipped).to(values.dtype), mask)
    return loss, {"clipfrac": clipfrac}


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution over the last dim, computed in the logits' dtype."""
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)
