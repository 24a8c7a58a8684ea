"""The rollout of one PPO update as tensors, and the per-token rewards and advantages built from it.

Shapes: B responses, P prompt tokens (left-padded), T response tokens (right-padded). All the
sequence tensors are batch-major (B, ...); GAE runs time-major, so `advantages` transposes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ppoforge.core.advantages import gae
from ppoforge.core.stats import whiten


@dataclass
class Rollout:
    ids: torch.Tensor        # (B, P + T) prompt then response tokens
    mask: torch.Tensor       # (B, P + T) float 0/1: real prompt tokens, then the response mask
    resp: torch.Tensor       # (B, T) response ids, right-padded
    resp_mask: torch.Tensor  # (B, T) float 0/1: up to and including the first stop token
    logp: torch.Tensor       # (B, T) fp32 log-probs under the policy that sampled
    ref_logp: torch.Tensor   # (B, T) fp32 log-probs under the reference
    values: torch.Tensor     # (B, T) fp32 V(prefix before each response token), 0 on padding
    scores: torch.Tensor     # (B,) reward-function scores
    adv: torch.Tensor | None = None  # (B, T) whitened GAE advantages
    ret: torch.Tensor | None = None  # (B, T) returns = GAE advantages + values

    def detached(self) -> Rollout:
        """A copy usable by autograd: inference-mode tensors cannot be saved for backward."""
        return Rollout(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name).clone()
                          for f in fields(self)})


def left_pad(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists -> (B, P) ids left-padded with pad_id and the (B, P) int64 0/1 mask."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r):] = 1
    return ids.to(device), mask.to(device)


def right_pad(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists -> (B, L) ids right-padded with pad_id and the (B, L) int64 0/1 mask: every row
    starts at position 0, as it would alone (what absolute-position and first-token-pooling models need)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, :len(r)] = 1
    return ids.to(device), mask.to(device)


def token_rewards(scores: torch.Tensor, kl: torch.Tensor, resp_mask: torch.Tensor, beta: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Ziegler et al.: r_t = -beta * KL_t on every response token, plus the score on the last one.

    Returns (rewards, non_score_rewards), both (B, T) and 0 on padding.
    """
    non_score = -beta * kl * resp_mask
    last = resp_mask.sum(1).long().clamp(min=1) - 1  # (B,) index of the last real token
    rewards = non_score.clone()
    rewards[torch.arange(rewards.shape[0], device=rewards.device), last] += scores
    return rewards, non_score


def advantages(rewards: torch.Tensor, values: torch.Tensor, resp_mask: torch.Tensor, gamma: float,
               lam: float, whiten_rewards: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over response tokens; the episode terminates after the last real token (no bootstrap).

    Returns (whitened advantages, returns), (B, T), 0 on padding.
    """
    if whiten_rewards:
        rewards = whiten(rewards, resp_mask, shift_mean=False)
    values = values * resp_mask
    next_mask = torch.cat([resp_mask[:, 1:], torch.zeros_like(resp_mask[:, :1])], 1)
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], 1)
    done = 1.0 - next_mask  # 1 at the last real token and on padding
    adv, ret = gae(rewards.T.contiguous(), values.T.contiguous(), next_values.T.contiguous(),
                   done.T.contiguous(), done.T.contiguous(), gamma, lam)
    adv, ret = adv.T * resp_mask, ret.T * resp_mask
    return whiten(adv, resp_mask), ret
