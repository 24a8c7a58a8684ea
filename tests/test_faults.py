"""Faults end to end, as a careless user and a flaky machine produce them (docs/reliability.md's table).

Every case checks the three promises: one line and the right exit code, nothing already written is
lost, and the run resumes to exactly what an uninterrupted run computes.
"""

import errno
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from ppoforge.cli import main
from ppoforge.config import build_config
from ppoforge.control.config import ControlConfig
from ppoforge.control.trainer import ControlTrainer, train
from ppoforge.runtime import checkpoint as checkpoint_mod
from ppoforge.runtime.metrics import read_metrics

TINY = ["--num-envs", "2", "--num-steps", "16", "--num-minibatches", "2", "--update-epochs", "2",
        "--progress", "false", "--tensorboard", "false", "--device", "cpu"]
TINY_CFG = {"num_envs": 2, "num_steps": 16, "num_minibatches": 2, "update_epochs": 2, "progress": False,
            "tensorboard": False, "device": "cpu", "total_steps": 128}

def error_lines(err: str) -> list[str]:
    """stderr less the informational line about prompts cut to max_prompt_tokens (these runs cut the demo
    prompts to 16 tokens on purpose, to stay small): what is left must be the one error line."""
    return [line for line in err.splitlines() if "prompts are longer than max_prompt_tokens" not in line]



def _cli(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.err.strip()


def _weights(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoint.pt", weights_only=True)["agent"]


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """An uninterrupted 8-update control run to compare the interrupted ones against."""
    run = tmp_path_factory.mktemp("reference") / "run"
    assert main(["train", "control", *TINY, "--total-steps", "256", "--checkpoint-every", "1", "--run-dir",
                 str(run)]) == 0
    return run


# ---- config integrity ------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--learning-rate", "inf"], "learning_rate: 'inf' is not a finite number"),
    (["--gamma", "nan"], "gamma: 'nan' is not a finite number"),
    (["--num-envs", "100000000"], "num_envs: 100000000 is out of range; allowed: <= 65536"),
    (["--num-envs", "60000", "--num-steps", "9000000"], "transitions per rollout; allowed: <= 67,108,864"),
])
def test_non_finite_and_impossible_values_are_refused_before_anything_runs(capsys, tmp_path, argv, message):
    code, err = _cli(capsys, "train", "control", *TINY, "--run-dir", str(tmp_path / "r"), *argv)
    assert code == 2 and len(error_lines(err)) == 1 and message in err, err
    assert not (tmp_path / "r").exists()


def test_a_yaml_nan_is_refused(capsys, tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("gae_lambda: .nan\n")
    code, err = _cli(capsys, "train", "control", "--preset", str(preset), "--run-dir", str(tmp_path / "r"))
    assert code == 2 and "gae_lambda: nan is not a finite number" in err


@pytest.mark.parametrize("kind", ["pipeline", "preset", "resume"])
def test_a_yaml_file_that_is_not_utf8_is_one_line_naming_it(capsys, tmp_path, kind):
    """A Latin-1 byte in a pipeline file, a preset or a run's config.yaml: the file and its line, not Python's
    "text that is not valid UTF-8" without a name."""
    path = tmp_path / "run" / "config.yaml"
    path.parent.mkdir()
    path.write_bytes("total_steps: 128\nexp_name: caf\xe9\n".encode("latin-1"))
    argv = {"pipeline": ["pipeline", str(path)], "preset": ["train", "control", "--preset", str(path)],
            "resume": ["train", "control", "--resume", str(path.parent)]}[kind]
    code, err = _cli(capsys, *argv)
    assert code == 2 and err == (f"ppoforge: error: {kind}: {path} is not UTF-8 text (line 2, byte 30); "
                                 "allowed: UTF-8 text (re-save it as UTF-8)"), err
    assert path.read_bytes().endswith(b"caf\xe9\n") and sorted(p.name for p in path.parent.iterdir()) == ["config.yaml"]


def test_a_new_run_refuses_a_used_run_dir_and_overwrite_replaces_it(capsys, reference_run, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(reference_run, run)
    before = (run / "checkpoint.pt").read_bytes()
    code, err = _cli(capsys, "train", "control", *TINY, "--total-steps", "64", "--run-dir", str(run))
    assert code == 2 and "already holds a run" in err and f"--resume {run}" in err and "--overwrite" in err
    assert (run / "checkpoint.pt").read_bytes() == before
    code, _ = _cli(capsys, "train", "control", *TINY, "--total-steps", "64", "--run-dir", str(run), "--overwrite")
    assert code == 0 and len((run / "metrics.jsonl").read_text().splitlines()) == 2  # a fresh 2-update run


def test_a_run_dir_in_use_refuses_a_second_run_and_a_resume_and_nothing_in_it_changes(capsys, reference_run,
                                                                                       tmp_path):
    """Two runs started into one run dir both ran (metrics.jsonl: 1,1,2,2,...), and a --resume of a run
    still going ran beside it: while a run holds its run dir, a new run (--overwrite too) and a --resume
    are refused in one line naming it, and nothing there changes; once it has ended the resume goes on."""
    import shutil

    from ppoforge.runtime.rundir import RunDirLock

    run = tmp_path / "run"
    shutil.copytree(reference_run, run)
    files = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    running = RunDirLock(run)  # what the run still going holds (its trainer's `rundir.hold`)
    running.acquire()
    try:
        for argv in ([*TINY, "--total-steps", "64", "--run-dir", str(run)],
                     [*TINY, "--total-steps", "64", "--run-dir", str(run), "--overwrite"],
                     ["--resume", str(run), "--total-steps", "320"]):
            code, err = _cli(capsys, "train", "control", *argv)
            assert code == 2 and len(error_lines(err)) == 1, err
            assert f"run_dir: {run} is in use by pid {os.getpid()} on " in err and \
                "allowed: another --run-dir, or wait for that run to end" in err, err
            assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != ".lock"} == files
    finally:
        running.release()
    code, err = _cli(capsys, "train", "control", "--resume", str(run), "--total-steps", "320")
    assert code == 0, err
    assert torch.load(run / "checkpoint.pt", weights_only=True)["update"] == 10 and not (run / ".lock").exists()


@pytest.mark.parametrize("change, refused", [
    (["--num-envs", "8"], "num_envs (2 -> 8)"),
    (["--env-id", "Acrobot-v1", "--hidden-size", "32"], "env_id ('CartPole-v1' -> 'Acrobot-v1'), hidden_size"),
    (["--learning-rate", "0.1"], "learning_rate"),
])
def test_a_resume_with_a_structural_change_is_refused_and_writes_nothing(capsys, reference_run, tmp_path,
                                                                         change, refused):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(reference_run, run)
    files = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    code, err = _cli(capsys, "train", "control", "--resume", str(run), *change)
    assert code == 2 and len(error_lines(err)) == 1
    assert f"resume: cannot change {refused}" in err and "allowed on resume: " in err and "total_steps" in err
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == files  # nothing rewritten


def test_a_resume_refuses_a_config_yaml_edited_by_hand_or_a_checkpoint_from_another_run(capsys, reference_run,
                                                                                          tmp_path):
    """config.yaml says one thing, the checkpoint's run another: the run went on with the checkpoint's values (its
    seed's RNG states, its KL controller) while config.yaml, rewritten after the load, kept saying otherwise."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(reference_run, run)
    text = (run / "config.yaml").read_text()
    assert "\nseed: 1\n" in text
    (run / "config.yaml").write_text(text.replace("\nseed: 1\n", "\nseed: 7\n"))
    files = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    code, err = _cli(capsys, "train", "control", "--resume", str(run), "--total-steps", "320")
    assert code == 2 and error_lines(err) == [
        f"ppoforge: error: resume: {run / 'config.yaml'} says seed 7 but the checkpoint's run used 1; allowed: the "
        "config.yaml and checkpoint of one run (here seed: 1), and on the command line the fields a resume may change "
        "(nonfinite_patience, "
        "nonfinite_action, rollback_lr_factor, max_rollbacks, call_timeout, dist_timeout, total_steps, hand_gradients, "
        "device, torch_threads, checkpoint_every, tensorboard, report_to, progress); a new run for the rest"], err
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == files  # nothing rewritten
    # the same shapes from another run (seed 2, another learning rate): its checkpoint copied over this one's
    (run / "config.yaml").write_text(text)
    other = tmp_path / "other"
    assert main(["train", "control", *TINY, "--total-steps", "64", "--seed", "2", "--learning-rate", "0.001",
                 "--run-dir", str(other)]) == 0
    shutil.copy(other / "checkpoint.pt", run / "checkpoint.pt")
    capsys.readouterr()
    code, err = _cli(capsys, "train", "control", "--resume", str(run), "--total-steps", "320")
    assert code == 2 and len(error_lines(err)) == 1, err
    assert "config.yaml says seed 1 but the checkpoint's run used 2; also learning_rate 0.00025 vs 0.001;" in err, err


def test_a_resume_applies_the_changes_a_resume_may_make(capsys, reference_run, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(reference_run, run)
    code, err = _cli(capsys, "train", "control", "--resume", str(run), "--total-steps", "320",
                     "--checkpoint-every", "2")
    assert code == 0, err
    text = (run / "config.yaml").read_text()
    assert "total_steps: 320" in text and "checkpoint_every: 2" in text
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 10


# ---- kill -9 ---------------------------------------------------------------------------------------

_KILL_AT_SAVE = textwrap.dedent("""
    import os, signal, sys
    import torch
    from ppoforge.runtime import checkpoint
    from ppoforge.cli import main
    real_save, calls = torch.save, []
    def dying_save(obj, f, *a, **k):
        calls.append(1)
        if len(calls) == int(os.environ["KILL_AT_SAVE"]):
            f.write(b"half a checkpoint")
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return real_save(obj, f, *a, **k)
    checkpoint.torch.save = dying_save
    sys.exit(main(sys.argv[1:]))
""")


def test_kill_9_during_a_checkpoint_write_keeps_the_old_one_and_resumes_exactly(reference_run, tmp_path):
    run = tmp_path / "run"
    argv = ["train", "control", *TINY, "--total-steps", "256", "--checkpoint-every", "1", "--run-dir", str(run)]
    proc = subprocess.run([sys.executable, "-c", _KILL_AT_SAVE, *argv], env={**os.environ, "KILL_AT_SAVE": "4"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert torch.load(run / "checkpoint.pt", weights_only=True)["update"] == 3  # the 4th write never landed
    assert list(run.glob(".checkpoint.pt.*.tmp"))  # its temp file is still there
    assert main(["train", "control", "--resume", str(run)]) == 0
    assert not list(run.glob(".checkpoint.pt.*.tmp"))  # cleaned by the next write
    assert _same(_weights(run), _weights(reference_run))


def test_kill_9_during_training_resumes_exactly(reference_run, tmp_path):
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "ppoforge", "train", "control", *TINY, "--total-steps", "256",
            "--checkpoint-every", "1", "--run-dir", str(run)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # kill it once at least 3 updates are on disk
        if (run / "metrics.jsonl").exists() and len((run / "metrics.jsonl").read_text().splitlines()) >= 3:
            break
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    assert main(["train", "control", "--resume", str(run)]) == 0
    assert _same(_weights(run), _weights(reference_run))
    rows = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows == [32 * i for i in range(1, 9)]  # every update logged once


# ---- disk ----------------------------------------------------------------------------------------

def test_a_full_disk_keeps_the_old_checkpoint_and_says_so(capsys, reference_run, tmp_path, monkeypatch):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(reference_run, run)
    before = (run / "checkpoint.pt").read_bytes()

    def full(path, state):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(checkpoint_mod, "atomic_write_bytes", full)
    code, err = _cli(capsys, "train", "control", "--resume", str(run), "--total-steps", "320")
    assert code == 1 and len(error_lines(err)) == 1, err
    assert err.startswith(f"ppoforge: error: no space left writing {run / 'checkpoint.pt'}")
    assert "checkpoint at update 8" in err  # the one already on disk
    assert (run / "checkpoint.pt").read_bytes() == before


def test_an_unwritable_runs_root_is_one_line(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    code, err = _cli(capsys, "train", "control", *TINY, "--total-steps", "64", "--run-dir", str(blocker / "run"))
    assert code == 2 and len(error_lines(err)) == 1 and "cannot use" in err and "Not a directory" in err, err


# ---- non-finite numbers ---------------------------------------------------------------------------

def test_a_nan_reward_at_update_k_is_skipped_and_the_rest_is_unaffected(tmp_path):
    cfg = build_config(ControlConfig, TINY_CFG)
    clean = ControlTrainer(cfg, tmp_path / "clean")  # (each trainer seeds the global RNGs when built)
    clean.train_one_update()
    dirty = ControlTrainer(cfg, tmp_path / "dirty")
    collect = dirty.runner.collect
    state = {"n": 0}

    def nan_at_update_2(policy, n):
        ro = collect(policy, n)
        state["n"] += 1
        if state["n"] == 2:
            ro.rewards[3, 0] = float("nan")
        return ro

    dirty.runner.collect = nan_at_update_2
    dirty.train_one_update()
    weights = [{k: v.clone() for k, v in t.agent.state_dict().items()} for t in (clean, dirty)]
    assert _same(*weights)  # update 1: the same
    metrics = dirty.train_one_update()  # update 2: NaN reward, no optimizer step
    assert _same(dirty.agent.state_dict(), weights[1]) and metrics["guard/skipped_updates"] == 1
    assert math.isnan(metrics["losses/policy_loss"])
    for _ in range(2):
        metrics = dirty.train_one_update()
    assert metrics["guard/skipped_updates"] == 1 and math.isfinite(metrics["losses/policy_loss"])
    assert all(torch.isfinite(p).all() for p in dirty.agent.parameters())


def test_nan_losses_every_step_stop_the_run_after_patience_with_a_checkpoint(capsys, tmp_path, monkeypatch):
    from ppoforge.control import update

    real = update.autograd_step

    def poisoned(agent, optimizer, precision, cfg, guard):
        step = real(agent, optimizer, precision, cfg, guard)
        return lambda mb, with_stats: step({**mb, "adv": mb["adv"] * float("nan")}, with_stats)

    monkeypatch.setattr(update, "autograd_step", poisoned)
    run = tmp_path / "run"
    code, err = _cli(capsys, "train", "control", *TINY, "--hand-gradients", "false", "--total-steps", "128",
                     "--nonfinite-patience", "3", "--run-dir", str(run))
    assert code == 1 and "non-finite loss, 3 times in a row (nonfinite_patience): stopped" in err, err
    assert "checkpoint at update 0" in err  # 2 epochs x 2 minibatches: the 3rd bad step is in update 1
    assert torch.load(run / "checkpoint.pt", weights_only=True)["update"] == 0


def test_rollback_reloads_the_last_checkpoint_and_lowers_the_learning_rate(tmp_path, monkeypatch):
    cfg = build_config(ControlConfig, {**TINY_CFG, "nonfinite_action": "rollback", "nonfinite_patience": 1,
                                       "checkpoint_every": 1, "total_steps": 96})
    trainer = ControlTrainer(cfg, tmp_path)
    collect, calls = trainer.runner.collect, {"n": 0}

    def nan_once(policy, n):
        ro = collect(policy, n)
        calls["n"] += 1
        if calls["n"] == 2:
            ro.rewards[0, 0] = float("inf")
        return ro

    trainer.runner.collect = nan_once
    result = trainer.run()
    assert result.updates == 3 and trainer.guard.counts["guard/rollbacks"] == 1
    assert trainer.lr_scale == 0.5
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [32, 64, 96]  # update 2 ran again after the rollback, logged once


# ---- user code that fails or hangs ------------------------------------------------------------------

def _rlhf_args(tiny_model: Path, run: Path, reward: str, *extra) -> list[str]:
    return ["train", "rlhf", "--model", str(tiny_model), "--prompts", "demo", "--heldout-prompts", "none",
            "--reward", reward, "--batch-size", "2", "--mini-batch-size", "2", "--micro-batch-size", "2",
            "--max-new-tokens", "3", "--max-prompt-tokens", "16", "--ppo-epochs", "1", "--lora-r", "2",
            "--progress", "false", "--tensorboard", "false", "--checkpoint-every", "100", "--device", "cpu",
            "--run-dir", str(run), *extra]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from ppoforge.lm.models.tiny import save_tiny_lm

    return save_tiny_lm(tmp_path_factory.mktemp("tiny") / "model")


@pytest.mark.parametrize("trainer, row", [
    ("rlhf", {"prompt": "hi \ud800"}),
    ("sft", {"prompt": "p", "completion": "\ud800 there"}),
    ("reward", {"prompt": "p", "chosen": "\udfff", "rejected": "b"}),
])
def test_a_lone_surrogate_in_a_data_row_is_one_line_naming_its_line(capsys, tmp_path, tiny_model, trainer, row):
    """JSON's "\\ud800" parses to a str no tokenizer can encode: it was an internal error from the tokenizer."""
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "fine", "completion": "fine", "chosen": "a", "rejected": "b"}) + "\n"
                    + json.dumps(row) + "\n")
    source = ["--prompts", str(data), "--reward", "length:8", "--heldout-prompts", "none"] if trainer == "rlhf" \
        else ["--preset", "tiny", "--data", str(data)]
    code, err = _cli(capsys, "train", trainer, "--model", str(tiny_model), *source, "--run-dir", str(tmp_path / "r"))
    field = next(k for k, v in row.items() if any(0xD800 <= ord(c) <= 0xDFFF for c in v))
    what = "prompts" if trainer == "rlhf" else "data"
    assert code == 2 and error_lines(err) == [
        f"ppoforge: error: {what}: file {data} line 2: field {field!r} is not valid Unicode text (a lone surrogate); "
        "allowed: UTF-8 text"], err


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    """A py: reward that raises, or hangs, at its 3rd call (update 3), or collapses after its 1st, or is
    NaN at its 2nd or at every call, as REWARD_MODE says."""
    (tmp_path / "flaky_reward.py").write_text(textwrap.dedent("""
        import os, time
        calls = []
        def reward(prompts, completions, **kwargs):
            calls.append(1)
            if len(calls) == 3 and os.environ.get("REWARD_MODE") == "raise":
                raise ValueError("the reward server said 503")
            if len(calls) == 3 and os.environ.get("REWARD_MODE") == "hang":
                time.sleep(3600)
            if os.environ.get("REWARD_MODE") == "nan" and len(calls) > 40:  # a run that never stops
                raise RuntimeError("still called after 40 NaN rewards")
            if os.environ.get("REWARD_MODE") == "nan" or (os.environ.get("REWARD_MODE") == "nan_once"
                                                           and len(calls) == 2):
                return [float("nan") for c in completions]
            if os.environ.get("REWARD_MODE") == "collapse":  # learned at update 1, then nothing earns
                return [1.0 if len(calls) == 1 else 0.0 for c in completions]
            if os.environ.get("REWARD_MODE") == "one_way":  # groups split twice, then the 1st prompt right only
                half = len(completions) // 2
                return [float(i % 2 if len(calls) <= 2 else i < half) for i in range(len(completions))]
            return [float(len(c)) for c in completions]
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("flaky_reward", None)
    yield "py:flaky_reward:reward"
    sys.modules.pop("flaky_reward", None)


def test_a_reward_that_raises_at_update_3_leaves_update_2_resumable(capsys, tmp_path, tiny_model, reward_module,
                                                                     monkeypatch):
    monkeypatch.setenv("REWARD_MODE", "raise")
    run = tmp_path / "run"
    code, err = _cli(capsys, *_rlhf_args(tiny_model, run, reward_module, "--total-updates", "5"))
    assert code == 2 and len(error_lines(err)) == 1, err
    assert "reward py:flaky_reward:reward raised ValueError: the reward server said 503" in err
    fixed = (tmp_path / "flaky_reward.py").resolve()  # the fix for a failing reward is often an edit of its file:
    assert f"checkpoint at update 2: continue with ppoforge train rlhf --resume {run} (add --trust-run-dir if " \
           f"you changed {fixed})" in err  # then a plain --resume is refused, as the hint says
    assert torch.load(run / "checkpoint.pt", weights_only=True)["update"] == 2
    monkeypatch.setenv("REWARD_MODE", "ok")
    fixed.write_text(fixed.read_text() + "# fixed\n")
    code, err = _cli(capsys, "train", "rlhf", "--resume", str(run))
    assert code == 2 and "--trust-run-dir" in err, err
    code, err = _cli(capsys, "train", "rlhf", "--resume", str(run), "--trust-run-dir")
    assert code == 0, err
    assert torch.load(run / "checkpoint.pt", weights_only=True)["update"] == 5


def test_a_run_whose_reward_collapses_is_stopped_by_the_collapse_guard_with_one_line(capsys, tmp_path, tiny_model,
                                                                                      reward_module, monkeypatch):
    """The scores fall from 1 to a flat 0 after update 1: updates 2, 3, 4 are degenerate, and with
    collapse_patience 3 the run stops at update 4 (exit 1), keeping update 3; off, it runs to the end."""
    monkeypatch.setenv("REWARD_MODE", "collapse")
    run = tmp_path / "run"
    code, err = _cli(capsys, *_rlhf_args(tiny_model, run, reward_module, "--total-updates", "6"))
    assert code == 1 and len(error_lines(err)) == 1, err
    assert "the policy degenerated for 3 updates in a row (update 4: every score 0 for" \
        in err and "collapse_action: rollback" in err, err
    assert torch.load(run / "checkpoint.pt", weights_only=True)["update"] == 3
    assert [m["guard/collapse_streak"] for m in read_metrics(run / "metrics.jsonl")] == [0, 1, 2]
    sys.modules.pop("flaky_reward", None)  # its call count starts again
    code, err = _cli(capsys, *_rlhf_args(tiny_model, tmp_path / "off", reward_module, "--total-updates", "6",
                                         "--collapse-patience", "0"))
    assert code == 0, err


def test_a_grpo_run_whose_groups_stop_splitting_is_named_and_stopped(capsys, tmp_path, tiny_model, reward_module,
                                                                   monkeypatch):
    """Two prompts x 4 completions: every group splits at updates 1 and 2; from update 3 each prompt's
    completions score alike (the 1st prompt's 1, the 2nd's 0): no group has a signal. After groups that
    always split, the first such rollout is a sign; the 3rd in a row stops the run (update 5, keeping 4)."""
    monkeypatch.setenv("REWARD_MODE", "one_way")
    run = tmp_path / "run"
    args = _rlhf_args(tiny_model, run, reward_module, "--total-updates", "8", "--advantage", "grpo",
                      "--num-generations", "4", "--mini-batch-size", "8", "--micro-batch-size", "8")
    code, err = _cli(capsys, *args)
    assert code == 1 and len(error_lines(err)) == 1, err
    assert "the policy degenerated for 3 updates in a row (update 5: every prompt's completions scored alike " \
           "for 6 prompts in a row" in err, err
    assert [m["guard/collapse_streak"] for m in read_metrics(run / "metrics.jsonl")] == [0, 0, 1, 2]
    assert torch.load(run / "checkpoint.pt", weights_only=True)["update"] == 4


def test_a_reward_that_is_always_nan_rolls_back_max_rollbacks_times_then_stops_with_one_line(
        capsys, tmp_path, tiny_model, reward_module, monkeypatch):
    """Each rollback lowers the learning rate, which cannot make a NaN reward finite: after the default
    max_rollbacks (5), each said in one line, the run stops (exit 1) keeping the checkpoint it went back to."""
    monkeypatch.setenv("REWARD_MODE", "nan")
    run = tmp_path / "run"
    code, err = _cli(capsys, *_rlhf_args(tiny_model, run, reward_module, "--total-updates", "3",
                                         "--nonfinite-action", "rollback", "--nonfinite-patience", "2"))
    lines = [line for line in err.splitlines() if "max_rollbacks" in line]  # not the prompts' line
    assert code == 1 and len(lines) == 6, err
    for n, line in enumerate(lines[:5], 1):
        assert line.startswith("ppoforge: non-finite rewards (") and "2 times in a row (nonfinite_patience): " \
            f"rollback {n} of 5 (max_rollbacks) to update 0, the learning rate now x{0.5 ** n:.3g}" in line, line
    assert lines[5].startswith("ppoforge: error: non-finite rewards (") and "2 times in a row (nonfinite_patience)" \
        ": stopped after 5 rollbacks (max_rollbacks: 5; the learning rate at x0.0312); allowed: " in lines[5], err
    assert f"checkpoint at update 0: continue with ppoforge train rlhf --resume {run}" in lines[5]
    assert len(sys.modules["flaky_reward"].calls) == 12  # 6 times 2 updates, then no more
    assert torch.load(run / "checkpoint.pt", weights_only=True)["update"] == 0


def test_a_rollback_is_one_line_and_counted_in_guard_rollbacks(capsys, tmp_path, tiny_model, reward_module,
                                                               monkeypatch):
    monkeypatch.setenv("REWARD_MODE", "nan_once")  # update 2's reward: back to update 0, then all is well
    run = tmp_path / "run"
    code, err = _cli(capsys, *_rlhf_args(tiny_model, run, reward_module, "--total-updates", "3",
                                         "--nonfinite-action", "rollback", "--nonfinite-patience", "1"))
    lines = [line for line in err.splitlines() if "rollback" in line]
    assert code == 0 and len(lines) == 1 and "rollback 1 of 5 (max_rollbacks) to update 0" in lines[0], err
    metrics = read_metrics(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3] and [m["guard/rollbacks"] for m in metrics] == [1, 1, 1]


def test_a_hung_reward_times_out_with_one_line_and_a_checkpoint(capsys, tmp_path, tiny_model, reward_module,
                                                                monkeypatch):
    monkeypatch.setenv("REWARD_MODE", "hang")
    run = tmp_path / "run"
    start = time.monotonic()
    code, err = _cli(capsys, *_rlhf_args(tiny_model, run, reward_module, "--total-updates", "5",
                                         "--call-timeout", "1"))
    assert time.monotonic() - start < 60
    assert code == 1 and len(error_lines(err)) == 1, err
    assert "reward py:flaky_reward:reward did not return within 1 s (call_timeout)" in err
    assert "checkpoint at update 2" in err


def test_sigterm_wins_inside_a_hung_reward(capsys, tmp_path, tiny_model, reward_module, monkeypatch):
    monkeypatch.setenv("REWARD_MODE", "hang")
    from ppoforge.lm.rl.collect import SingleTurn

    run, calls, real_score = tmp_path / "run", [], SingleTurn.score

    def score_and_maybe_term(self, *args):
        calls.append(1)
        if len(calls) == 3:  # the hanging call: SIGTERM arrives a moment into it
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
        return real_score(self, *args)

    monkeypatch.setattr(SingleTurn, "score", score_and_maybe_term)
    start = time.monotonic()
    code = main(_rlhf_args(tiny_model, run, reward_module, "--total-updates", "5"))
    assert code == 0 and time.monotonic() - start < 60
    assert "stopped by SIGTERM, checkpoint saved: 2 updates" in capsys.readouterr().out
    assert torch.load(run / "checkpoint.pt", weights_only=True)["update"] == 2


def test_resume_refuses_code_that_changed_since_the_run_started(capsys, tmp_path, tiny_model, reward_module,
                                                                monkeypatch):
    monkeypatch.setenv("REWARD_MODE", "ok")
    run = tmp_path / "run"
    assert _cli(capsys, *_rlhf_args(tiny_model, run, reward_module, "--total-updates", "1"))[0] == 0
    assert json.loads((run / "code.json").read_text())["flaky_reward"]["sha256"]
    Path("flaky_reward.py").write_text(Path("flaky_reward.py").read_text() + "\nimport shutil  # new\n")
    code, err = _cli(capsys, "train", "rlhf", "--resume", str(run), "--total-updates", "2")
    assert code == 2 and "imports py:flaky_reward" in err and "--trust-run-dir" in err, err
    assert torch.load(run / "checkpoint.pt", weights_only=True)["update"] == 1  # nothing ran
    sys.modules.pop("flaky_reward", None)
    code, err = _cli(capsys, "train", "rlhf", "--resume", str(run), "--total-updates", "2", "--trust-run-dir")
    assert code == 0, err


def test_an_rlhf_resume_refuses_a_kl_coef_edited_in_config_yaml(capsys, tmp_path, tiny_model):
    """The KL controller's coefficient is in the checkpoint: a hand-edited kl_coef resumed with the old 0.05
    while config.yaml (rewritten after the load) said 0.2."""
    run = tmp_path / "run"
    assert _cli(capsys, *_rlhf_args(tiny_model, run, "length:3", "--total-updates", "1", "--kl-coef", "0.05"))[0] == 0
    text = (run / "config.yaml").read_text()
    assert "\nkl_coef: 0.05\n" in text
    (run / "config.yaml").write_text(text.replace("\nkl_coef: 0.05\n", "\nkl_coef: 0.2\n"))
    code, err = _cli(capsys, "train", "rlhf", "--resume", str(run), "--total-updates", "2")
    assert code == 2 and len(error_lines(err)) == 1, err
    assert f"resume: {run / 'config.yaml'} says kl_coef 0.2 but the checkpoint's run used 0.05; allowed: " in err, err
    assert torch.load(run / "checkpoint.pt", weights_only=True)["update"] == 1  # nothing ran
    (run / "config.yaml").write_text(text)
    assert _cli(capsys, "train", "rlhf", "--resume", str(run), "--total-updates", "2")[0] == 0


def test_resume_refuses_a_data_file_that_changed_since_the_run_started(capsys, tmp_path, tiny_model, reward_module,
                                                                       monkeypatch):
    monkeypatch.setenv("REWARD_MODE", "ok")
    run, prompts = tmp_path / "run", tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say {w}."}) + "\n" for w in ("yes", "no", "maybe")))
    argv = _rlhf_args(tiny_model, run, reward_module, "--total-updates", "1")
    argv[argv.index("demo")] = str(prompts)
    assert _cli(capsys, *argv)[0] == 0
    assert json.loads((run / "data_files.json").read_text())["prompts"]["sha256"]
    assert _cli(capsys, "train", "rlhf", "--resume", str(run), "--total-updates", "2")[0] == 0  # unchanged: fine
    prompts.write_text(prompts.read_text() + json.dumps({"prompt": "Say perhaps."}) + "\n")
    code, err = _cli(capsys, "train", "rlhf", "--resume", str(run), "--total-updates", "3")
    assert code == 2 and len(error_lines(err)) == 1, err
    assert f"prompts file {prompts}" in err and "changed since the run started" in err and "--trust-run-dir" in err
    assert torch.load(run / "checkpoint.pt", weights_only=True)["update"] == 2  # nothing ran
    code, err = _cli(capsys, "train", "rlhf", "--resume", str(run), "--total-updates", "3", "--trust-run-dir")
    assert code == 0, err


# ---- out of memory -------------------------------------------------------------------------------

def test_an_oom_in_a_micro_batch_halves_it_with_the_same_result(tmp_path, tiny_model):
    from ppoforge.lm.rl.config import RLHFConfig
    from ppoforge.lm.rl.trainer import RLHFTrainer

    values = dict(model=str(tiny_model), prompts="demo", heldout_prompts=None, reward="length:3", batch_size=4,
                  mini_batch_size=4, micro_batch_size=4, max_new_tokens=4, max_prompt_tokens=16, ppo_epochs=2,
                  total_updates=2, progress=False, tensorboard=False, device="cpu", learning_rate=1e-2,
                  precision="fp32")
    planned = RLHFTrainer(build_config(RLHFConfig, values), tmp_path / "planned")
    oom = RLHFTrainer(build_config(RLHFConfig, values), tmp_path / "oom")
    forward, calls = oom.layout.forward, {"n": 0}

    def forward_that_runs_out(rows):
        calls["n"] += 1
        if torch.is_grad_enabled() and rows.ids.shape[0] > 2:  # any training micro-batch of more than 2 rows
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 9 GB")
        return forward(rows)

    oom.layout.forward = forward_that_runs_out
    for trainer in (planned, oom):  # plain SGD: Adam's first steps are ~sign(g) and amplify rounding
        trainer.optimizer = torch.optim.SGD(trainer.params, lr=0.1)
        for _ in range(2):
            metrics, _ = trainer.train_one_update()
    assert oom.ppo.micro_batch == 2 and planned.ppo.micro_batch == 4 and metrics["guard/micro_batch_size"] == 2
    for (name, a), (_, b) in zip(planned.layout.named_trainable(), oom.layout.named_trainable(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)


def test_an_oom_in_generation_halves_the_generation_batch_with_the_same_draws(tmp_path, tiny_model):
    from ppoforge.lm.rl.config import RLHFConfig
    from ppoforge.lm.rl.trainer import RLHFTrainer

    values = dict(model=str(tiny_model), prompts="demo", heldout_prompts=None, reward="length:3", batch_size=8,
                  mini_batch_size=8, micro_batch_size=8, max_new_tokens=5, progress=False, tensorboard=False,
                  device="cpu", precision="fp32")
    trainer = RLHFTrainer(build_config(RLHFConfig, values), tmp_path)
    rows = trainer.inputs.prompt_ids[:8]
    want = trainer.collector.generate(rows, torch.Generator().manual_seed(3))[2]
    with trainer.layout.decoder() as decoder:
        prefill = decoder.prefill

        def prefill_that_runs_out(ids, mask, n):
            if ids.shape[0] > 2:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
            return prefill(ids, mask, n)

        decoder.prefill = prefill_that_runs_out
        got = trainer.collector.generate(rows, torch.Generator().manual_seed(3))[2]
        decoder.prefill = prefill
    assert trainer.collector.gen_batch == 2
    assert torch.equal(got.response_ids, want.response_ids) and torch.equal(got.response_mask, want.response_mask)
    torch.testing.assert_close(got.logp, want.logp, atol=1e-5, rtol=0)


# ---- the error boundary ------------------------------------------------------------------------------

def test_an_internal_error_is_one_line_and_debug_shows_the_traceback(capsys, tmp_path, monkeypatch):
    from ppoforge.control import trainer as control_trainer

    def broken(self):
        raise KeyError("a bug")

    monkeypatch.setattr(control_trainer.ControlTrainer, "train_one_update", broken)
    args = ["train", "control", *TINY, "--total-steps", "64", "--run-dir", str(tmp_path / "r")]
    code, err = _cli(capsys, *args)
    assert code == 1 and len(error_lines(err)) == 1 and "internal error KeyError: 'a bug'" in err
    assert "--debug" in err
    with pytest.raises(KeyError):
        main([*args[:-2], "--run-dir", str(tmp_path / "r2"), "--debug"])


def test_train_api_resume_after_failure_equals_uninterrupted(tmp_path, monkeypatch):
    """The library path (no CLI): the exception propagates, and the checkpoint it left resumes exactly."""
    cfg = build_config(ControlConfig, {**TINY_CFG, "checkpoint_every": 100})
    full = train(cfg, tmp_path / "full")
    trainer = ControlTrainer(cfg, tmp_path / "split")
    real, calls = trainer.runner.collect, {"n": 0}

    def collect_then_fail(policy, n):
        calls["n"] += 1
        if calls["n"] == 3:
            raise ConnectionError("env server went away")
        return real(policy, n)

    trainer.runner.collect = collect_then_fail
    with pytest.raises(ConnectionError, match="env server went away") as e:
        trainer.run()
    assert e.value.ppoforge_kept.startswith("checkpoint at update 2: continue with ppoforge train control --resume")
    resumed = train(cfg, tmp_path / "split", resume=True)
    assert resumed.updates == full.updates == 4
    assert _same(_weights(tmp_path / "split"), _weights(tmp_path / "full"))


def test_sequences_longer_than_the_model_are_refused_before_training(capsys, tmp_path, tiny_model):
    code, err = _cli(capsys, *_rlhf_args(tiny_model, tmp_path / "r", "length:3", "--max-new-tokens", "5000"))
    assert code == 2 and "max_prompt_tokens 16 + max_new_tokens 5000 = 5016 positions, more than the model's" in err
    assert not (tmp_path / "r" / "checkpoint.pt").exists()
