"""Masked statistics, whitening, and the running normalizer."""

import numpy as np
import pytest
import torch

from ppoforge.core.stats import RunningMeanStd, masked_mean, masked_var, whiten


def test_masked_mean_divides_by_real_entries():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    torch.testing.assert_close(masked_mean(x, mask), torch.tensor(2.0))  # (1 + 2 + 3) / 3
    torch.testing.assert_close(masked_mean(x, mask, dim=1), torch.tensor([1.5, 3.0]))


def test_masked_var_matches_torch_var_on_real_entries():
    x = torch.tensor([1.0, 2.0, 4.0, 50.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    torch.testing.assert_close(masked_var(x, mask), torch.tensor([1.0, 2.0, 4.0]).var())


def test_whiten_zero_mean_unit_std_and_zero_padding():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 99.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])
    w = whiten(x, mask)
    real = w[:4]
    torch.testing.assert_close(real.mean(), torch.tensor(0.0), atol=1e-6, rtol=0)
    torch.testing.assert_close(real.std(), torch.tensor(1.0), atol=1e-4, rtol=0)
    assert w[4] == 0


def test_running_mean_std_equals_batch_statistics():
    rng = np.random.default_rng(0)
    data = rng.normal(3.0, 2.0, size=(1000, 3))
    rms = RunningMeanStd((3,), epsilon=0.0)
    for chunk in np.array_split(data, 7):
        rms.update(chunk)
    np.testing.assert_allclose(rms.mean, data.mean(0), rtol=1e-10)
    np.testing.assert_allclose(rms.var, data.var(0), rtol=1e-10)
    normalized = rms.normalize(data, clip=10.0)
    np.testing.assert_allclose(normalized.mean(0), 0.0, atol=1e-5)
    assert np.abs(rms.normalize(np.full((1, 3), 1e6), clip=5.0)).max() == 5.0
    restored = RunningMeanStd((3,))
    restored.load_state_dict(rms.state_dict())
    np.testing.assert_array_equal(restored.mean, rms.mean)


def test_binomial_interval_is_wilsons():
    from ppoforge.core.stats import binomial_interval

    # 5 of 10: p = 0.5, z^2 = 3.8416: centre 0.5, half = 1.96 / 1.38416 * sqrt(0.025 + 0.009604) = 0.26341
    lo, hi = binomial_interval(5, 10)
    assert lo == pytest.approx(0.23659, abs=1e-5) and hi == pytest.approx(0.76341, abs=1e-5)
    # 0 of 10: not a point at 0 (the normal approximation's): [0, z^2 / (n + z^2)] = [0, 0.27754]
    assert binomial_interval(0, 10) == pytest.approx((0.0, 0.27754), abs=1e-5)
    assert binomial_interval(10, 10) == pytest.approx((0.72246, 1.0), abs=1e-5)
    assert binomial_interval(0, 0) == (0.0, 1.0)
