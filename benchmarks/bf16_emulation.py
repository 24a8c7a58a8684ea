"""bf16 numerics at fp32 speed on a CPU without native bf16, to study what bf16 does to learning.

A CPU without AMX or AVX-512-BF16 (an AVX2-only EPYC, for one) computes bf16 matmuls in emulation at
~1 GFLOP/s, 50-100x slower than fp32, so a bf16 training run cannot be repeated there. But a bf16 GEMM
on the hardware that has one (AMX, AVX-512-BF16's vdpbf16ps, a GPU's tensor cores) multiplies bf16
inputs, accumulates the products in fp32 and rounds the result to bf16 once. The product of two bf16
values is exact in fp32, so the same numbers come from: the bf16 inputs widened to fp32 (exactly), an
fp32 matmul, the result rounded to bf16. Only the order of the fp32 additions differs, as it does
between any two GEMM libraries.

`EmulatedBf16Matmuls` does that for every matmul the dispatcher sees with a bf16 operand (mm, addmm,
bmm, baddbmm: what F.linear, torch.matmul and eager attention lower to, forward and backward alike,
since the mode sits below autograd; under inference_mode, linear and matmul arrive whole). Everything
else runs as it would: autocast still picks which ops run in bf16, the elementwise ops still round to
bf16. `install()` turns it on for the whole process.

    python benchmarks/bf16_emulation.py check
checks it against the CPU's own bf16 matmul on SmolLM2-135M's shapes (the fraction of bit-equal results,
the largest difference against the output's scale) and times the three ways;
    python benchmarks/bf16_emulation.py ppoforge train rlhf --preset arithmetic_demo --precision bf16 ...
runs the `ppoforge` command in this process with the emulation on (what a bf16 run computes, on an
AVX2-only laptop, at ~1.6x an fp32 run's time).
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flops import mean_seconds

_ATEN = torch.ops.aten
MATMULS = frozenset({_ATEN.mm.default, _ATEN.addmm.default, _ATEN.bmm.default, _ATEN.baddbmm.default,
                     _ATEN.linear.default, _ATEN.matmul.default})  # the last two arrive whole under inference_mode


def _widen(value):
    return value.float() if isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16 else value


class EmulatedBf16Matmuls(TorchDispatchMode):
    """Matmuls with a bf16 operand: widened to fp32, multiplied in fp32, the result rounded to bf16."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in MATMULS and any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in args):
            return func(*map(_widen, args), **kwargs).to(torch.bfloat16)
        return func(*args, **kwargs)


def install() -> None:
    """Emulate bf16 matmuls for the rest of this process (its main thread and autograd's backward)."""
    EmulatedBf16Matmuls().__enter__()


def _compare(m: int, k: int, n: int, repeats: int) -> dict:
    a, b = torch.randn(m, k).bfloat16(), torch.randn(k, n).bfloat16()
    native = a @ b
    with EmulatedBf16Matmuls():
        emulated = a @ b
    scale = native.float().abs().amax(dim=1, keepdim=True)
    worst = ((native.float() - emulated.float()).abs() / scale).max().item()

    def emulated_mm():
        with EmulatedBf16Matmuls():
            a @ b

    a32, b32 = a.float(), b.float()
    return {"shape": (m, k, n), "bit_equal": (native == emulated).float().mean().item(),
            "max_diff_over_row_max": worst, "native_bf16_ms": 1e3 * mean_seconds(lambda: a @ b, repeats),
            "emulated_ms": 1e3 * mean_seconds(emulated_mm, repeats),
            "fp32_ms": 1e3 * mean_seconds(lambda: a32 @ b32, repeats)}


def main() -> None:
    if sys.argv[1:2] == ["ppoforge"]:
        from ppoforge.cli import main as ppoforge_main

        install()
        sys.argv = sys.argv[1:]
        sys.exit(ppoforge_main())
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["check"])
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    torch.manual_seed(0)
    print("m k n | bit-equal | max |diff| / row max | native bf16 ms | emulated ms | fp32 ms")
    for shape in [(80, 576, 576), (80, 576, 1536), (640, 576, 1536), (8, 576, 49152)]:
        r = _compare(*shape, repeats=args.repeats)
        print(f"{' '.join(map(str, r['shape']))} | {r['bit_equal']:.5f} | {r['max_diff_over_row_max']:.2e} | "
              f"{r['native_bf16_ms']:.1f} | {r['emulated_ms']:.1f} | {r['fp32_ms']:.1f}")


if __name__ == "__main__":
    main()
