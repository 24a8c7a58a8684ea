"""The accumulation contract: unit-share-weighted micro-batch losses sum to the mini-batch loss, for every
loss aggregation (token mean, sequence mean of token means, Dr. GRPO's sum over a constant)."""

import pytest
import torch

from ppoforge.core.accumulation import LOSS_AGGREGATIONS, loss_aggregation, token_share, unit_share
from ppoforge.core.stats import masked_mean


@pytest.mark.parametrize("splits", [[8], [1] * 8, [2, 2, 2, 2], [3, 5], [7, 1]])
def test_token_share_weighted_means_equal_the_mini_batch_mean_for_any_split(splits):
    torch.manual_seed(0)
    x = torch.randn(8, 6, dtype=torch.float64)
    # ragged responses: 1..6 real tokens; one micro-batch may hold far more tokens than another
    mask = (torch.arange(6)[None] < torch.tensor([1, 6, 2, 6, 3, 1, 5, 4])[:, None]).double()
    total = mask.sum()
    accumulated, start = torch.zeros((), dtype=torch.float64), 0
    for n in splits:
        rows = slice(start, start + n)
        accumulated += token_share(mask[rows], total) * masked_mean(x[rows], mask[rows])
        start += n
    torch.testing.assert_close(accumulated, masked_mean(x, mask), rtol=1e-12, atol=1e-12)
    # what the common bug computes instead: each micro-batch mean weighted 1 / number of micro-batches
    if len(splits) > 1:
        naive = sum(masked_mean(x[s:s + n], mask[s:s + n]) for s, n in
                    zip([sum(splits[:i]) for i in range(len(splits))], splits, strict=True)) / len(splits)
        assert not torch.allclose(naive, masked_mean(x, mask))


def test_a_micro_batch_without_tokens_weighs_nothing():
    assert token_share(torch.zeros(2, 3), torch.tensor(5.0)) == 0
    assert token_share(torch.zeros(2, 3), torch.tensor(0.0)) == 0  # no division by zero


X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 7.0, 7.0]])  # 7 on padding
M = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize(("name", "want"), [
    ("token_mean", 2.5),           # (1 + 2 + 3 + 4) / 4 tokens
    ("seq_mean_token_mean", 3.0),  # mean of the sequence means 2 and 4
    ("seq_sum_norm", 1.0),         # (1 + 2 + 3 + 4) / (2 sequences x horizon 5)
])
def test_loss_aggregations_hand_values(name, want):
    agg = loss_aggregation(name, horizon=5)
    torch.testing.assert_close(agg.reduce(X, M), torch.tensor(want))
    assert float(agg.units(M)) == (4 if name == "token_mean" else 2)


@pytest.mark.parametrize("name", LOSS_AGGREGATIONS)
@pytest.mark.parametrize("splits", [[8], [1] * 8, [3, 5], [7, 1]])
def test_every_aggregation_is_split_invariant_with_the_normalizer_fixed_per_step(name, splits):
    torch.manual_seed(0)
    x = torch.randn(8, 6, dtype=torch.float64)
    mask = (torch.arange(6)[None] < torch.tensor([1, 6, 2, 6, 3, 1, 5, 4])[:, None]).double()
    agg = loss_aggregation(name, horizon=6)
    mini_units = agg.units(mask)  # counted once, before the first micro-batch
    accumulated, start = torch.zeros((), dtype=torch.float64), 0
    for n in splits:
        rows = slice(start, start + n)
        accumulated += unit_share(agg.units(mask[rows]), mini_units) * agg.reduce(x[rows], mask[rows])
        start += n
    torch.testing.assert_close(accumulated, agg.reduce(x, mask), rtol=1e-12, atol=1e-12)


def test_token_mean_is_the_token_share_contract():
    # the PPO path's weights, unchanged: unit_share of token counts == token_share
    agg = loss_aggregation("token_mean", horizon=3)
    assert agg.reduce is masked_mean
    assert unit_share(agg.units(M[:1]), agg.units(M)) == token_share(M[:1], M.sum()) == 0.75


def test_unknown_aggregation_raises():
    with pytest.raises(ValueError, match="token_mean"):
        loss_aggregation("sum", horizon=3)
