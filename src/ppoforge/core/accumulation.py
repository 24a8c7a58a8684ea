"""Gradient accumulation that gives exactly the mini-batch's gradient, however it is split.

A mini-batch of responses is run as several micro-batches, each backpropagated on its own. The loss is
an aggregate over the mini-batch's loss units (tokens, or sequences); each micro-batch computes the
aggregate over its own units, so it must be weighted by its share of the mini-batch's units:

    loss_mini = sum_k (units_k / units_mini) * loss_k

Dividing every micro-batch by the number of micro-batches instead (the common bug) weights a token of a
short micro-batch more than one of a long one. The weights need the mini-batch's unit count before the
first backward, so the trainer counts it once per optimizer step (and, across ranks, all-reduces it).

`loss_agg` picks how per-token losses (B, T) become one number; each is (a micro-batch's aggregate, its
units), and any split of a mini-batch, weighted by the shares, gives the whole mini-batch's aggregate:

- `token_mean`: sum over real tokens / their number (PPO as TRL; DAPO's token-level loss). Unit: token.
- `seq_mean_token_mean`: each sequence's token mean, averaged over sequences (the GRPO paper; TRL's
  `loss_type="grpo"`): a token of a short response weighs more. Unit: sequence.
- `seq_sum_norm`: sum over real tokens / (sequences x `horizon`), the constant max_new_tokens (Dr. GRPO,
  Liu et al. 2025: no length normalization, so no bias toward long wrong answers). Unit: sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from ppoforge.core.stats import masked_mean, masked_sum

LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_sum_norm")


def token_share(micro_mask: torch.Tensor, mini_tokens: torch.Tensor) -> torch.Tensor:
    """Weight of a micro-batch's token-mean loss: its real tokens / the mini-batch's real tokens."""
    return micro_mask.sum() / mini_tokens.clamp(min=1)


def unit_share(micro_units: torch.Tensor, mini_units: torch.Tensor) -> torch.Tensor:
    """Weight of a micro-batch's aggregate: its loss units / the mini-batch's (fixed once per step)."""
    return micro_units / mini_units.clamp(min=1)


class Aggregation(NamedTuple):
    reduce: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x (B, T), mask (B, T)) -> a micro's loss
    units: Callable[[torch.Tensor], torch.Tensor]                 # mask (B, T) -> its loss units, a 0-dim tensor


def _tokens(mask: torch.Tensor) -> torch.Tensor:
    return mask.sum()


def _sequences(mask: torch.Tensor) -> torch.Tensor:
    return mask.new_tensor(float(mask.shape[0]))


def _seq_mean_token_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (masked_sum(x, mask, 1) / mask.sum(1).clamp(min=1)).mean()


def loss_aggregation(name: str, horizon: int) -> Aggregation:
    """The (reduce, units) pair of `name`; `horizon` is seq_sum_norm's constant token count."""
    if name == "token_mean":
        return Aggregation(masked_mean, _tokens)  # masked_mean itself: PPO's loss, bit for bit as before
    if name == "seq_mean_token_mean":
        return Aggregation(_seq_mean_token_mean, _sequences)
    if name == "seq_sum_norm":
        return Aggregation(lambda x, mask: masked_sum(x, mask) / (mask.shape[0] * horizon), _sequences)
    raise ValueError(f"loss aggregation must be one of {LOSS_AGGREGATIONS}, got {name!r}")
