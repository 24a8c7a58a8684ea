"""DAPO's data-side pieces (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at
Scale", arXiv 2503.14476), as pure tensor math: which groups carry a learning signal (dynamic sampling),
the soft length penalty (overlong reward shaping) and the loss mask without truncated completions
(overlong filtering). The trainer decides what to do with them (`lm/rl/dynamic.py`, `lm/rl/trainer.py`).
DAPO's clip-higher is `clip_high` (`core/policy_losses.py`), its token-level loss `loss_agg: token_mean`.
"""

from __future__ import annotations

import torch

from ppoforge.core.critic_free import flat_groups


def informative_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) scores -> (B / G,) bool: the group's G scores do not all agree (`flat_groups`: max == min; a std
    test would keep eight 0.3s, whose fp32 std is 3e-8).

    DAPO eq. 11's constraint 0 < |{o_i : is_equivalent(a, o_i)}| < G, for any score rather than only
    correct/incorrect; verl's `filter_groups` (verl/trainer/ppo/ray_trainer.py) keeps a group when the
    std of its metric is > 0. A group whose scores agree has advantage 0 under a group baseline (GRPO,
    RLOO): it only dilutes the batch's gradient."""
    return ~flat_groups(scores, group_size)


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """(B,) DAPO's soft overlong punishment (eq. 13) times `factor`, for response lengths (B,) in tokens:

        R_length(y) = 0                                  |y| <= L_max - L_cache
                      ((L_max - L_cache) - |y|) / L_cache  L_max - L_cache < |y| <= L_max
                      -1                                 |y| > L_max

    with L_max = `max_len` and L_cache = `buffer`: a linear ramp from 0 to -factor over the last `buffer`
    tokens of the budget. verl's form (verl/workers/reward_manager/dapo.py: min(-exceed_len /
    overlong_buffer.len * penalty_factor, 0)) is the same up to L_max, which no sampled response
    exceeds. `buffer` 0 is no ramp: 0 up to L_max (the whole penalty is off)."""
    start = max_len - buffer
    return -factor * ((lengths - start) / max(buffer, 1)).clamp(0.0, 1.0)


def finished_mask(mask: torch.Tensor, finished: torch.Tensor, drop_truncated: bool) -> torch.Tensor:
    """(B, T) the loss mask: `mask` with the rows of truncated responses (`finished` (B,) False: no stop
    token before the budget) zeroed when `drop_truncated`, else `mask` unchanged. DAPO's overlong
    filtering; TRL's `mask_truncated_completions` (trl/trainer/grpo_trainer.py), which zeroes those rows
    of `completion_mask` after the rewards and advantages are computed, so a truncated completion still
    counts in its group's baseline but gets no loss, and `token_mean`'s token count leaves it out."""
    keep = finished | (not drop_truncated)  # (B,) bool
    return mask * keep[:, None].to(mask.dtype)
