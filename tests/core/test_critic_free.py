"""Critic-free advantages (GRPO, RLOO, REINFORCE++) against hand-computed values."""

import math

import pytest
import torch

from ppoforge.core.critic_free import (
    STD_EPS,
    flat_groups,
    group_mean,
    group_reward_stats,
    grpo_advantages,
    reinforce_pp_advantages,
    reward_to_go,
    rloo_advantages,
)
from ppoforge.core.dapo import informative_groups

# two prompts x G = 3 completions, contiguous: prompt 0 scored [1, 2, 3], prompt 1 [0, 0, 0]
REWARDS = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 0.0])


def test_grpo_group_scaling_hand_values():
    # group 0: mean 2, sample std sqrt((1 + 0 + 1) / 2) = 1 -> [-1, 0, 1] / (1 + 1e-4)
    # group 1: all equal: mean 0, std 0 -> 0 / 1e-4 = 0 (no signal, no 0 / 0)
    want = torch.tensor([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]) / torch.tensor([1 + STD_EPS] * 3 + [STD_EPS] * 3)
    torch.testing.assert_close(grpo_advantages(REWARDS, 3), want)
    assert STD_EPS == 1e-4  # TRL's


def test_grpo_batch_and_no_scaling_hand_values():
    centered = torch.tensor([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0])  # r - group mean
    # batch: std of all six rewards: mean 1, squared deviations 0 + 1 + 4 + 1 + 1 + 1 = 8, var 8 / 5
    torch.testing.assert_close(grpo_advantages(REWARDS, 3, "batch"), centered / (math.sqrt(1.6) + 1e-4))
    torch.testing.assert_close(grpo_advantages(REWARDS, 3, "none"), centered)  # Dr. GRPO


def test_rloo_baseline_is_the_mean_of_the_other_completions():
    # 1 - (2 + 3) / 2 = -1.5;  2 - (1 + 3) / 2 = 0;  3 - (1 + 2) / 2 = 1.5;  zeros stay 0
    torch.testing.assert_close(rloo_advantages(REWARDS, 3), torch.tensor([-1.5, 0.0, 1.5, 0.0, 0.0, 0.0]))
    # G = 2: [4, 0] -> [4 - 0, 0 - 4]; = G / (G - 1) * (r - mean) = 2 * [2, -2]
    torch.testing.assert_close(rloo_advantages(torch.tensor([4.0, 0.0]), 2), torch.tensor([4.0, -4.0]))


def test_rloo_batch_scaling_is_trls_normalize_advantages():
    # TRL's RLOO: A = (A - A.mean()) / (A.std() + 1e-4) over the batch's advantages, not a std of the rewards.
    # rewards [0, 1 | 10, 11], G = 2: A = [-1, 1, -1, 1], mean 0, sample std sqrt(4 / 3) -> +-0.866
    # (dividing by the rewards' std, ~5.8, folds the between-prompt spread in: +-0.172)
    adv = rloo_advantages(torch.tensor([0.0, 1.0, 10.0, 11.0]), 2, "batch")
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1.0, -1.0, 1.0]) / (math.sqrt(4 / 3) + STD_EPS))
    assert abs(adv[1].item() - 0.866) < 1e-3
    # TRL's formula written out on REWARDS: A = [-1.5, 0, 1.5, 0, 0, 0]
    a = torch.tensor([-1.5, 0.0, 1.5, 0.0, 0.0, 0.0])
    torch.testing.assert_close(rloo_advantages(REWARDS, 3, "batch"), (a - a.mean()) / (a.std() + 1e-4))


def test_rloo_has_no_group_scaling():
    with pytest.raises(ValueError, match="rloo's scale"):
        rloo_advantages(REWARDS, 3, "group")


def test_groups_are_contiguous_rows():
    # [1, 2 | 3, 0 | 0, 0] with G = 2: means 1.5, 1.5, 0
    torch.testing.assert_close(group_mean(REWARDS, 2), torch.tensor([1.5, 1.5, 1.5, 1.5, 0.0, 0.0]))
    torch.testing.assert_close(grpo_advantages(REWARDS, 2, "none"), torch.tensor([-0.5, 0.5, 1.5, -1.5, 0.0, 0.0]))


@pytest.mark.parametrize("group_size", [1, 4])
def test_a_batch_that_is_not_whole_groups_raises(group_size):
    with pytest.raises(ValueError, match="groups"):
        grpo_advantages(REWARDS, group_size)


def test_unknown_scale_raises():
    with pytest.raises(ValueError, match="scale"):
        grpo_advantages(REWARDS, 3, "token")


def test_group_reward_stats_hand_values():
    stats = group_reward_stats(REWARDS, 3)
    torch.testing.assert_close(stats["reward_std"], torch.tensor(0.5))  # mean of the group stds 1 and 0
    torch.testing.assert_close(stats["frac_reward_zero_std"], torch.tensor(0.5))  # group 1 of 2


MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
TOKEN_REWARDS = torch.tensor([[1.0, 2.0, 3.0, 99.0], [5.0, 99.0, 99.0, 99.0]])  # 99 on padding: ignored


def test_reward_to_go_hand_values():
    # gamma 1: [1 + 2 + 3, 2 + 3, 3] and [5]
    torch.testing.assert_close(reward_to_go(TOKEN_REWARDS, MASK), torch.tensor([[6.0, 5, 3, 0], [5, 0, 0, 0]]))
    # gamma 0.5: t2 = 3; t1 = 2 + 0.5 * 3 = 3.5; t0 = 1 + 0.5 * 3.5 = 2.75
    torch.testing.assert_close(reward_to_go(TOKEN_REWARDS, MASK, 0.5),
                               torch.tensor([[2.75, 3.5, 3, 0], [5, 0, 0, 0]]))


def test_reinforce_pp_whitens_the_reward_to_go_over_the_batch_tokens():
    # returns on real tokens 6, 5, 3, 5: mean 4.75; deviations 1.25, 0.25, -1.75, 0.25;
    # Bessel variance (1.5625 + 0.0625 + 3.0625 + 0.0625) / 3 = 4.75 / 3
    std = math.sqrt(4.75 / 3 + 1e-8)
    want = torch.tensor([[1.25, 0.25, -1.75, 0.0], [0.25, 0.0, 0.0, 0.0]]) / std
    torch.testing.assert_close(reinforce_pp_advantages(TOKEN_REWARDS, MASK), want)


@pytest.mark.parametrize("value,g", [(0.3, 8), (0.7, 12), (0.1, 4), (1 / 3, 6)])
def test_a_group_of_equal_non_dyadic_scores_is_flat_and_its_advantages_exactly_zero(value, g):
    # fp32: eight 0.3s have a mean one ulp off 0.3 and a std of ~3e-8; with the 1e-4 epsilon that rounding
    # became a same-sign advantage of ~3e-4 on every row (0.7, G 12: ~1.2e-3)
    rewards = torch.cat([torch.full((g,), value), torch.arange(g, dtype=torch.float32)])
    flat = flat_groups(rewards, g)
    assert flat.tolist() == [True, False]
    # (rloo's `batch` whitens the advantages over the batch afterwards: a flat group's 0 moves with the mean)
    for adv in (grpo_advantages(rewards, g), grpo_advantages(rewards, g, "batch"), grpo_advantages(rewards, g, "none"),
                rloo_advantages(rewards, g)):
        assert torch.equal(adv[:g], torch.zeros(g)), adv[:g]
    assert informative_groups(rewards, g).tolist() == [False, True]
    assert group_reward_stats(rewards, g)["frac_reward_zero_std"] == 0.5


def test_group_means_are_float64_accurate():
    rewards = torch.tensor([0.1, 0.2, 0.3, 0.4])
    # in float64 the deviations sum to 0 to float64's precision, then round once to fp32
    exact = (rewards.double() - rewards.double().mean()).float()
    assert torch.equal(grpo_advantages(rewards, 4, "none"), exact)
