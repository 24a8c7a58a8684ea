"""The rollout of one PPO update as tensors, and the per-token rewards and advantages built from it.

Shapes: B responses, P prompt tokens (left-padded), T response tokens (right-padded). All the
sequence tensors are batch-major (B, ...); GAE runs time-major, so `advantages` transposes.

`ESTIMATORS` maps `advantage` to one function (rollout, per-token KL rewards, config) -> (advantages
(B, T), returns or None): GAE with the critic's values, or a critic-free estimator of
`core/critic_free.py` over the whole rollout, whose groups are contiguous rows (G completions of a
prompt in a row). The trainer calls it before PPO shuffles the rollout into mini-batches, so a group's
statistics always see all of its completions. Under torchrun each rank holds whole groups; the
statistics over the batch (whitening, `scale: batch`) are all ranks' (`reducer()`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch

from ppoforge.core.advantages import gae, over_real_tokens
from ppoforge.core.critic_free import (
    group_mean,
    group_reward_stats,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from ppoforge.core.stats import whiten
from ppoforge.runtime import distributed
from ppoforge.runtime.distributed import reducer

if TYPE_CHECKING:
    from ppoforge.lm.rl.config import RLHFConfig


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


def token_rewards(scores: torch.Tensor, kl: torch.Tensor, resp_mask: torch.Tensor, beta: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Ziegler et al.: r_t = -beta * KL_t on every response token, plus the score on the last one.

    Returns (rewards, non_score_rewards), both (B, T) and 0 on padding.
    """
    non_score = non_score_rewards(kl, resp_mask, beta)
    return with_scores(non_score, scores, resp_mask), non_score


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


def advantages(rewards: torch.Tensor, values: torch.Tensor, resp_mask: torch.Tensor, gamma: float,
               lam: float, whiten_rewards: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over the policy's tokens (`resp_mask`); the episode terminates after the last one (no
    bootstrap). Multi-turn rows are packed first (`over_real_tokens`): the lambda-chain and the
    bootstrap skip the environment's tokens, so V at a turn's end bootstraps from V at the next turn's
    first policy token. Returns (whitened advantages, returns), (B, T), 0 where resp_mask is 0.
    """
    if whiten_rewards:
        rewards = whiten(rewards, resp_mask, shift_mean=False, all_sum=reducer())
    adv, ret = over_real_tokens(lambda r, v, m: _packed_gae(r, v, m, gamma, lam), resp_mask, rewards, values)
    return whiten(adv, resp_mask, all_sum=reducer()), ret


def _packed_gae(rewards: torch.Tensor, values: torch.Tensor, resp_mask: torch.Tensor, gamma: float, lam: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over rows whose real tokens are a prefix (resp_mask): (advantages, returns), 0 on padding."""
    values = values * resp_mask
    next_mask = torch.cat([resp_mask[:, 1:], torch.zeros_like(resp_mask[:, :1])], 1)
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], 1)
    done = 1.0 - next_mask  # 1 at the last real token and on padding
    adv, ret = gae(rewards.T.contiguous(), values.T.contiguous(), next_values.T.contiguous(),
                   done.T.contiguous(), done.T.contiguous(), gamma, lam)
    return adv.T * resp_mask, ret.T * resp_mask


# ---- the estimators: (rollout, per-token KL rewards (B, T), config) -> (advantages (B, T), returns | None)

def gae_estimate(b: Rollout, non_score: torch.Tensor, cfg: RLHFConfig):
    """PPO: GAE over the per-token rewards with the critic's values, whitened."""
    rewards = with_scores(b.step_rewards(non_score), b.scores, b.resp_mask)
    return advantages(rewards, b.values, b.resp_mask, cfg.gamma, cfg.lam, cfg.whiten_rewards)


def _sequence_rewards(b: Rollout, non_score: torch.Tensor) -> torch.Tensor:
    """(B,) score - beta * sum_t KL_t (just the score with kl_in: loss), as TRL's RLOO; plus the turn
    rewards of a multi-turn episode."""
    return b.scores + b.step_rewards(non_score).sum(1)


def grpo_estimate(b: Rollout, non_score: torch.Tensor, cfg: RLHFConfig):
    """GRPO: each response's group-normalized reward on every one of its tokens."""
    adv = grpo_advantages(_sequence_rewards(b, non_score), cfg.num_generations, cfg.reward_scale, all_sum=reducer())
    return adv[:, None] * b.resp_mask, None


def rloo_estimate(b: Rollout, non_score: torch.Tensor, cfg: RLHFConfig):
    """RLOO: each response's reward minus the mean of its group's others, on every one of its tokens."""
    adv = rloo_advantages(_sequence_rewards(b, non_score), cfg.num_generations, cfg.reward_scale, all_sum=reducer())
    return adv[:, None] * b.resp_mask, None


def reinforce_pp_estimate(b: Rollout, non_score: torch.Tensor, cfg: RLHFConfig):
    """REINFORCE++: the per-token rewards' reward-to-go, whitened over the rollout's tokens."""
    return _reinforce_pp(with_scores(b.step_rewards(non_score), b.scores, b.resp_mask), b.resp_mask, cfg.gamma), None


def reinforce_pp_baseline_estimate(b: Rollout, non_score: torch.Tensor, cfg: RLHFConfig):
    """REINFORCE++-baseline: REINFORCE++ with the group's mean return subtracted on each response's last
    token. The return is the whole episode's (turn rewards plus score), as GRPO's and RLOO's: centring the
    score alone would leave an environment's turn rewards without a baseline."""
    centered = b.scores - group_mean(b.returns(), cfg.num_generations)
    return _reinforce_pp(with_scores(b.step_rewards(non_score), centered, b.resp_mask), b.resp_mask, cfg.gamma), None


def _reinforce_pp(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """REINFORCE++ whose discount runs over the policy's tokens only (packed, as in `advantages`), its
    whitening over every rank's tokens."""
    return over_real_tokens(lambda r, m: reinforce_pp_advantages(r, m, gamma, reducer()), mask, rewards)


ESTIMATORS = {"gae": gae_estimate, "grpo": grpo_estimate, "rloo": rloo_estimate,
              "reinforce_pp": reinforce_pp_estimate, "reinforce_pp_baseline": reinforce_pp_baseline_estimate}


def gather_rollout(b: Rollout, pad_id: int) -> Rollout:
    """Every rank's rows of the rollout in rank order: the global rollout, each rank's part padded to the
    longest prompt (on the left) and response (on the right), padding masked out. Under FSDP every rank
    must run every mini-batch's forward and backward, so each trains an equal slice of each mini-batch of
    the global rollout (`RLHFTrainer._own_rows`). The identity at world 1."""
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
                   distributed.all_gather(b.scores), resp(b.turn_rewards), resp(b.adv), resp(b.ret))
