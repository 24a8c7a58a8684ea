"""Critic-free advantages for LM policy gradients: GRPO, RLOO, REINFORCE++ and REINFORCE++-baseline.

None of these learns a value function. The baseline comes from the other completions of the same
prompt (GRPO, RLOO, REINFORCE++-baseline) or from whitening over the batch (REINFORCE++). A batch holds
n prompts x G completions, each prompt's G completions contiguous: rows [kG, (k + 1)G) are prompt k's
group. Sequence rewards are (B,), per-token ones (B, T) with a 0/1 response mask.

- GRPO (Shao et al. 2024, "DeepSeekMath"), as TRL's GRPOTrainer computes it:
      A_i = (r_i - mean_group(r)) / (s + 1e-4)
  with s, by `scale`: `group`, the group's sample std (GRPO); `batch`, the sample std of all B rewards
  (TRL's `scale_rewards="batch"`); `none`, no division (Dr. GRPO: Liu et al. 2025, "Understanding
  R1-Zero-Like Training", which finds that the std division up-weights too easy and too hard prompts).
- RLOO (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics"): A_i = r_i - mean_{j != i} r_j, each
  completion's baseline the mean of the other G - 1 (unbiased: it does not depend on r_i). `none` is the
  paper's RLOO; `batch` is TRL's RLOO `normalize_advantages`, which whitens the *advantages* over the
  whole batch, A = (A - mean(A)) / (std(A) + 1e-4) — not GRPO's division by a std of the rewards, which
  would fold the between-prompt spread of the rewards into the scale. RLOO has no `group` scaling.
- REINFORCE++ (Hu 2025, "REINFORCE++", OpenRLHF's `reinforce`): per-token rewards (the score on the last
  token, -beta * KL_t on every token when the KL is in the reward), their reward-to-go
  G_t = sum_{s >= t} gamma^(s - t) r_s, whitened over the batch's real tokens.
- REINFORCE++-baseline (OpenRLHF's `reinforce_baseline`): the same after subtracting each prompt's mean
  score from its completions' scores (`group_mean`); the caller builds those per-token rewards.

A group whose scores are all the same number (`flat_groups`: max == min) has advantages exactly 0 under every
group baseline: the means are taken in float64 and a flat group's deviations are set to 0, where an fp32 mean
of eight 0.3s is one ulp off and the 1e-4 epsilon would turn that rounding into a same-sign push (TRL's form).

Deliberate difference from OpenRLHF: whitening is `core.stats.whiten` (Bessel-corrected variance, as for
PPO's GAE advantages) where OpenRLHF divides by the biased one; at a batch's thousands of tokens the two
differ by far less than the noise.
"""

from __future__ import annotations

import torch

from ppoforge.core.advantages import gae
from ppoforge.core.stats import global_mean_var, local_sum, whiten

SCALES = ("group", "batch", "none")
RLOO_SCALES = ("batch", "none")
STD_EPS = 1e-4  # TRL's GRPO: a group whose rewards are all equal gets advantages 0, not 0 / 0


def groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) -> (B / G, G): row k holds prompt k's G completions."""
    if group_size < 2 or x.shape[0] % group_size:
        raise ValueError(f"a batch of {x.shape[0]} is not whole groups of {group_size} >= 2 completions")
    return x.view(-1, group_size)


def flat_groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) -> (B / G,) bool: every score of the group is the same number (max == min). The one test of "no
    signal" (the advantages, `skip_flat_rollouts`, dynamic sampling, `frac_reward_zero_std`): a std or a
    mean in fp32 is not it — eight copies of 0.3 have an fp32 mean one ulp off 0.3 and a std of 3e-8."""
    g = groups(x, group_size)
    return g.amax(1) == g.amin(1)


def group_mean(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) each entry's group mean, accumulated in float64 (as exact as the scores allow)."""
    return groups(x.double(), group_size).mean(1).repeat_interleave(group_size).to(x.dtype)


def centered(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) x - its group's mean, in float64, and exactly 0 on a flat group (`flat_groups`)."""
    flat = flat_groups(x, group_size).repeat_interleave(group_size)
    wide = x.double()
    dev = wide - groups(wide, group_size).mean(1).repeat_interleave(group_size)
    return dev.masked_fill(flat, 0.0).to(x.dtype)


def _scaled(adv: torch.Tensor, rewards: torch.Tensor, group_size: int, scale: str, eps: float,
            all_sum=None) -> torch.Tensor:
    if scale == "none":
        return adv
    if scale == "group":  # float64: a flat group's std is exactly 0, and its advantages are already 0
        std = groups(rewards.double(), group_size).std(1).repeat_interleave(group_size).to(rewards.dtype)
    elif scale == "batch":
        std = global_mean_var(rewards, None, all_sum or local_sum)[1].sqrt()  # one process: the same sums
        std = std.expand_as(rewards)
    else:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    return adv / (std + eps)


def grpo_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = STD_EPS,
                    all_sum=None) -> torch.Tensor:
    """(B,) A_i = (r_i - mean_group(r)) / (std + eps); see the module docstring for `scale`. `all_sum`
    (data parallel: a sum over ranks, whose shards hold whole groups) makes `batch`'s std global."""
    return _scaled(centered(rewards, group_size), rewards, group_size, scale, eps, all_sum)


def rloo_advantages(rewards: torch.Tensor, group_size: int, scale: str = "none", eps: float = STD_EPS,
                    all_sum=None) -> torch.Tensor:
    """(B,) A_i = r_i - (sum_group(r) - r_i) / (G - 1); `batch`: then (A - mean(A)) / (std(A) + eps) over
    the batch (all ranks' with `all_sum`), TRL's RLOO `normalize_advantages`."""
    # r_i - (sum - r_i) / (G - 1) = G / (G - 1) (r_i - mean): exactly 0 on a flat group
    adv = centered(rewards, group_size) * (group_size / (group_size - 1))
    if scale == "none":
        return adv
    if scale != "batch":
        raise ValueError(f"rloo's scale must be one of {RLOO_SCALES}, got {scale!r}")
    mean, var = global_mean_var(adv, None, all_sum or local_sum)
    return (adv - mean) / (var.sqrt() + eps)


def reward_to_go(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """(B, T) G_t = r_t + gamma * G_{t+1} within each response's real tokens, 0 on padding.

    GAE with V = 0 and lambda = 1 is exactly the discounted reward-to-go, so this is `core.gae`'s scan."""
    rewards = rewards * mask
    next_mask = torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], 1)
    done = (1.0 - next_mask).T.contiguous()  # 1 at the last real token and on padding
    zeros = torch.zeros_like(done)
    ret, _ = gae(rewards.T.contiguous(), zeros, zeros, done, done, gamma, 1.0)
    return ret.T * mask


def reinforce_pp_advantages(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, all_sum=None
                            ) -> torch.Tensor:
    """(B, T) REINFORCE++: the per-token rewards' reward-to-go, whitened over the batch's real tokens
    (all ranks' with `all_sum`)."""
    return whiten(reward_to_go(rewards, mask, gamma), mask, all_sum=all_sum)


def group_reward_stats(rewards: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """TRL's GRPO diagnostics: `reward_std`, the mean over groups of the group's sample std, and
    `frac_reward_zero_std`, the share of groups whose rewards are all equal (advantage 0: no signal)."""
    std = groups(rewards, group_size).std(1)
    return {"reward_std": std.mean(), "frac_reward_zero_std": flat_groups(rewards, group_size).float().mean()}
