"""The accumulation contract: token-share-weighted micro-batch means sum to the mini-batch token mean."""

import pytest
import torch

from ppoforge.core.accumulation import token_share
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
