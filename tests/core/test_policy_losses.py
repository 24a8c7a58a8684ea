"""GSPO and CISPO (and PPO's record) against hand-computed values: losses, clipping on both sides, masks,
gradients, and the three agreeing on policy."""

import math

import pytest
import torch

from ppoforge.core.accumulation import loss_aggregation
from ppoforge.core.losses import clip_stats, policy_loss
from ppoforge.core.policy_losses import (
    POLICY_LOSSES,
    cispo_loss,
    gspo_loss,
    ppo_loss,
    sequence_log_ratio,
    truncated_is_weights,
    weighted_reduce,
)

STAT_KEYS = {"approx_kl", "clipfrac", "ratio", "low", "high", "region"}

# GSPO: 3 rows of 3 tokens, real tokens 3, 2, 1. Each row's token log ratios are log s_i plus deviations
# that sum to 0 over its real tokens, so its mean log ratio is log s_i; padding holds garbage (7.0).
SEQ_RATIOS = torch.tensor([1.5, 0.5, 1.1])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
DEVIATIONS = torch.tensor([[0.2, -0.3, 0.1], [0.4, -0.4, 7.0], [0.0, 7.0, -7.0]])
SEQ_ADV = torch.tensor([1.0, -2.0, 0.5])


def _gspo_inputs():
    log_ratio = torch.log(SEQ_RATIOS)[:, None] + DEVIATIONS
    old = -torch.arange(9.0).reshape(3, 3) / 4
    return (old + log_ratio).requires_grad_(), old, SEQ_ADV[:, None] * MASK


def test_sequence_log_ratio_is_each_rows_mean_over_its_real_tokens():
    logp, old, _ = _gspo_inputs()
    torch.testing.assert_close(sequence_log_ratio(logp, old, MASK), torch.log(SEQ_RATIOS)[:, None].expand(3, 3))
    empty = sequence_log_ratio(logp, old, torch.zeros(3, 3))  # no real token: log s = 0, s = 1 (TRL's clamp)
    assert torch.equal(empty, torch.zeros(3, 3))


def test_gspo_hand_values_clip_both_sides_per_sequence():
    # clip 0.2 -> [0.8, 1.2], on each row's s_i (every token of a row the same):
    # row 0: s 1.5, A +1: max(-1.5, -1.2) = -1.2 (upper clip active) x 3 tokens
    # row 1: s 0.5, A -2: max(1.0, 1.6) = 1.6 (lower clip active) x 2 tokens
    # row 2: s 1.1, A +0.5: max(-0.55, -0.6) = -0.55 (inside) x 1 token
    logp, old, adv = _gspo_inputs()
    loss, stats = gspo_loss(logp, old, adv, 0.2, MASK)
    # token_mean: (3 x -1.2 + 2 x 1.6 - 0.55) / 6 = -0.95 / 6
    torch.testing.assert_close(loss, torch.tensor(-0.95 / 6))
    # clipped rows get no gradient; row 2's token: d(-0.5 s_2 / 6) / d logp = -0.5 x 1.1 / 6; padding none
    loss.backward()
    want = torch.zeros(3, 3)
    want[2, 0] = -0.55 / 6
    torch.testing.assert_close(logp.grad, want)
    # token-weighted stats of s_i: outside [0.8, 1.2]: rows 0, 1 = 5 of 6 tokens; mean s = (4.5 + 1 + 1.1) / 6
    assert stats.keys() == STAT_KEYS
    torch.testing.assert_close(stats["clipfrac"], torch.tensor(5 / 6))
    torch.testing.assert_close(stats["ratio"], torch.tensor(1.1))
    assert [float(stats[k]) for k in ("low", "high", "region")] == pytest.approx([2 / 6, 3 / 6, 5 / 6])
    # approx_kl stays the per-token k3 (r - 1) - log r over the 6 real tokens
    r = torch.exp(logp.detach() - old)[MASK.bool()]
    torch.testing.assert_close(stats["approx_kl"], ((r - 1) - r.log()).mean())
    # seq_mean_token_mean (GRPO's, the paper's): (-1.2 + 1.6 - 0.55) / 3
    grpo = loss_aggregation("seq_mean_token_mean", 3).reduce
    torch.testing.assert_close(gspo_loss(logp, old, adv, 0.2, MASK, reduce=grpo)[0], torch.tensor(-0.05))


def test_gspo_unclipped_gradient_is_the_rows_mean():
    # clip 1 -> [0, 2]: nothing clipped; token_mean loss = sum_i |y_i| (-A_i s_i) / 6, and each real token
    # of row i moves log s_i by 1 / |y_i|: d/d logp_it = -A_i s_i / 6 on every real token, 0 on padding
    logp, old, adv = _gspo_inputs()
    loss, stats = gspo_loss(logp, old, adv, 1.0, MASK)
    torch.testing.assert_close(loss, torch.tensor((3 * -1.5 + 2 * 1.0 - 0.55) / 6))
    loss.backward()
    per_row = torch.tensor([-1.5, 1.0, -0.55]) / 6
    torch.testing.assert_close(logp.grad, per_row[:, None] * MASK)
    assert float(stats["clipfrac"]) == 0
    # clip_high 0.6 -> [0.8, 1.6]: row 0 (1.5) is inside now, row 1 still clipped below
    loss, stats = gspo_loss(logp, old, adv, 0.2, MASK, clip_high=0.6)
    torch.testing.assert_close(loss, torch.tensor((3 * -1.5 + 2 * 1.6 - 0.55) / 6))
    assert [float(stats[k]) for k in ("low", "high")] == pytest.approx([2 / 6, 0.0])


def test_gspo_differs_from_token_level_ppo():
    # row 0's token ratios 1.5 e^0.2, 1.5 e^-0.3 = 1.11, 1.5 e^0.1: PPO clips two of its three tokens, GSPO all
    logp, old, adv = _gspo_inputs()
    assert not torch.allclose(ppo_loss(logp, old, adv, 0.2, MASK)[0], gspo_loss(logp, old, adv, 0.2, MASK)[0])


# CISPO: token ratios [1.5, 0.5, 1.0, 1.3], adv [1, -1, -2, 1], logp [-1, -2, -0.5, -1]
RATIOS, ADV, LOGP = torch.tensor([1.5, 0.5, 1.0, 1.3]), torch.tensor([1.0, -1.0, -2.0, 1.0]), torch.tensor(
    [-1.0, -2.0, -0.5, -1.0])


def test_cispo_hand_values_cap_the_weight_and_keep_every_gradient():
    logp, old = LOGP.clone().requires_grad_(), LOGP - torch.log(RATIOS)
    # clip 0.2, no clip_high: cap 1.2, no lower bound: w = sg(min(r, 1.2)) = [1.2, 0.5, 1.0, 1.2]
    # -w A logp = [-1.2 x 1 x -1, -0.5 x -1 x -2, -1 x -2 x -0.5, -1.2 x 1 x -1] = [1.2, -1, -1, 1.2]
    loss, stats = cispo_loss(logp, old, ADV, 0.2)
    torch.testing.assert_close(loss, torch.tensor(0.1))  # (1.2 - 1 - 1 + 1.2) / 4
    # d/d logp = -w A / 4 = [-0.3, 0.125, 0.5, -0.3]: e0 (capped) and e1 (r 0.5 < 0.8 with A < 0) keep
    # their gradients, where PPO's clip gives both 0
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([-0.3, 0.125, 0.5, -0.3]))
    ppo_logp = LOGP.clone().requires_grad_()
    policy_loss(ppo_logp, old, ADV, 0.2)[0].backward()
    assert ppo_logp.grad[0] == 0 and ppo_logp.grad[1] == 0
    # capped: e0, e3 (r > 1.2), both with A > 0 -> clipfrac = high = region = 0.5, low 0; mean r = 4.3 / 4
    assert stats.keys() == STAT_KEYS
    assert [float(stats[k]) for k in ("clipfrac", "low", "high", "region")] == [0.5, 0.0, 0.5, 0.5]
    torch.testing.assert_close(stats["ratio"], torch.tensor(1.075))
    # clip_high 0.4: cap 1.4, w = [1.4, 0.5, 1.0, 1.3]: (1.4 - 1 - 1 + 1.3) / 4 = 0.175; only e0 capped
    loss, stats = cispo_loss(logp, old, ADV, 0.2, clip_high=0.4)
    torch.testing.assert_close(loss, torch.tensor(0.175))
    assert float(stats["clipfrac"]) == 0.25


def test_cispo_mask_ignores_padding():
    # e2 is padding with a garbage log-prob: (1.2 - 1 + 1.2) / 3 over the real tokens
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0])
    logp = LOGP.clone()
    logp[2] = 50.0
    loss, stats = cispo_loss(logp, LOGP - torch.log(RATIOS), ADV, 0.2, mask)
    torch.testing.assert_close(loss, torch.tensor(1.4 / 3))
    torch.testing.assert_close(stats["clipfrac"], torch.tensor(2 / 3))


def test_ppo_record_is_policy_loss_with_clip_stats():
    logp, old = torch.log(RATIOS), torch.zeros(4)
    loss, stats = ppo_loss(logp, old, ADV, 0.2, clip_high=0.4)
    want, want_stats = policy_loss(logp, old, ADV, 0.2, clip_high=0.4)
    assert torch.equal(loss, want) and stats.keys() == STAT_KEYS
    assert stats == want_stats | clip_stats(logp, old, ADV, 0.2, 0.4)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_sum_norm"])
def test_on_policy_all_three_give_the_same_gradient(agg):
    """Ratio 1 (old = logp, as a one-step rollout): no clip acts, CISPO's weight is 1 and GSPO's row mean
    spreads the same gradient, -A d logp aggregated: the choice matters only off policy."""
    gen = torch.Generator().manual_seed(0)
    logp0 = -torch.rand(3, 3, generator=gen) * 3
    reduce = loss_aggregation(agg, 4).reduce
    grads = {}
    for name, loss_fn in POLICY_LOSSES.items():
        logp = logp0.clone().requires_grad_()
        loss, stats = loss_fn(logp, logp.detach(), SEQ_ADV[:, None] * MASK, 0.2, MASK, None, reduce)
        loss.backward()
        grads[name] = logp.grad
        assert float(stats["ratio"]) == 1 and float(stats["clipfrac"]) == 0
    torch.testing.assert_close(grads["gspo"], grads["ppo"])
    torch.testing.assert_close(grads["cispo"], grads["ppo"])
    assert not math.isclose(float(grads["ppo"].abs().sum()), 0)


def test_truncated_is_weights_by_hand():
    """w_t = min(exp(old_logp_t - behaviour_logp_t), C), detached, 0 on padding: ln 3 - ln 1 = ratio 3 capped at
    C 2; ratio 0.5 kept; equal log-probs 1."""
    old = torch.tensor([[math.log(0.3), math.log(0.2), math.log(0.5)]])
    behaviour = torch.tensor([[math.log(0.1), math.log(0.4), math.log(0.5)]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    w = truncated_is_weights(old.requires_grad_(), behaviour, cap=2.0, mask=mask)
    assert torch.allclose(w, torch.tensor([[2.0, 0.5, 0.0]]))
    assert not w.requires_grad


def test_the_corrected_ppo_loss_is_each_tokens_surrogate_times_its_weight_by_hand():
    """TRL's vllm_importance_sampling_correction: per-token loss x w before aggregation. At ratio 1 PPO's
    per-token loss is -A_t, so token_mean gives -(sum_t w_t A_t m_t) / sum_t m_t: (-(2 x 1) - (0.5 x -2)) / 2."""
    logp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    adv = torch.tensor([[1.0, -2.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    w = torch.tensor([[2.0, 0.5, 0.0]])
    reduce = loss_aggregation("token_mean", 3).reduce
    loss, _ = ppo_loss(logp, logp.detach(), adv, 0.2, mask, reduce=weighted_reduce(reduce, w))
    assert loss.item() == pytest.approx((-(2.0 * 1.0) - (0.5 * -2.0)) / 2)
    loss.backward()  # d/dlogp of -w A r at r = 1: -w A on real tokens
    assert torch.allclose(logp.grad, torch.tensor([[-2.0 * 1.0 / 2, -0.5 * -2.0 / 2, 0.0]]))
