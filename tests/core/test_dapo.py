"""DAPO's dynamic-sampling filter, soft overlong penalty and truncated-completion mask against hand-computed
values (core/dapo.py)."""

import pytest
import torch

from ppoforge.core.critic_free import group_reward_stats
from ppoforge.core.dapo import finished_mask, informative_groups, overlong_penalty


def test_informative_groups_are_those_whose_scores_disagree():
    # G = 3: [1, 1, 1] all agree; [0, 1, 0] differ; [0.5, 0.5, 0.5] agree; [-1, -1, 2] differ
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.5, -1.0, -1.0, 2.0])
    assert informative_groups(scores, 3).tolist() == [False, True, False, True]
    # the groups it drops are exactly what frac_reward_zero_std counts: 2 of 4
    assert float(group_reward_stats(scores, 3)["frac_reward_zero_std"]) == 0.5


def test_informative_groups_need_whole_groups():
    with pytest.raises(ValueError, match="whole groups"):
        informative_groups(torch.zeros(5), 2)


def test_overlong_penalty_is_dapo_eq_13():
    # L_max 10, L_cache 4: 0 up to 6 tokens; (6 - |y|) / 4 from 7 to 10: -0.25, -0.5, -0.75, -1; -1 beyond
    lengths = torch.tensor([1.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0])
    torch.testing.assert_close(overlong_penalty(lengths, 10, 4),
                               torch.tensor([0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0]), rtol=0, atol=0)
    # verl's penalty_factor scales it: factor 0.5 at 8 tokens is -(8 - 6) / 4 * 0.5 = -0.25
    torch.testing.assert_close(overlong_penalty(lengths, 10, 4, factor=0.5),
                               torch.tensor([0.0, 0.0, -0.125, -0.25, -0.375, -0.5, -0.5]), rtol=0, atol=0)


def test_overlong_penalty_without_a_buffer_is_off_within_the_budget():
    # L_cache 0: eq. 13's middle case is empty, so 0 up to L_max and -1 past it (no sampled response is)
    lengths = torch.tensor([0.0, 5.0, 10.0, 11.0])
    assert overlong_penalty(lengths, 10, 0, factor=2.0).tolist() == [0.0, 0.0, 0.0, -2.0]
    scores = torch.tensor([0.3, -1.7, 2.0])  # adding the "off" penalty leaves every score bit-identical
    assert torch.equal(scores + overlong_penalty(torch.tensor([1.0, 9.0, 10.0]), 10, 0), scores)


def test_finished_mask_zeroes_truncated_rows_only_when_asked():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    finished = torch.tensor([True, False, True])  # row 1 ran out of tokens
    assert finished_mask(mask, finished, True).tolist() == [[1, 1, 0], [0, 0, 0], [1, 0, 0]]
    assert torch.equal(finished_mask(mask, finished, False), mask)
    # token_mean's loss units (tokens) leave the truncated row out: 6 -> 3 (TRL's num_items_in_batch)
    assert finished_mask(mask, finished, True).sum() == 3 and mask.sum() == 6
