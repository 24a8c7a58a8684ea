"""The LM policy-gradient losses that `policy_loss` chooses: PPO's token-level clip, GSPO's sequence-level
ratio and clip, CISPO's capped, detached importance weight on REINFORCE's log-prob.

All three take the same arguments and give (loss, stats) with the same stat keys (approx_kl, clipfrac,
ratio and TRL's clip shares low, high, region), so the update picks one from POLICY_LOSSES once and calls
it. They compute per-token losses (B, T) and leave the aggregation to `reduce` (`loss_agg`,
`core/accumulation.py`), so the token or sequence counts across micro-batches stay that module's contract;
GSPO alone reads across a row's tokens (its ratio is the row's mean), and a micro-batch holds whole rows.

TRL's `GRPOTrainer._compute_loss` (trl/trainer/grpo_trainer.py; the same lines in 1.12 and 1.16) on the same
log-probs and advantages gives the same losses (tests/core/test_trl_parity.py): ppo is its loss_type grpo,
bnpo, dr_grpo or dapo with importance_sampling_level="token" (= our loss_agg seq_mean_token_mean,
token_mean, seq_sum_norm, token_mean), gspo the same with "sequence", cispo its loss_type="cispo".
"""

from __future__ import annotations

import math

import torch

from ppoforge.core.losses import clip_stats, policy_loss
from ppoforge.core.stats import masked_mean


def ppo_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, clip: float,
             mask: torch.Tensor | None = None, clip_high: float | None = None,
             reduce=masked_mean) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate on each token's ratio r_t = exp(logp_t - old_logp_t) (Schulman et al. 2017,
    eq. 7; `core/losses.py: policy_loss`, DAPO's clip-higher included), with TRL's clip shares."""
    loss, stats = policy_loss(logp, old_logp, adv, clip, mask, clip_high=clip_high, reduce=reduce)
    return loss, stats | clip_stats(logp, old_logp, adv, clip, clip_high, mask)


def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """log s_i = mean over row i's real tokens of (logp - old_logp), in each of its tokens' place: (B, T).
    TRL: (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1), unsqueezed; a row with no real token gets 0."""
    return masked_mean(logp - old_logp, mask, dim=-1).unsqueeze(-1).expand_as(logp)


def gspo_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, clip: float,
              mask: torch.Tensor | None = None, clip_high: float | None = None,
              reduce=masked_mean) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025, section 4.1, eq. 5): PPO's clipped surrogate with the sequence's
    length-normalized ratio s_i = (pi(y_i|x) / pi_old(y_i|x))^(1/|y_i|) = exp(mean_t(logp - old_logp)) in
    every token's place, clipped to [1 - clip, 1 + clip_high] (TRL's importance_sampling_level="sequence").
    A row is clipped whole; the gradient reaches all its tokens through s_i. With the paper's
    sequence-level advantages (the critic-free estimators) and loss_agg seq_mean_token_mean (`loss_agg: auto`
    with gspo) this is its objective; the paper clips far tighter than PPO (clip 3e-4, clip_high 4e-4, its
    section 5.1): s_i is a geometric mean.

    Stats as `ppo_loss`'s, of s_i (token-weighted: a row counts once per real token), except approx_kl:
    the per-token k3 under every policy loss, how far the policy moved."""
    log_ratio = sequence_log_ratio(logp, old_logp, mask)  # (B, T), each row constant
    zero = torch.zeros_like(log_ratio)  # the surrogate of exp(log s_i - 0) is PPO's with r_t = s_i
    loss, stats = ppo_loss(log_ratio, zero, adv, clip, mask, clip_high, reduce)
    with torch.no_grad():
        token_log_ratio = logp - old_logp
        stats["approx_kl"] = masked_mean((torch.exp(token_log_ratio) - 1) - token_log_ratio, mask)
    return loss, stats


def cispo_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, clip: float,
               mask: torch.Tensor | None = None, clip_high: float | None = None,
               reduce=masked_mean) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, Chen et al. 2025, section 3.1): REINFORCE's -A * logp with each token weighted by
    its ratio r_t capped above and detached, -sg(min(r_t, 1 + clip_high)) * A * logp (1 + clip without
    clip_high). Unlike PPO's clip, which zeroes a clipped token's gradient, the cap only bounds its
    weight: every token keeps a gradient. No lower bound (the paper sets it out of reach; `clip` only
    stands in for a missing clip_high). TRL: torch.clamp(coef_1, max=epsilon_high).detach(), its
    epsilon_high being the cap itself (ScaleRL's eps_max, 5 recommended: our clip_high 4).

    Stats: approx_kl and ratio as PPO's; clipfrac the share of tokens whose weight is capped; clip shares
    high = capped with A > 0 (TRL's cispo_clip_ratio) = region, low = 0."""
    high = clip if clip_high is None else clip_high
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, max=1.0 + high).detach()
    loss = reduce(-weight * adv * logp, mask)
    with torch.no_grad():
        stats = {"approx_kl": masked_mean((ratio - 1) - log_ratio, mask),
                 "clipfrac": masked_mean((ratio - 1.0 > high).to(logp.dtype), mask),
                 "ratio": masked_mean(ratio, mask)}
    return loss, stats | clip_stats(logp, old_logp, adv, math.inf, high, mask)  # no lower bound: low = 0


POLICY_LOSSES = {"ppo": ppo_loss, "gspo": gspo_loss, "cispo": cispo_loss}


def truncated_is_weights(old_logp: torch.Tensor, behaviour_logp: torch.Tensor, cap: float,
                         mask: torch.Tensor | None = None) -> torch.Tensor:
    """Rollout correction (truncated importance sampling, Yao et al. 2025 "Your efficient RL framework
    secretly brings you off-policy RL training"; TRL's vllm_importance_sampling_correction, verl's
    rollout_is): the tokens were drawn by an engine whose log-probs `behaviour_logp` differ from the
    training forward's `old_logp`; each token's policy loss is weighted by w_t = min(exp(old_logp_t -
    behaviour_logp_t), cap), detached, 0 on padding. (B, T)."""
    w = torch.exp(old_logp - behaviour_logp).clamp(max=cap).detach()
    return w if mask is None else w * mask


def weighted_reduce(reduce, weights: torch.Tensor):
    """`reduce` (a loss aggregation, `core/accumulation.py`) of per-token losses weighted by `weights` (B, T)."""
    return lambda x, mask: reduce(x * weights, mask)
