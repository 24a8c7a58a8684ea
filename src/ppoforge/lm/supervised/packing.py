"""Batches of supervised examples: one per row (right-padded), or several packed into a row.

Packing concatenates examples into rows of at most `max_length` tokens, in order (first fit into the
current row), so fewer pad tokens are computed. Each packed example keeps its own positions (restarting
at 0) and attends only to itself (a block-diagonal causal mask, `attention.segment_causal_mask`): its
logits are those it has alone — the leak TRL's plain packing has (tested).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ppoforge.lm.models.attention import segment_causal_mask, segment_positions
from ppoforge.lm.supervised.examples import Example


@dataclass
class TokenBatch:
    ids: torch.Tensor        # (B, L) int64, right-padded
    loss_mask: torch.Tensor  # (B, L) float 0/1: token t is a target (predicted from position t - 1)
    segments: torch.Tensor   # (B, L) int64: 0 padding, k >= 1 the k-th example packed into the row

    def attention(self) -> torch.Tensor:
        return segment_causal_mask(self.segments)

    def positions(self) -> torch.Tensor:
        return segment_positions(self.segments)

    @property
    def loss_tokens(self) -> torch.Tensor:
        return self.loss_mask[:, 1:].sum()


def pack(examples: list[Example], max_length: int) -> list[list[Example]]:
    """Examples grouped into rows of at most max_length tokens, in order; every example fits alone."""
    rows, current, used = [], [], 0
    for ex in examples:
        if current and used + len(ex.ids) > max_length:
            rows.append(current)
            current, used = [], 0
        current.append(ex)
        used += len(ex.ids)
    return rows + ([current] if current else [])


def collate(rows: list[list[Example]], pad_id: int, device) -> TokenBatch:
    width = max(sum(len(ex.ids) for ex in row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # cpu: filled on the host, moved at the end
    mask = torch.zeros(len(rows), width)  # cpu: moved at the end
    segments = torch.zeros(len(rows), width, dtype=torch.long)  # cpu: moved at the end
    for i, row in enumerate(rows):
        at = 0
        for k, ex in enumerate(row, 1):
            n = len(ex.ids)
            ids[i, at:at + n] = torch.tensor(ex.ids)  # cpu: into a host tensor
            mask[i, at:at + n] = torch.tensor(ex.loss_mask, dtype=torch.float32)  # cpu: into a host tensor
            mask[i, at] = 0.0  # a sample's first token has no prediction inside its own segment
            segments[i, at:at + n] = k
            at += n
    return TokenBatch(ids.to(device), mask.to(device), segments.to(device))
