"""The CLI: help lists every field, bad input is one line + exit 2, train/eval/resume work end to end."""

import subprocess
import sys
from importlib import metadata

import pytest

import ppoforge
from ppoforge.cli import main

FAST = ["--num-envs", "2", "--num-steps", "16", "--total-steps", "64", "--progress", "false",
        "--tensorboard", "false"]


def test_help_shows_every_field_with_doc_and_default(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "control", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--total-steps INT" in out and "environment steps to train for" in out and "(default: 500000)" in out
    assert "--target-kl FLOAT" in out and "--precision STR" in out


def test_version_prints_ppoforge_and_torch_and_exits_0(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"ppoforge {ppoforge.__version__} (torch {metadata.version('torch')})\n"


@pytest.mark.parametrize("domain", ["control", "rlhf", "sft", "reward"])
def test_every_trainer_help_prints(domain, capsys):
    """argparse %-formats help text: a field whose help says "90% of" once crashed `train rlhf --help`."""
    with pytest.raises(SystemExit) as exit_info:
        main(["train", domain, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--precision STR" in out
    if domain == "rlhf":
        assert "90% of" in out


@pytest.mark.parametrize("argv, message", [
    (["train", "control", "--total-steps", "abc"], "total_steps: 'abc' is not an integer; allowed: an integer >= 1"),
    (["train", "control", "--gamma", "2"], "gamma: 2.0 is out of range"),
    (["train", "control", "--env-id", "CartPol-v1"], "did you mean CartPole-v1"),
    (["train", "control", "--preset", "nope"], "no built-in preset 'nope'"),
    (["train", "control", "--no-such-flag", "1"], "unknown option --no-such-flag; allowed: the options"),
    (["train", "control", "--num-env", "2"], "unknown option --num-env; did you mean --num-envs?"),
    (["train", "control", "--precision", "fp16", "--device", "cpu"], "fp16 needs a CUDA device"),
    (["eval", "/nonexistent/run"], "no config.yaml in run dir"),
    (["train", "control", "--resume", "/nonexistent/run"], "no config.yaml in run dir"),
])
def test_bad_input_is_one_line_and_exit_code_2(argv, message, capsys, tmp_path):
    code = main([*argv, "--runs-root", str(tmp_path)] if argv[:2] == ["train", "control"] else argv)
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("ppoforge: error: ") and message in err, err
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_real_entry_point_has_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "ppoforge", "train", "control", "--num-envs", "zero"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == ("ppoforge: error: num_envs: 'zero' is not an integer; allowed: an integer >= 1 "
                                   "and <= 65536")


def test_train_resume_and_eval_from_the_cli(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "control", "--preset", "cartpole", *FAST, "--run-dir", str(run)]) == 0
    assert "done: 64 steps" in capsys.readouterr().out
    # resume with a longer budget continues from the checkpoint
    assert main(["train", "control", "--resume", str(run), "--total-steps", "128"]) == 0
    assert "done: 128 steps" in capsys.readouterr().out
    assert "total_steps: 128" in (run / "config.yaml").read_text()
    assert main(["eval", str(run), "--episodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "deterministic:" in out and "sampled:" in out and "over 2 episodes" in out


def test_a_stopped_sft_or_reward_run_points_to_resume_not_to_a_model(tmp_path):
    from ppoforge.cli import _export

    assert _export({"stopped_by": None}, tmp_path) == f"model {tmp_path / 'model'}"
    assert _export({"stopped_by": "SIGTERM"}, tmp_path) == f"run dir {tmp_path} (--resume to finish)"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from ppoforge.lm.models.tiny import save_tiny_lm

    return save_tiny_lm(tmp_path_factory.mktemp("tiny") / "model")


def test_closing_lines_say_which_loss_when_nothing_is_held_out_and_count_one_update(tmp_path, tiny_model, capsys):
    """With --eval-fraction 0 the SFT line said "eval loss" of the training loss and the reward line "accuracy
    nan%"; one RLHF update was "1 updates"."""
    import json

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "completion": "a", "chosen": "good", "rejected": "bad"})
                            + "\n" for i in range(4)))
    quiet = ["--progress", "false", "--tensorboard", "false", "--model", str(tiny_model)]
    for trainer in ("sft", "reward"):
        assert main(["train", trainer, "--preset", "tiny", *quiet, "--data", str(data), "--eval-fraction", "0",
                     "--run-dir", str(tmp_path / trainer)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "train loss" in out[0] and "(no held-out rows)" in out[0] and "eval loss" not in out[0], out
    assert "no held-out pairs" in out[1] and "nan" not in out[1], out
    assert main(["train", "rlhf", *quiet, "--prompts", str(data), "--heldout-prompts", "none", "--reward", "length:8",
                 "--total-updates", "1", "--batch-size", "2", "--mini-batch-size", "2", "--micro-batch-size", "2",
                 "--max-new-tokens", "2", "--lora-r", "2", "--device", "cpu", "--run-dir", str(tmp_path / "rl")]) == 0
    assert capsys.readouterr().out.startswith("done: 1 update (2 episodes), "), out


def test_the_rlhf_closing_lines_give_held_out_before_and_after_the_model_and_tensorboard(tmp_path, tiny_model,
                                                                                      capsys):
    """Issue 39: the end of a run said only "done: 2 updates (64 episodes), last mean score 0.462; run dir ..."."""
    import json

    prompts, heldout = tmp_path / "p.jsonl", tmp_path / "h.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(6)))
    heldout.write_text("".join(json.dumps({"prompt": f"other question {i}"}) + "\n" for i in range(2)))
    run = tmp_path / "rl"
    assert main(["train", "rlhf", "--progress", "false", "--model", str(tiny_model), "--prompts", str(prompts),
                 "--heldout-prompts", str(heldout), "--reward", "length:8", "--total-updates", "1", "--batch-size",
                 "2", "--mini-batch-size", "2", "--max-new-tokens", "2", "--lora-r", "2", "--device", "cpu",
                 "--heldout-samples", "1", "--run-dir", str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    summary = json.loads((run / "summary.json").read_text())
    before, after = summary["heldout_before"], summary["heldout_after"]
    assert out[0].startswith("done: 1 update (2 episodes), last mean score ") and \
        out[0].endswith(f"; held-out mean score {before:.3f} -> {after:.3f}"), out
    assert out[1:] == [f"model {run / 'model'} (LoRA adapter, PEFT format); summary {run / 'summary.json'}",
                       f"curves: tensorboard --logdir {run}"], out


def test_a_run_whose_every_rollout_was_flat_says_nothing_was_learned(tmp_path, tiny_model, capsys):
    """Issue 37: a GRPO run whose every group scored alike (no learning signal) ended with a plain "done"."""
    reward = tmp_path / "same.py"
    reward.write_text("def reward(prompts, completions, **kwargs):\n    return [1.0] * len(completions)\n")
    run = tmp_path / "rl"
    assert main(["train", "rlhf", "--progress", "false", "--model", str(tiny_model), "--prompts", "demo",
                 "--heldout-prompts", "none", "--reward", f"py:{reward}:reward", "--advantage", "grpo",
                 "--num-generations", "2", "--kl-coef", "0", "--total-updates", "2", "--batch-size", "2",
                 "--max-new-tokens", "2", "--max-prompt-tokens", "16", "--lora-r", "2", "--device", "cpu",
                 "--tensorboard", "false", "--run-dir", str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("note: 2 of 2 updates skipped as flat (every group's scores agreed"), out
