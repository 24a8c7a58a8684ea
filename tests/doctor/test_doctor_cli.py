"""`ppoforge doctor` end to end: the quick run, --json, --require, exit codes, a crashing check."""

import json
import os
import subprocess
import sys

import pytest
import torch

from ppoforge.cli import main
from ppoforge.doctor import runner
from ppoforge.doctor.gpu import GpuFacts
from ppoforge.doctor.report import CAPABILITY_KEYS
from ppoforge.doctor.runner import Options, parse_require, run_doctor


def _quick_json(capsys, *extra):
    code = main(["doctor", "--quick", "--json", *extra])
    return code, json.loads(capsys.readouterr().out)


def test_quick_json(capsys, tmp_path):
    code, data = _quick_json(capsys, "--runs-root", str(tmp_path / "runs"))
    names = [c["name"] for c in data["checks"]]
    for name in ("python_torch", "torch_wheel", "gpu_visibility", "bf16_step", "libraries_lm", "runs_dir",
                 "checkpoint_roundtrip", "shm", "root", "jupyter", "control_smoke", "lm_smoke"):
        assert name in names
    statuses = {c["name"]: c["status"] for c in data["checks"]}
    assert statuses["control_smoke"] == statuses["allreduce"] == "skip"
    assert all(c["fix"] for c in data["checks"] if c["status"] in ("warn", "fail"))
    required = [v for v in data["verdicts"] if v["required"]]
    assert [v["key"] for v in required] == ["control", "rlhf", "checkpoints"]
    assert code == data["exit_code"] == (0 if all(v["holds"] is not False for v in required) else 1)
    assert {v["key"]: v["holds"] for v in required}["control"] is None  # control_smoke: not checked


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="multi-GPU holds on this machine")
def test_require_decides_the_exit_code(capsys):
    code, data = _quick_json(capsys, "--require", "multigpu")
    assert code == 1 and data["required"] == ["multigpu"]
    code, _ = _quick_json(capsys, "--require", "none")
    assert code == 0


def test_parse_require():
    assert parse_require("control, rlhf") == ("control", "rlhf")
    assert parse_require("all") == CAPABILITY_KEYS and parse_require("none") == ()


def test_bad_arguments_are_one_line_errors(capsys):
    assert main(["doctor", "--require", "gpu"]) == 2
    assert "unknown capability 'gpu'" in capsys.readouterr().err
    assert main(["doctor", "--device", "tpu"]) == 2


def test_a_crashing_check_becomes_a_fail_row(monkeypatch):
    def crash(*args, **kwargs):
        raise KeyError("boom")
    monkeypatch.setattr(runner.security, "check_root", crash)
    report = run_doctor(Options(quick=True))
    row = next(r for r in report.results if r.name == "root")
    assert row.status == "fail" and "crashed: KeyError" in row.evidence and "ppoforge bug" in row.fix


def test_console_script_quick_table(tmp_path):
    out = subprocess.run([sys.executable, "-m", "ppoforge", "doctor", "--quick", "--runs-root",
                          str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode in (0, 1), out.stderr
    assert out.stdout.startswith("ppoforge doctor (quick)") and "verdicts" in out.stdout
    assert out.stdout.rstrip().endswith(f"exit code {out.returncode}")


def test_cpu_wheel_on_a_gpu_box_end_to_end(monkeypatch):
    facts = GpuFacts(None, None, ["/dev/nvidia0"], "/usr/bin/nvidia-smi", "550.54.15", "12.4", None, 0, None)
    monkeypatch.setattr(runner.gpu, "gather_gpu", lambda: facts)
    report = run_doctor(Options(quick=True))
    rows = {r.name: r for r in report.results}
    assert rows["gpu_visibility"].status == rows["torch_wheel"].status == "fail"
    assert "whl/cu124" in rows["torch_wheel"].fix
    rlhf = next(v for v in report.verdicts if v.key == "rlhf")
    assert not rlhf.holds and report.exit_code == 1


def test_pypi_cuda_wheel_on_a_gpu_less_box_end_to_end(monkeypatch):
    """The seed's stack without --gpus: torch 2.6.0+cu124 whose pip metadata says 2.6.0, no GPU at all."""
    facts = GpuFacts("12.4", None, [], None, None, None, None, 0, None)
    monkeypatch.setattr(runner.gpu, "gather_gpu", lambda: facts)
    monkeypatch.setattr(runner.libraries.torch, "__version__", "2.6.0+cu124")
    real = runner.libraries.installed_version
    monkeypatch.setattr(runner.libraries, "installed_version", lambda name: "2.6.0" if name == "torch" else real(name))
    report = run_doctor(Options(quick=True))
    rows = {r.name: r for r in report.results}
    assert rows["torch_wheel"].status == "warn" and "cu124" in rows["torch_wheel"].evidence
    assert rows["gpu_visibility"].status == "warn" and "--gpus all" in rows["gpu_visibility"].fix
    holds = {v.key: v.holds for v in report.verdicts}
    assert holds["control"] is holds["rlhf"] is None and report.exit_code == 0  # not checked: the smoke runs
    rlhf = next(v for v in report.verdicts if v.key == "rlhf")
    assert rlhf.label == "LM RLHF on this device (cpu)"


def test_open_jupyter_end_to_end(monkeypatch, tmp_path):
    runtime = tmp_path / "rt"
    runtime.mkdir()
    (runtime / "jpserver-7.json").write_text(json.dumps({"pid": os.getpid(), "hostname": "0.0.0.0",
                                                          "token": "", "password": False}))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(runtime))
    monkeypatch.setenv("JUPYTER_CONFIG_DIR", str(tmp_path / "cfg"))
    report = run_doctor(Options(quick=True, require=("notebook",)))
    assert next(r for r in report.results if r.name == "jupyter").status == "fail"
    assert report.exit_code == 1
