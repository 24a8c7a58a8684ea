"""The rollout of one PPO update as tensors, the per-token rewards built from it, its `objective/` metrics,
and its all-gather for FSDP. The advantages computed from it are `lm/rl/estimators.py`'s.

Shapes: B responses, P prompt tokens (left-padded), T response tokens (right-padded). All the
sequence tensors are batch-major (B, ...). Per-token rewards (Ziegler et al.): r_t = -beta * KL_t on
every response token (`non_score_rewards`), plus the score on the last one (`with_scores`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ppoforge.core.critic_free import group_reward_stats
from ppoforge.core.kl import kl_penalty
from ppoforge.runtime import distributed


@dataclass
class Rollout:
    ids: torch.Tensor        # (B, P + T) prompt then response tokens
    mask: torch.Tensor       # (B, P + T) float 0/1: real prompt tokens, then the response's real tokens
    resp: torch.Tensor       # (B, T) response ids, right-padded
    resp_mask: torch.Tensor  # (B, T) float 0/1: the policy's tokens (up to and including the first stop
    #                          token; in a multi-turn episode, every turn's, not the environment's)
    logp: torch.Tensor       # (B, T) fp32 log-probs under the policy that sampled
    ref_logp: torch.Tensor | None  # (B, T) fp32 log-probs under the reference (None: kl_coef 0, no pass)
    values: torch.Tensor | None    # (B, T) fp32 V(prefix before each response token), 0 on padding
    #                                (None: a critic-free estimator)
    scores: torch.Tensor     # (B,) reward-function scores
    turn_rewards: torch.Tensor | None = None  # (B, T) multi-turn: each turn's reward on its last policy token
    behaviour_logp: torch.Tensor | None = None  # (B, T) an inexact engine's (vLLM's) log-probs of its tokens,
    #                                             beside the recomputed `logp`; None with the local engines
    adv: torch.Tensor | None = None  # (B, T) advantages: whitened GAE, or the critic-free estimator's
    ret: torch.Tensor | None = None  # (B, T) returns = GAE advantages + values (GAE only)

    def returns(self) -> torch.Tensor:
        """(B,) each response's score; a multi-turn episode's return (its turn rewards plus its score)."""
        return self.scores if self.turn_rewards is None else self.scores + self.turn_rewards.sum(1)

    def step_rewards(self, non_score: torch.Tensor) -> torch.Tensor:
        """(B, T) the per-token rewards besides the final score: KL terms plus any turn rewards."""
        return non_score if self.turn_rewards is None else non_score + self.turn_rewards

    def detached(self) -> Rollout:
        """A copy usable by autograd: inference-mode tensors cannot be saved for backward."""
        return Rollout(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name).clone()
                          for f in fields(self)})


def non_score_rewards(kl: torch.Tensor, resp_mask: torch.Tensor, beta: float) -> torch.Tensor:
    """(B, T) -beta * KL_t on every response token, 0 on padding."""
    return -beta * kl * resp_mask


def with_scores(non_score: torch.Tensor, scores: torch.Tensor, resp_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) the per-token rewards `non_score` plus each response's score (B,) on its last real token."""
    last = resp_mask.shape[1] - 1 - resp_mask.flip(1).argmax(1)  # (B,) index of the last real token
    rewards = non_score.clone()
    rewards[torch.arange(rewards.shape[0], device=rewards.device), last] += scores
    return rewards


def rollout_kl(b: Rollout, estimator: str) -> torch.Tensor:
    """(B, T) per-token KL of the sampling policy to the reference (`kl_estimator`); 0 without a reference pass."""
    if b.ref_logp is None:
        return torch.zeros_like(b.logp)
    return kl_penalty(b.logp, b.ref_logp, estimator, b.resp_mask)


def rollout_metrics(b: Rollout, finished: torch.Tensor, kl: torch.Tensor, non_score: torch.Tensor,
                    group_size: int) -> dict[str, torch.Tensor]:
    """TRL's PPO `objective/` names and its GRPO ones (`reward`, `completions/clipped_ratio`, and with
    groups `reward_std`, `frac_reward_zero_std`); no `objective/kl` without a reference pass."""
    scores = b.returns()
    out = {"objective/entropy": -b.logp.sum(1).mean(),
           "objective/non_score_reward": non_score.sum(1).mean(),
           "objective/rlhf_reward": (scores + non_score.sum(1)).mean(),
           "objective/scores": scores.mean(),
           "val/num_eos_tokens": finished.sum().float(),
           "objective/response_length": b.resp_mask.sum(1).mean(),
           "reward": scores.mean(), "completions/clipped_ratio": 1.0 - finished.float().mean()}
    if b.ref_logp is not None:
        out["objective/kl"] = kl.sum(1).mean()
    if group_size > 1:
        out |= group_reward_stats(scores, group_size)
    return out


def gather_rollout(b: Rollout, pad_id: int) -> Rollout:
    """Every rank's rows of the rollout in rank order: the global rollout, each rank's part padded to the
    longest prompt (on the left) and response (on the right), padding masked out. Under FSDP every rank
    must run every mini-batch's forward and backward, so each trains an equal slice of each mini-batch of
    the global rollout (`PPOUpdate._own_rows`, lm/rl/update.py). The identity at world 1."""
    if not distributed.collectives():
        return b
    n_resp = b.resp.shape[1]
    n_prompt = b.ids.shape[1] - n_resp
    widths = torch.tensor([[n_prompt, n_resp]], device=b.resp.device)
    p_max, t_max = distributed.all_gather(widths).max(0).values.tolist()

    def both(x: torch.Tensor, value) -> torch.Tensor:  # (B, P + T) -> (B, p_max + t_max)
        prompt = torch.nn.functional.pad(x[:, :n_prompt], (p_max - n_prompt, 0), value=value)
        return torch.cat([prompt, torch.nn.functional.pad(x[:, n_prompt:], (0, t_max - n_resp), value=value)], 1)

    def resp(x: torch.Tensor | None, value=0) -> torch.Tensor | None:  # (B, T) -> (world * B, t_max)
        if x is None:
            return None
        return distributed.all_gather(torch.nn.functional.pad(x, (0, t_max - n_resp), value=value))

    return Rollout(distributed.all_gather(both(b.ids, pad_id)), distributed.all_gather(both(b.mask, 0)),
                   resp(b.resp, pad_id), resp(b.resp_mask), resp(b.logp), resp(b.ref_logp), resp(b.values),
                   distributed.all_gather(b.scores), resp(b.turn_rewards), behaviour_logp=resp(b.behaviour_logp),
                   adv=resp(b.adv), ret=resp(b.ret))
