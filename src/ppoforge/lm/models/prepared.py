"""How the lean decoder (`decoders.LlamaDecoder`) prepares a model's weights for decoding.

- `concat_linears`: q, k, v (and gate, up) stacked along the output dim, one matmul for the group;
- `stack_adapters`: the group's LoRA adapters stacked to match, applied unmerged as peft applies them;
- `packs` / `pack` / `packed_linear`: on CPU, weights reordered once into oneDNN's blocked layout (where
  `onednn_packing` finds it can), so a decode step that streams every weight for a few rows does not
  repack it on every call.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F


def concat_linears(*params: tuple[torch.Tensor, torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stack (weight, bias) pairs along the output dim: one matmul computes all of them (a single pair is
    itself: no copy)."""
    if len(params) == 1:
        return params[0]
    weight = torch.cat([w for w, _ in params])
    if all(b is None for _, b in params):
        return weight, None
    return weight, torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in params])


def parts_linear(x: torch.Tensor, parts: tuple, bias: None = None) -> torch.Tensor:
    """F.linear over a stack kept as its (weight, bias) parts — the model's own tensors, no stacked copy: one
    matmul per part, the outputs side by side as the stack's would be (and as the model's own forward
    computes them, one module at a time)."""
    if len(parts) == 1:
        return F.linear(x, *parts[0])
    return torch.cat([F.linear(x, w, b) for w, b in parts], -1)


def share_storage(params: list[tuple[torch.Tensor, torch.Tensor | None]],
                  fused: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    """Make each original (weight, bias) a view of its rows of the stacked `fused` pair, so the model and the
    decoder hold one copy between them (the originals' storage is freed). For frozen weights of the same
    dtype only: the caller's to decide (the LoRA layout's base)."""
    start = 0
    for w, b in params:
        rows = w.shape[0]
        w.data = fused[0][start:start + rows]
        if b is not None:
            b.data = fused[1][start:start + rows]
        start += rows


def stack_adapters(adapters: list, out_features: list[int], dtype: torch.dtype):
    """The adapters of one stacked group as (A, B, scaling) for y += B(A(x)) * scaling, or None.

    A stacks the targets' A matrices; B is block-diagonal (a target without adapter is a zero block),
    so each output column sees only its own target's rank-r product. One scaling when the targets
    share it (peft's `* scaling`, rounded as peft rounds it), else an fp32 vector, one per column.
    A shared power-of-two scaling (the default alpha / r = 2) is folded into B instead, one op less
    per group and token: scaling by 2^k is exact in every float format, before and after the matmul's
    rounding alike, so B'(A(x)) with B' = 2^k * B equals peft's B(A(x)) * 2^k bit for bit.
    """
    present = [spec for spec in adapters if spec is not None]
    if not present:
        return None
    empty = present[0][0].new_zeros(0, present[0][0].shape[1])
    a_parts, b_parts, scales = [], [], []
    for spec, n in zip(adapters, out_features, strict=True):
        a, b, scale = spec if spec is not None else (empty, empty.new_zeros(n, 0), 0.0)
        a_parts.append(a.to(dtype))
        b_parts.append(b.to(dtype))
        scales.append(scale)
    a, b = torch.cat(a_parts), torch.block_diag(*b_parts)
    if len({scale for _, _, scale in present}) == 1:
        scale = present[0][2]
        return (a, b * scale, None) if math.frexp(scale)[0] == 0.5 else (a, b, scale)
    return a, b, torch.cat([torch.full((n,), scale, dtype=torch.float32, device=a.device)
                            for n, scale in zip(out_features, scales, strict=True)])


@functools.cache
def onednn_packing(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Can this CPU prepack `dtype` weights for oneDNN? fp32 needs nothing special; bf16 needs AVX-512
    (bw, vl, dq) or AVX-NE-CONVERT, which an AMD EPYC of the Zen 2 or Zen 3 generation, for one, lacks.
    Asked once per dtype, by trying it on a tiny weight."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), 8)  # cpu: a oneDNN probe
    except RuntimeError:
        return False
    return True


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear for a weight prepacked by mkldnn._reorder_linear_weight (the op inductor's CPU freezing uses)."""
    return torch.ops.mkldnn._linear_pointwise(x.to(weight.dtype), weight, bias, "none", [], "")


def packs(dtype: torch.dtype, device: torch.device) -> bool:
    """Are `dtype` weights on `device` prepacked: on CPU, in bf16 or fp32, where oneDNN can?"""
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float32) and onednn_packing(dtype)


def pack(params: tuple[torch.Tensor, torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) with the weight in oneDNN's blocked layout, chosen for a few rows (the decode's)."""
    weight, bias = params
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 8), bias
