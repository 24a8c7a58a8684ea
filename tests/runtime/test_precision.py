"""The precision policy: bf16 autocast on CPU, fp16 refused off CUDA, fp32 untouched."""

import contextlib

import pytest
import torch

from ppoforge.errors import UserError
from ppoforge.runtime.precision import make_precision


def _one_step(precision):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with precision.autocast():
        out = model(torch.randn(4, 8))
    loss = out.float().pow(2).mean()
    precision.backward(loss)
    norm = precision.step(opt, list(model.parameters()), max_grad_norm=1.0)
    return out.dtype, norm


def test_bf16_autocast_on_cpu_runs_matmuls_in_bf16():
    dtype, norm = _one_step(make_precision("bf16", torch.device("cpu")))
    assert dtype == torch.bfloat16 and torch.isfinite(norm)


def test_fp32_has_no_autocast():
    dtype, _ = _one_step(make_precision("fp32", torch.device("cpu")))
    assert dtype == torch.float32


def test_fp16_needs_cuda_and_unknown_names_are_rejected():
    with pytest.raises(UserError, match="fp16 needs a CUDA device"):
        make_precision("fp16", torch.device("cpu"))
    with pytest.raises(UserError, match="allowed: auto, fp32, bf16, fp16"):
        make_precision("int8", torch.device("cpu"))


def test_grad_norm_is_clipped():
    precision = make_precision("fp32", torch.device("cpu"))
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0])
    opt = torch.optim.SGD([p], lr=1.0)
    norm = precision.step(opt, [p], max_grad_norm=1.0)
    assert norm.item() == pytest.approx(5.0)
    torch.testing.assert_close(p.detach(), torch.tensor([-0.6, -0.8]))


def test_weight_cache_casts_once_and_gives_the_same_gradients():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    x = torch.randn(8, 16)
    p = make_precision("bf16", torch.device("cpu"))

    def grads(cached: bool) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with p.weight_cache() if cached else contextlib.nullcontext():
            for micro in x.split(2):
                with p.autocast():
                    out = model(micro)
                with p.full_precision():
                    assert not torch.is_autocast_enabled("cpu")
                    p.backward(out.float().pow(2).mean())
        return [q.grad.clone() for q in model.parameters()]

    for cached, separate in zip(grads(True), grads(False), strict=True):
        torch.testing.assert_close(cached, separate, rtol=0, atol=0)



@pytest.mark.parametrize(("flags", "expected"), [("fpu avx2 fma", "fp32"), ("fpu avx512f avx512_bf16", "bf16"),
                                                 ("fpu amx_tile amx_bf16", "bf16")])
def test_auto_is_bf16_only_where_the_cpu_has_native_bf16(monkeypatch, tmp_path, flags, expected):
    from ppoforge.runtime import device

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: {flags}\n")
    read = device.read_cpuinfo
    monkeypatch.setattr(device, "read_cpuinfo", lambda path="": read(str(cpuinfo)))
    assert make_precision("auto", torch.device("cpu")).name == expected
    assert make_precision("fp32", torch.device("cpu")).name == "fp32"  # an explicit choice stays
