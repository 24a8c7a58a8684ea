"""Attention masks and position ids for left-padded prompts followed by right-padded responses.

We hand Hugging Face models a ready 4D mask (transformers returns a prepared 4D mask as is) rather than
a 2D one, which skips its per-call mask construction and makes every forward of the package — prefill,
each decode step, scoring, training — read the same mask. Position ids count real tokens only
(cumsum(mask) - 1, clamped at 0), so a left-padded prompt gets exactly the positions it has alone.
A padding query attends to itself: an all-masked row would make softmax NaN, and NaN hidden states at
padding positions leak through 0 * NaN into real tokens at the next layer.
"""

from __future__ import annotations

import torch

# On CPU, `auto` attention is eager up to this many positions a row (prompt + completion budget), SDPA
# beyond. Eager keeps every layer's (rows, heads, T, T) probabilities for backward: at SmolLM2's shape, G 8 and
# 158 + 512 tokens that was 19.9 GiB of peak RSS against SDPA's 16.1 for 3 % more time; at 158 + 128 tokens
# eager's run stayed under TRL's memory (docs/benchmarks.md).
EAGER_MAX_TOKENS = 512


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """(B, L) 0/1 mask -> (B, L) int64 positions of real tokens; padding gets 0."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def causal_mask(mask: torch.Tensor) -> torch.Tensor:
    """(B, L) 0/1 key mask -> (B, 1, L, L) bool: causal, real keys only, and the diagonal always."""
    n = mask.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=mask.device).tril()
    allowed = causal[None] & mask.bool()[:, None, :]
    allowed |= torch.eye(n, dtype=torch.bool, device=mask.device)[None]
    return allowed[:, None]


def as_attention_bias(allowed: torch.Tensor, model) -> torch.Tensor:
    """Bool for SDPA (its fast path); an additive float mask for the eager implementation."""
    if getattr(model.config, "_attn_implementation", "sdpa") != "eager":
        return allowed
    bias = torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device)
    return bias.masked_fill_(~allowed, torch.finfo(torch.float32).min)


def segment_causal_mask(segments: torch.Tensor) -> torch.Tensor:
    """(B, L) segment ids (0 = padding, 1, 2, ... = the packed samples of a row) -> (B, 1, L, L) bool:
    causal within a sample and never across samples (packing without cross-sample attention), the
    diagonal always (as in `causal_mask`)."""
    n = segments.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=segments.device).tril()
    same = segments[:, :, None] == segments[:, None, :]
    allowed = causal[None] & same & (segments > 0)[:, None, :]
    allowed |= torch.eye(n, dtype=torch.bool, device=segments.device)[None]
    return allowed[:, None]


def segment_positions(segments: torch.Tensor) -> torch.Tensor:
    """(B, L) segment ids -> positions restarting at 0 in every sample (padding gets 0)."""
    index = torch.arange(segments.shape[1], device=segments.device).expand_as(segments)
    starts = torch.cat([torch.ones_like(segments[:, :1], dtype=torch.bool), segments[:, 1:] != segments[:, :-1]], 1)
    start_index = torch.where(starts, index, torch.zeros_like(index)).cummax(1).values
    return torch.where(segments > 0, index - start_index, torch.zeros_like(index))


def left_pad(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists -> (B, P) ids left-padded with pad_id and the (B, P) int64 0/1 mask."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # cpu: filled on the host, moved at the end
    mask = torch.zeros(len(rows), width, dtype=torch.long)  # cpu: moved at the end
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)  # cpu: into a host tensor
        mask[i, width - len(r):] = 1
    return ids.to(device), mask.to(device)

def right_pad(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists -> (B, L) ids right-padded with pad_id and the (B, L) int64 0/1 mask: every row
    starts at position 0, as it would alone (what absolute-position and first-token-pooling models need)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # cpu: filled on the host, moved at the end
    mask = torch.zeros(len(rows), width, dtype=torch.long)  # cpu: moved at the end
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)  # cpu: into a host tensor
        mask[i, :len(r)] = 1
    return ids.to(device), mask.to(device)


def chunk_attention(keys: torch.Tensor, valid: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For a decoder's `extend` (decoders.py): write the chunk's validity into the key mask `keys`
    (B, capacity) at slots [start, start + S) and return the chunk queries' (B, 1, S, start + S) bool mask
    — causal, real keys only, the diagonal always (as `causal_mask`) — and the row-wise (B, S) offsets of
    its real tokens (cumsum - 1)."""
    n = valid.shape[1]
    end = start + n
    keys[:, start:end] = valid
    causal = torch.ones(n, end, dtype=torch.bool, device=valid.device).tril(diagonal=start)
    allowed = keys[:, None, :end] & causal[None]
    allowed[:, torch.arange(n, device=valid.device), torch.arange(start, end, device=valid.device)] = True
    return allowed[:, None], valid.long().cumsum(1) - 1
