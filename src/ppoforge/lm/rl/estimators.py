"""The advantage estimators, one record each: `ESTIMATORS[cfg.advantage]` is an `Estimator` — its function
(rollout, per-token KL rewards, config) -> (advantages (B, T), returns or None), whether it learns a critic,
whether it needs groups, the reward scalings it allows and its default, and its curve title. The config's
validation and derived values, the trainer's choices and its metric names read the record; adding an
estimator is a record here and its math in `core/critic_free.py`.

GAE uses the critic's values; the critic-free estimators (`core/critic_free.py`) run over the whole
rollout, whose groups are contiguous rows (G completions of a prompt in a row). The trainer calls them
before PPO shuffles the rollout into mini-batches, so a group's statistics always see all of its
completions. Under torchrun each rank holds whole groups; the statistics over the batch (whitening,
`scale: batch`) are all ranks' (`reducer()`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ppoforge.core.advantages import gae, over_real_tokens
from ppoforge.core.critic_free import (
    RLOO_SCALES,
    SCALES,
    group_mean,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from ppoforge.core.stats import whiten
from ppoforge.lm.rl.rollout import Rollout, with_scores
from ppoforge.runtime.distributed import reducer

# (rollout, per-token KL rewards (B, T), cfg) -> (advantages (B, T), returns | None); cfg is the RLHFConfig,
# left unannotated: the config imports this module (its choices and validation read the records)
Estimate = Callable[[Rollout, torch.Tensor, object], tuple[torch.Tensor, torch.Tensor | None]]


@dataclass(frozen=True)
class Estimator:
    name: str                  # the `advantage` value
    estimate: Estimate         # (rollout, per-token KL rewards (B, T), config) -> (advantages, returns | None)
    title: str                 # the reward/KL curve's title: "PPO", "GRPO", ...
    critic: bool = False       # learns a value function (a value head, a critic pass, a value loss)
    groups: bool = False       # its baseline is the other completions of each prompt: num_generations >= 2
    scales: tuple[str, ...] = ()  # the `scale_rewards` values it allows besides auto (none: auto only)
    default_scale: str = "none"   # what auto means ("group" becomes "batch" when the KL is in the reward)
    scaling: str = ""          # how it normalizes its advantages itself, for the error naming a refused scale


# ---- GAE -------------------------------------------------------------------------------------------

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

def gae_estimate(b: Rollout, non_score: torch.Tensor, cfg):
    """PPO: GAE over the per-token rewards with the critic's values, whitened."""
    rewards = with_scores(b.step_rewards(non_score), b.scores, b.resp_mask)
    return advantages(rewards, b.values, b.resp_mask, cfg.gamma, cfg.lam, cfg.whiten_rewards)


def _sequence_rewards(b: Rollout, non_score: torch.Tensor) -> torch.Tensor:
    """(B,) score - beta * sum_t KL_t (just the score with kl_in: loss), as TRL's RLOO; plus the turn
    rewards of a multi-turn episode."""
    return b.scores + b.step_rewards(non_score).sum(1)


def grpo_estimate(b: Rollout, non_score: torch.Tensor, cfg):
    """GRPO: each response's group-normalized reward on every one of its tokens."""
    adv = grpo_advantages(_sequence_rewards(b, non_score), cfg.num_generations, cfg.reward_scale, all_sum=reducer())
    return adv[:, None] * b.resp_mask, None


def rloo_estimate(b: Rollout, non_score: torch.Tensor, cfg):
    """RLOO: each response's reward minus the mean of its group's others, on every one of its tokens."""
    adv = rloo_advantages(_sequence_rewards(b, non_score), cfg.num_generations, cfg.reward_scale, all_sum=reducer())
    return adv[:, None] * b.resp_mask, None


def reinforce_pp_estimate(b: Rollout, non_score: torch.Tensor, cfg):
    """REINFORCE++: the per-token rewards' reward-to-go, whitened over the rollout's tokens."""
    return _reinforce_pp(with_scores(b.step_rewards(non_score), b.scores, b.resp_mask), b.resp_mask, cfg.gamma), None


def reinforce_pp_baseline_estimate(b: Rollout, non_score: torch.Tensor, cfg):
    """REINFORCE++-baseline: REINFORCE++ with the group's mean return subtracted on each response's last
    token. The return is the whole episode's (turn rewards plus score), as GRPO's and RLOO's: centring the
    score alone would leave an environment's turn rewards without a baseline."""
    centered = b.scores - group_mean(b.returns(), cfg.num_generations)
    return _reinforce_pp(with_scores(b.step_rewards(non_score), centered, b.resp_mask), b.resp_mask, cfg.gamma), None


def _reinforce_pp(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """REINFORCE++ whose discount runs over the policy's tokens only (packed, as in `advantages`), its
    whitening over every rank's tokens."""
    return over_real_tokens(lambda r, m: reinforce_pp_advantages(r, m, gamma, reducer()), mask, rewards)


ESTIMATORS = {e.name: e for e in (
    Estimator("gae", gae_estimate, "PPO", critic=True),
    Estimator("grpo", grpo_estimate, "GRPO", groups=True, scales=SCALES, default_scale="group",
              scaling="divides by a std of the rewards"),
    Estimator("rloo", rloo_estimate, "RLOO", groups=True, scales=RLOO_SCALES,
              scaling="normalizes its advantages over the batch (TRL's normalize_advantages)"),
    Estimator("reinforce_pp", reinforce_pp_estimate, "REINFORCE_PP", scaling="whitens over the batch itself"),
    Estimator("reinforce_pp_baseline", reinforce_pp_baseline_estimate, "REINFORCE_PP_BASELINE", groups=True,
              scaling="whitens over the batch itself"),
)}
