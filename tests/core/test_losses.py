"""PPO losses against hand-computed values."""

import math

import torch

from ppoforge.core.losses import clip_stats, entropy_from_logits, policy_loss, value_loss


def test_policy_loss_hand_values():
    # ratios r = exp(logp - old) = [1.5, 0.5, 1.0], clip 0.2, adv = [1, 1, -2]
    # entry 0: max(-1*1.5, -1*1.2) = -1.2 (clipped, active)
    # entry 1: max(-1*0.5, -1*0.8) = -0.5 (unclipped chosen; |r - 1| > clip so it counts as clipped)
    # entry 2: max( 2*1.0,  2*1.0) =  2.0
    # loss = mean(-1.2, -0.5, 2.0) = 0.1
    old = torch.zeros(3)
    logp = torch.log(torch.tensor([1.5, 0.5, 1.0]))
    adv = torch.tensor([1.0, 1.0, -2.0])
    loss, stats = policy_loss(logp, old, adv, clip=0.2)
    torch.testing.assert_close(loss, torch.tensor(0.1))
    torch.testing.assert_close(stats["clipfrac"], torch.tensor(2 / 3))
    # approx_kl = mean((r - 1) - log r) = mean(0.5 - log 1.5, -0.5 - log 0.5, 0)
    expected_kl = ((0.5 - math.log(1.5)) + (-0.5 - math.log(0.5))) / 3
    torch.testing.assert_close(stats["approx_kl"], torch.tensor(expected_kl))
    torch.testing.assert_close(stats["ratio"], torch.tensor(1.0))


def test_policy_loss_mask_ignores_padding_and_no_stats_path():
    logp, old, adv = torch.tensor([0.1, 5.0]), torch.zeros(2), torch.tensor([1.0, 100.0])
    mask = torch.tensor([1.0, 0.0])
    loss, stats = policy_loss(logp, old, adv, clip=0.2, mask=mask, with_stats=False)
    # only entry 0: r = e^0.1 = 1.105 < 1.2 -> -1 * 1.105
    torch.testing.assert_close(loss, -torch.exp(torch.tensor(0.1)))
    assert stats == {}


# ratios [1.5, 0.5, 1.0, 1.3], adv [1, -1, -2, 1], clip 0.2
RATIOS, ADV = torch.tensor([1.5, 0.5, 1.0, 1.3]), torch.tensor([1.0, -1.0, -2.0, 1.0])


def test_clip_higher_hand_values():
    logp, old = torch.log(RATIOS), torch.zeros(4)
    # clip_high 0.4, range [0.8, 1.4]:
    # e0: max(-1.5, -1.4) = -1.4 (clipped);  e1: max(0.5, 0.8) = 0.8 (clipped);  e2: 2.0;  e3: max(-1.3, -1.3)
    # loss = (-1.4 + 0.8 + 2.0 - 1.3) / 4 = 0.025; outside the range: e0, e1 -> clipfrac 0.5
    loss, stats = policy_loss(logp, old, ADV, clip=0.2, clip_high=0.4)
    torch.testing.assert_close(loss, torch.tensor(0.025))
    torch.testing.assert_close(stats["clipfrac"], torch.tensor(0.5))
    # symmetric [0.8, 1.2]: e3 is clipped too: (-1.2 + 0.8 + 2.0 - 1.2) / 4 = 0.1; clipfrac 3 / 4
    loss, stats = policy_loss(logp, old, ADV, clip=0.2)
    torch.testing.assert_close(loss, torch.tensor(0.1))
    torch.testing.assert_close(stats["clipfrac"], torch.tensor(0.75))
    # `reduce` replaces the mean: the sum of the per-entry losses above, 0.4
    loss, _ = policy_loss(logp, old, ADV, clip=0.2, reduce=lambda x, mask: x.sum(), with_stats=False)
    torch.testing.assert_close(loss, torch.tensor(0.4))


def test_clip_stats_count_only_active_clipping():
    logp, old = torch.log(RATIOS), torch.zeros(4)
    # clip_high 0.4: low = r < 0.8 with A < 0 (e1); high = r > 1.4 with A > 0 (e0)
    stats = clip_stats(logp, old, ADV, 0.2, 0.4)
    assert [float(stats[k]) for k in ("low", "high", "region")] == [0.25, 0.25, 0.5]
    # symmetric: e3 (1.3 > 1.2, A > 0) is high too; a ratio below 0.8 with A > 0 would not count
    stats = clip_stats(logp, old, ADV, 0.2)
    assert [float(stats[k]) for k in ("low", "high", "region")] == [0.25, 0.5, 0.75]
    stats = clip_stats(logp, old, -ADV, 0.2)  # signs flipped: every clipped entry's gradient is live
    assert [float(stats[k]) for k in ("low", "high", "region")] == [0.0, 0.0, 0.0]


def test_value_loss_hand_values_clipped_and_unclipped():
    values, old, ret = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    # unclipped: 0.5 * mean((2-0)^2, (0-1)^2) = 0.5 * 2.5 = 1.25
    loss, stats = value_loss(values, old, ret, clip=None)
    torch.testing.assert_close(loss, torch.tensor(1.25))
    # clip 0.5: V_clipped = [1.5, 0.0]; clipped sq = [2.25, 1]; max with unclipped = [4, 1] -> 0.5 * 2.5
    loss, stats = value_loss(values, old, ret, clip=0.5)
    torch.testing.assert_close(loss, torch.tensor(1.25))
    # returns above: ret = [3, 1]: unclipped (1, 1), clipped (1.5^2=2.25, 1) -> max mean = 1.625 -> 0.8125
    loss, stats = value_loss(values, old, torch.tensor([3.0, 1.0]), clip=0.5)
    torch.testing.assert_close(loss, torch.tensor(0.8125))
    torch.testing.assert_close(stats["clipfrac"], torch.tensor(0.5))


def test_entropy_uniform_and_peaked():
    torch.testing.assert_close(entropy_from_logits(torch.zeros(4)), torch.tensor(math.log(4)))
    assert entropy_from_logits(torch.tensor([100.0, 0.0])) < 1e-6
