"""Verdicts, exit codes and the two renderings, on hand-made results."""

import json

from ppoforge.doctor.report import (
    CAPABILITIES,
    Report,
    exit_code,
    fail,
    ok,
    render_text,
    skip,
    to_json,
    verdict,
    verdicts,
    warn,
)

CAP = {c.key: c for c in CAPABILITIES}


def _by_name(*results):
    return {r.name: r for r in results}


def _control_ok():
    return [ok("python_torch", "x"), ok("libraries_core", "x"), ok("checkpoint_roundtrip", "x"),
            ok("control_smoke", "ran")]


def test_capability_holds_when_every_need_passes():
    v = verdict(CAP["control"], _by_name(*_control_ok()), gpus=0, quick_skipped=set())
    assert v.holds and "control_smoke" in v.reason


def test_a_failed_need_breaks_the_capability_and_is_named():
    results = _control_ok()[:3] + [fail("control_smoke", "NaN loss; more", "--precision fp32")]
    v = verdict(CAP["control"], _by_name(*results), gpus=0, quick_skipped=set())
    assert not v.holds and v.reason == "control_smoke: NaN loss"


def test_a_skipped_need_breaks_it_unless_quick_skipped_it():
    results = _control_ok()[:3] + [skip("control_smoke", "not run (--quick)")]
    assert not verdict(CAP["control"], _by_name(*results), 0, set()).holds
    v = verdict(CAP["control"], _by_name(*results), 0, {"control_smoke"})
    assert v.holds is None and v.sentence() == "not checked (run the full doctor: control_smoke skipped by --quick)"


def test_warn_still_holds():
    results = _control_ok()[:3] + [warn("control_smoke", "slow", "fix")]
    v = verdict(CAP["control"], _by_name(*results), 0, set())
    assert v.holds and "with warnings: control_smoke" in v.reason


def test_multigpu_needs_two_gpus_even_when_everything_passed():
    results = [ok("dist_backends", "gloo"), ok("allreduce", "gloo ok")]
    v = verdict(CAP["multigpu"], _by_name(*results), gpus=1, quick_skipped=set())
    assert not v.holds and "needs >= 2" in v.reason
    assert verdict(CAP["multigpu"], _by_name(*results), gpus=2, quick_skipped=set()).holds


def test_precision_needs_one_of_bf16_fp16_and_no_failure():
    bf16_only = _by_name(ok("bf16_step", "ok"), skip("fp16_step", "needs CUDA"))
    assert verdict(CAP["precision"], bf16_only, 0, set()).holds
    neither = _by_name(skip("bf16_step", "x"), skip("fp16_step", "needs CUDA"))
    assert not verdict(CAP["precision"], neither, 0, set()).holds
    fp16_broken = _by_name(ok("bf16_step", "ok"), fail("fp16_step", "inf", "--precision bf16"))
    assert not verdict(CAP["precision"], fp16_broken, 0, set()).holds


def test_a_need_missing_from_the_results_does_not_hold():
    v = verdict(CAP["notebook"], {}, 0, set())
    assert not v.holds and "jupyter: not run" in v.reason


def test_exit_code_counts_only_required_capabilities():
    results = _control_ok()  # nothing else ran: every other capability fails
    vs = verdicts(results, 0, set(), required=("control",))
    assert exit_code(vs) == 0
    vs = verdicts(results, 0, set(), required=("control", "notebook"))
    assert exit_code(vs) == 1


def _report():
    results = [ok("python_torch", "Python 3.11"), warn("root", "uid 0", "docker run --user 1000"),
               fail("shm", "/dev/shm 0.06 GiB", "docker run --ipc=host"), skip("fp16_step", "needs CUDA")]
    return Report("cpu", "fp32", True, results, verdicts(results, 0, set(), ("control",)), 1.5, ("control",))


def test_text_table_has_a_fix_line_under_warn_and_fail_only():
    text = render_text(_report(), width=100)
    lines = text.splitlines()
    assert any(line.startswith("python_torch") and " ok " in line for line in lines)
    fixes = [line.strip() for line in lines if line.strip().startswith("fix:")]
    assert fixes == ["fix: docker run --user 1000", "fix: docker run --ipc=host"]
    assert "* control PPO" in text and text.endswith("exit code 1")


def test_json_has_the_same_content():
    data = json.loads(to_json(_report()))
    assert [c["name"] for c in data["checks"]] == ["python_torch", "root", "shm", "fp16_step"]
    assert data["checks"][2] == {"name": "shm", "status": "fail", "evidence": "/dev/shm 0.06 GiB",
                                 "fix": "docker run --ipc=host", "seconds": 0.0}
    assert data["exit_code"] == 1 and data["required"] == ["control"]
    assert {v["key"] for v in data["verdicts"]} == {c.key for c in CAPABILITIES}
