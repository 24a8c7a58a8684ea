"""Precision steps, the control PPO smoke run and the LM smoke step: real runs on CPU, and failures."""

import math

import pytest
import torch

from ppoforge.doctor.smoke import (
    PlainSGD,
    StepOutcome,
    check_control_smoke,
    check_lm_smoke,
    check_precision_step,
    train_steps,
)
from ppoforge.runtime.precision import Precision

GOOD = StepOutcome(loss=0.5, changed=True, compute_dtype="bfloat16", steps=1)


@pytest.mark.parametrize("native", [True, False])
def test_bf16_step_on_cpu_really_runs(monkeypatch, native):
    from ppoforge.doctor import smoke

    monkeypatch.setattr(smoke, "native_bf16", lambda device: native)
    r = check_precision_step("bf16", "cpu")
    assert "compute dtype bfloat16" in r.evidence and "params changed" in r.evidence
    assert r.status == ("ok" if native else "warn")
    if not native:  # it works, but emulated: say so, and what to use instead
        assert "emulated" in r.evidence and "--precision fp32" in r.fix


def test_fp16_on_cpu_is_a_skip():
    r = check_precision_step("fp16", "cpu")
    assert r.status == "skip" and "needs CUDA" in r.evidence


@pytest.mark.parametrize("outcome, words", [
    (StepOutcome(math.nan, True, "bfloat16", 3), "loss nan"),
    (StepOutcome(0.5, False, "bfloat16", 3), "params UNCHANGED"),
    (StepOutcome(0.5, True, "float32", 1), "expected bfloat16"),
])
def test_a_failing_precision_step(outcome, words):
    r = check_precision_step("bf16", "cpu", step=lambda name, device: outcome)
    assert r.status == "fail" and words in r.evidence and r.fix == "--precision fp32"


def test_a_precision_step_that_raises():
    def broken(name, device):
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
    r = check_precision_step("bf16", "cpu", step=broken)
    assert r.status == "fail" and "RuntimeError: CUBLAS_STATUS_NOT_SUPPORTED" in r.evidence


def test_bf16_step_on_a_pre_ampere_gpu_warns(monkeypatch):
    from ppoforge.doctor import smoke

    monkeypatch.setattr(smoke, "native_bf16", lambda device: True)  # the CPU part is not what this tests
    r = check_precision_step("bf16", "cpu", capability=(7, 5), step=lambda name, device: GOOD)
    assert r.status == "warn" and "emulated" in r.evidence and "fp16" in r.fix


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_requested_on_a_cpu_machine_fails(tmp_path):
    assert check_precision_step("bf16", "cuda").status == "fail"
    assert check_lm_smoke("cuda", "fp32", tmp_path).status == "fail"


def test_control_smoke_failure_gives_the_command_to_reproduce(tmp_path):
    def broken(device, precision, run_dir):
        raise ValueError("expected parameter loc to be finite")
    r = check_control_smoke("cpu", "bf16", tmp_path, run=broken)
    assert r.status == "fail" and "ValueError" in r.evidence
    assert "ppoforge train control" in r.fix and "--precision bf16" in r.fix


def test_control_smoke_refused_config(tmp_path):
    r = check_control_smoke("cpu", "fp16", tmp_path)  # fp16 needs CUDA: make_precision refuses
    assert r.status == "fail" and "fp16 needs a CUDA device" in r.evidence


@pytest.mark.slow
def test_control_smoke_runs_trains_and_resumes(tmp_path):
    threads = torch.get_num_threads()
    r = check_control_smoke("cpu", "fp32", tmp_path)
    assert r.status == "ok", r.evidence
    assert "2 updates" in r.evidence and "ran to update 3" in r.evidence
    assert torch.get_num_threads() == threads


def test_lm_smoke_without_transformers_names_the_extra(tmp_path):
    def missing(device, precision, run_dir):
        raise ImportError("No module named 'transformers'")
    r = check_lm_smoke("cpu", "fp32", tmp_path, run=missing)
    assert r.status == "fail" and "ppoforge[lm]" in r.fix


def test_lm_smoke_broken_promise_fails_with_a_command_to_reproduce(tmp_path):
    from ppoforge.doctor.smoke import SmokeFailure

    def frozen_moved(device, precision, run_dir):
        raise SmokeFailure("frozen (reference/base) parameters changed")
    r = check_lm_smoke("cpu", "bf16", tmp_path, run=frozen_moved)
    assert r.status == "fail" and "reference/base" in r.evidence and "ppoforge train rlhf" in r.fix


@pytest.mark.slow
def test_lm_smoke_runs_the_real_trainer_and_resumes(tmp_path):
    r = check_lm_smoke("cpu", "bf16", tmp_path)
    assert r.status == "ok", r.evidence
    assert "2 updates" in r.evidence and "base/reference unchanged" in r.evidence
    assert "ran to update 3" in r.evidence


def test_plain_sgd_works_under_a_real_grad_scaler():
    # fp16 + GradScaler needs CUDA in ppoforge; the scaler's unscale/step/update path is the same on CPU
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    precision = Precision("fp16", torch.device("cpu"), torch.amp.GradScaler("cpu"))
    x = torch.randn(4, 8)

    def loss_fn(m):
        out = m(x)
        return {"loss": out.float().pow(2).mean(), "compute": out}

    out = train_steps(model, PlainSGD(model.parameters(), lr=0.1), precision, loss_fn)
    assert out.changed and out.compute_dtype == "float16" and math.isfinite(out.loss)
