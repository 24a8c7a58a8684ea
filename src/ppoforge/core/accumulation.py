"""Gradient accumulation that gives exactly the mini-batch's gradient, however it is split.

A mini-batch of responses is run as several micro-batches, each backpropagated on its own. The loss is
a mean over the mini-batch's real tokens; each micro-batch computes the mean over its own tokens, so it
must be weighted by its share of the mini-batch's tokens:

    mean_mini = sum_k (tokens_k / tokens_mini) * mean_k

Dividing every micro-batch by the number of micro-batches instead (the common bug) weights a token of a
short micro-batch more than one of a long one. The weights need the mini-batch's token count before the
first backward, so the trainer counts it once per optimizer step (and, across ranks, all-reduces it).
"""

from __future__ import annotations

import torch


def token_share(micro_mask: torch.Tensor, mini_tokens: torch.Tensor) -> torch.Tensor:
    """Weight of a micro-batch's token-mean loss: its real tokens / the mini-batch's real tokens."""
    return micro_mask.sum() / mini_tokens.clamp(min=1)
