"""Masked statistics, whitening and a running mean/std normalizer.

Masks are 0/1 tensors of the same shape as the data; a masked mean divides by the number of real
entries, never by the padded size (the classic RLHF normalization bug).
"""

from __future__ import annotations

import numpy as np
import torch


def masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x * mask, exactly 0 where mask is 0 even when x is inf or NaN there (inf * 0 would be NaN).
    Zeroed in place on the product, not by `torch.where`, whose output takes the condition's layout: a
    transposed x would then be summed in another order (1 rank vs 2 ranks stopped being bit-equal)."""
    return (x * mask).masked_fill_(mask == 0, 0.0)


def masked_sum(x: torch.Tensor, mask: torch.Tensor | None, dim=None) -> torch.Tensor:
    """Sum of x * mask; a masked entry adds exactly 0 (`masked`)."""
    if mask is None:
        return x.sum() if dim is None else x.sum(dim)
    weighted = masked(x, mask)
    return weighted.sum() if dim is None else weighted.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor | None = None, dim=None) -> torch.Tensor:
    """Mean over entries where mask is 1 (all entries when mask is None)."""
    if mask is None:
        return x.mean() if dim is None else x.mean(dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor | None = None, unbiased: bool = True) -> torch.Tensor:
    """Variance over masked entries, with Bessel's correction by default (as torch.var)."""
    mean = masked_mean(x, mask)
    sq = masked_mean((x - mean) ** 2, mask)
    if not unbiased:
        return sq
    n = x.numel() if mask is None else mask.sum()
    return sq * n / (n - 1).clamp(min=1) if torch.is_tensor(n) else sq * n / max(n - 1, 1)


def local_sum(t: torch.Tensor) -> torch.Tensor:
    """`all_sum` at world 1: statistics computed as N ranks compute them, so 1 and N ranks agree."""
    return t


def global_mean_var(x: torch.Tensor, mask: torch.Tensor | None, all_sum) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and Bessel-corrected variance over the masked entries of every rank's `x`: `all_sum` sums a
    tensor over ranks (runtime.distributed.all_sum). Two passes like `masked_var` (mean first, then the
    centered squares), summed in float64 and returned in x's dtype: the sum of two ranks' partial sums
    then rounds to what one process's single sum does (in fp32 the order of the additions showed: 2 ranks
    trained 5e-5 away from 1 process after one PPO update, Adam amplifying the whitened advantages' ulps)."""
    x64 = x.double()
    mask = torch.ones_like(x64) if mask is None else mask.double()
    sums = all_sum(torch.stack([masked_sum(x64, mask), mask.sum()]))
    n = sums[1]
    mean = sums[0] / n.clamp(min=1)
    sq = all_sum(masked_sum((x64 - mean) ** 2, mask).reshape(1))[0] / n.clamp(min=1)
    return mean.to(x.dtype), (sq * n / (n - 1).clamp(min=1)).to(x.dtype)


def whiten(x: torch.Tensor, mask: torch.Tensor | None = None, shift_mean: bool = True,
           eps: float = 1e-8, all_sum=None) -> torch.Tensor:
    """(x - mean) / std over the masked entries; padded entries come back as 0. With `all_sum` (data
    parallel: a sum over ranks) the statistics are those of all ranks' entries together; one process
    computes them the same way (float64 sums, `global_mean_var`), so 1 and N ranks agree to the bit."""
    mean, var = global_mean_var(x, mask, all_sum or local_sum)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out if mask is None else out * mask


class RunningMeanStd:
    """Running mean and variance over a stream of batches (Chan et al.'s parallel update), in float64.

    Used for observation and return normalization in control PPO. `state_dict` holds plain lists so
    checkpoints load with `torch.load(weights_only=True)`.
    """

    def __init__(self, shape: tuple[int, ...] = (), epsilon: float = 1e-4):
        self.mean = np.zeros(shape, np.float64)
        self.var = np.ones(shape, np.float64)
        self.count = epsilon

    def update(self, batch: np.ndarray) -> None:
        batch = np.asarray(batch, np.float64)
        b_mean, b_var, b_count = batch.mean(0), batch.var(0), batch.shape[0]
        delta = b_mean - self.mean
        total = self.count + b_count
        self.mean = self.mean + delta * b_count / total
        m2 = self.var * self.count + b_var * b_count + delta**2 * self.count * b_count / total
        self.var = m2 / total
        self.count = total

    def normalize(self, x: np.ndarray, clip: float, eps: float = 1e-8) -> np.ndarray:
        out = (x - self.mean) / np.sqrt(self.var + eps)
        return np.clip(out, -clip, clip).astype(np.float32)

    def state_dict(self) -> dict:
        return {"mean": self.mean.tolist(), "var": self.var.tolist(), "count": float(self.count)}

    def load_state_dict(self, state: dict) -> None:
        self.mean = np.asarray(state["mean"], np.float64)
        self.var = np.asarray(state["var"], np.float64)
        self.count = float(state["count"])


def binomial_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson's score interval for a success rate (Wilson 1927; Brown, Cai & DasGupta 2001 recommend it
    over the normal approximation, which collapses to a point at 0 and n successes): the 95 % interval
    at z = 1.96. (0, 1) when n is 0. It treats the n trials as independent: several samples of one
    problem are not, so over samples it is narrower than over problems."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * float(np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)))
    return max(0.0, centre - half), min(1.0, centre + half)
