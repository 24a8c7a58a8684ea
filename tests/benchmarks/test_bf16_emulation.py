"""benchmarks/bf16_emulation.py: bf16 matmuls computed as bf16 hardware rounds them, at fp32 speed."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bf16_emulation import EmulatedBf16Matmuls  # noqa: E402


def _pair(m: int, k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).bfloat16(), torch.randn(k, n, generator=g).bfloat16()


@pytest.mark.parametrize("inference", [False, True])
def test_a_bf16_matmul_is_the_fp32_product_of_its_bf16_inputs_rounded_once(inference):
    a, b = _pair(24, 96, 40)
    bias = torch.randn(40).bfloat16()
    with torch.inference_mode(inference), EmulatedBf16Matmuls():
        results = {"mm": a @ b, "linear": F.linear(a, b.t(), bias), "bmm": torch.bmm(a[None], b[None])[0],
                   "matmul 3d": (a[None] @ b)[0]}
    exact = (a.float() @ b.float()).bfloat16()
    for name in ("mm", "bmm", "matmul 3d"):
        assert results[name].dtype == torch.bfloat16
        assert torch.equal(results[name], exact), name
    assert torch.equal(results["linear"], (a.float() @ b.float() + bias.float()).bfloat16())


def test_fp32_matmuls_pass_through_untouched():
    a, b = _pair(8, 32, 16)
    a, b = a.float(), b.float()
    with EmulatedBf16Matmuls():
        out = a @ b
    assert out.dtype == torch.float32 and torch.equal(out, a @ b)


def test_it_agrees_with_the_cpus_own_bf16_matmul_up_to_the_order_of_additions():
    """The CPU's bf16 kernel (slow where emulated, but the same format) sums in another order: a result
    may round the other way, never further than an ulp of its row's largest value."""
    a, b = _pair(64, 256, 96, seed=1)
    native = a @ b
    with EmulatedBf16Matmuls():
        emulated = a @ b
    assert (native == emulated).float().mean() > 0.99
    row_max = native.float().abs().amax(dim=1, keepdim=True)
    assert ((native.float() - emulated.float()).abs() <= row_max * 2**-8).all()


def test_a_training_step_under_autocast_gets_bf16_rounded_gradients():
    """Forward under autocast and backward both go through it: the weight's gradient is what a bf16
    GEMM gives for the bf16 grad-output and input, and the same as the CPU's bf16 kernels to an ulp."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 32)
    x = torch.randn(16, 48)

    def grad(emulate: bool) -> torch.Tensor:
        layer.zero_grad()
        with EmulatedBf16Matmuls() if emulate else contextlib.nullcontext():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = layer(x)
            (y.float() ** 2).sum().backward()
        return layer.weight.grad.clone()

    emulated, native = grad(True), grad(False)
    layer.zero_grad()
    (layer(x) ** 2).sum().backward()
    fp32 = layer.weight.grad
    scale = native.abs().max()
    assert (emulated - native).abs().max() <= scale * 2**-7
    assert (emulated - fp32).abs().max() > (emulated - native).abs().max()  # it is bf16's rounding, not fp32's
