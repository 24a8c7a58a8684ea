"""`ppoforge pipeline`: three stages from one YAML on tiny models; a rerun skips finished stages and
resumes an interrupted one; a bad field in a later stage fails before the first stage starts."""

import json
import os
import signal

import pytest
import yaml

from ppoforge.cli import main

POS = ["great", "wonderful", "excellent", "happy", "love", "amazing"]
NEG = ["terrible", "awful", "sad", "hate", "boring", "horrible"]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from transformers import BertConfig, BertForSequenceClassification

    from ppoforge.lm.models.tiny import save_tiny_lm, tiny_tokenizer

    root = tmp_path_factory.mktemp("models")
    policy = save_tiny_lm(root / "policy")
    tok = tiny_tokenizer()
    tok.chat_template = None
    tok.save_pretrained(root / "rm")
    BertForSequenceClassification(BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2,
                                             num_attention_heads=2, intermediate_size=64, num_labels=1,
                                             max_position_embeddings=128,
                                             pad_token_id=tok.pad_token_id)).save_pretrained(root / "rm")
    data = root / "pairs.jsonl"
    rows = [{"prompt": f"Write one sentence about {t}.", "chosen": f"It is {p}.", "rejected": f"It is {n}."}
            for t in ("rain", "coffee", "the city", "my friend") for p, n in zip(POS, NEG, strict=True)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sft = root / "sft.jsonl"
    sft.write_text("".join(json.dumps({"prompt": r["prompt"], "completion": r["chosen"]}) + "\n" for r in rows))
    return policy, root / "rm", data, sft


def _spec(tiny_models, **ppo):
    policy, rm, pairs, sft = tiny_models
    # fp32: one process and two ranks are compared to 1e-4, which bf16 (auto, on some CPUs) does not hold
    common = {"progress": False, "tensorboard": False, "device": "cpu", "torch_threads": 1, "precision": "fp32"}
    return {"sft": {"model": str(policy), "data": str(sft), "lora_r": 4, "batch_size": 8, "micro_batch_size": 8,
                    "epochs": 1, "max_length": 64, "sample_prompts": 1, "sample_tokens": 3, **common},
            "reward": {"model": str(rm), "data": str(pairs), "layout": "full", "batch_size": 8, "micro_batch_size": 8,
                       "epochs": 1, "max_length": 64, "learning_rate": 1e-3, **common},
            "ppo": {"prompts": "demo", "heldout_prompts": "demo-heldout", "heldout_samples": 1, "batch_size": 4,
                    "mini_batch_size": 4, "micro_batch_size": 4, "max_new_tokens": 3, "total_updates": 2,
                    "lora_r": 4, "checkpoint_every": 1, **common, **ppo}}


def _write(tmp_path, spec):
    path = tmp_path / "pipe.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_three_stages_then_a_rerun_redoes_nothing_and_refuses_a_changed_finished_stage(tmp_path, tiny_models, capsys):
    config, run = _write(tmp_path, _spec(tiny_models)), tmp_path / "run"
    assert main(["pipeline", str(config), "--run-dir", str(run)]) == 0
    out = capsys.readouterr()
    assert "reward model: held-out pairwise accuracy" in out.out and "learned reward on held-out prompts" in out.out
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary) == {"sft", "reward", "ppo"}
    assert summary["ppo"]["updates"] == 2 and "heldout_before" in summary["ppo"]
    ppo_cfg = yaml.safe_load((run / "ppo" / "config.yaml").read_text())
    assert ppo_cfg["model"] == str(run / "sft" / "model") and ppo_cfg["reward"] == f"model:{run / 'reward' / 'model'}"
    mtimes = {p: p.stat().st_mtime_ns for p in run.rglob("checkpoint.pt")}
    assert main(["pipeline", str(config), "--run-dir", str(run)]) == 0
    assert capsys.readouterr().err.count("already finished") == 3
    assert {p: p.stat().st_mtime_ns for p in run.rglob("checkpoint.pt")} == mtimes  # nothing was redone
    spec = _spec(tiny_models)
    spec["reward"]["learning_rate"] = 2e-3  # a finished stage whose settings changed is not silently reused
    assert main(["pipeline", str(_write(tmp_path, spec)), "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "ppoforge: error: pipeline: reward finished in" in err, err
    assert "learning_rate (0.001 -> 0.002)" in err and "allowed: " in err
    config, pairs = _write(tmp_path, _spec(tiny_models)), tiny_models[2]
    text = pairs.read_text()
    try:  # nor one whose data file changed
        pairs.write_text(text + text.splitlines(keepends=True)[0])
        assert main(["pipeline", str(config), "--run-dir", str(run)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"reward finished in {run / 'reward'}" in err
        assert f"data file {pairs}" in err and "changed" in err, err
    finally:
        pairs.write_text(text)
    assert {p: p.stat().st_mtime_ns for p in run.rglob("checkpoint.pt")} == mtimes


def test_an_interrupted_stage_resumes_inside_the_stage(tmp_path, tiny_models, capsys, monkeypatch):
    from ppoforge.lm.rl import trainer as rlhf

    config, run = _write(tmp_path, _spec(tiny_models, total_updates=3)), tmp_path / "run"
    real = rlhf.RLHFTrainer.train_one_update

    def stop_after_update_1(self):
        result = real(self)
        if self.update == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    monkeypatch.setattr(rlhf.RLHFTrainer, "train_one_update", stop_after_update_1)
    assert main(["pipeline", str(config), "--run-dir", str(run)]) == 0
    assert "stopped by SIGTERM in stage ppo" in capsys.readouterr().out
    assert (run / "sft" / "stage.json").is_file() and not (run / "ppo" / "stage.json").exists()
    monkeypatch.setattr(rlhf.RLHFTrainer, "train_one_update", real)
    assert main(["pipeline", str(config), "--run-dir", str(run)]) == 0
    err = capsys.readouterr().err
    assert err.count("already finished") == 2  # sft and reward
    steps = [json.loads(line)["step"] for line in (run / "ppo" / "metrics.jsonl").read_text().splitlines()]
    assert [s for s in steps if s] == [1, 2, 3, 3]  # updates 1-3 once (and the final held-out eval at 3)


def test_a_bad_field_in_a_later_stage_fails_before_any_stage_runs(tmp_path, tiny_models, capsys):
    spec = _spec(tiny_models, kl_coef=float("nan"))
    code = main(["pipeline", str(_write(tmp_path, spec)), "--run-dir", str(tmp_path / "run")])
    assert code == 2 and "pipeline: ppo: kl_coef: nan is not a finite number" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    bad = _write(tmp_path, {"sft": {"model": "x", "data": "y"}, "rl": {}})
    code = main(["pipeline", str(bad)])
    assert code == 2 and "allowed: sft, reward and ppo sections" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.torchrun
def test_two_ranks_under_torchrun_write_one_summary_equal_to_one_process(tmp_path, tiny_models):
    """Every stage's trainer runs on both ranks; rank 0 alone prints and writes the summaries, which hold
    the single-process numbers (each trainer's 2-rank run equals its 1-rank run: tests/lm/test_distributed.py)."""
    import subprocess
    from pathlib import Path

    import ppoforge
    from ppoforge.runtime.launch import torchrun

    config, one, two = _write(tmp_path, _spec(tiny_models)), tmp_path / "one", tmp_path / "two"
    assert main(["pipeline", str(config), "--run-dir", str(one)]) == 0
    env = {**os.environ, "PYTHONPATH": str(Path(ppoforge.__file__).parents[1]), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(torchrun(["pipeline", str(config), "--run-dir", str(two)], 2), env=env, text=True,
                         capture_output=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("reward model: held-out pairwise accuracy") == 1, run.stdout
    assert run.stderr.count("ppoforge pipeline: ppo in") == 1
    a, b = (json.loads((d / "summary.json").read_text()) for d in (one, two))
    assert a.keys() == b.keys() == {"sft", "reward", "ppo"}
    for stage in a:  # the reward model's 2-rank sums round apart in the 6th digit (its train/grad_norm 3e-6):
        for key, value in a[stage].items():  # PPO's scores carry that, and its gradient norm (~1.2) 1e-3 of it
            rel = 3e-3 if key.endswith("grad_norm") else 1e-3
            if not key.startswith("perf/") and isinstance(value, float):
                assert b[stage][key] == pytest.approx(value, rel=rel, abs=1e-4), (stage, key)


def test_a_pipeline_whose_run_dir_is_in_use_is_refused_before_any_stage_runs(tmp_path, capsys):
    from ppoforge.runtime.rundir import RunDirLock

    spec = {"sft": {"model": "no-such-model", "data": "no-such-data.jsonl"}}
    running = RunDirLock(tmp_path / "run")  # the same pipeline, still going
    running.acquire()
    try:
        code = main(["pipeline", str(_write(tmp_path, spec)), "--run-dir", str(tmp_path / "run")])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and f"run_dir: {tmp_path / 'run'} is in use by pid {os.getpid()}" in err[0]
        assert [p.name for p in (tmp_path / "run").iterdir()] == [".lock"]  # no stage began
    finally:
        running.release()


def test_describe_says_which_loss_and_no_held_out_pairs_when_nothing_is_held_out():
    from ppoforge.pipeline import describe

    text = describe({"sft": {"steps": 1, "train/loss": 2.5}, "reward": {"steps": 3}, "ppo": {"updates": 1}})
    assert text.splitlines()[:2] == ["sft: 1 step, train loss 2.500 (no held-out rows)",
                                     "reward model: no held-out pairs"]
    assert text.splitlines()[2].startswith("ppo: 1 update, ")
    text = describe({"sft": {"steps": 2, "eval/loss": 1.25}, "reward": {"eval/accuracy": 0.5, "eval/gap": 0.1}})
    assert text.splitlines() == ["sft: 2 steps, held-out loss 1.250", "reward model: held-out pairwise accuracy 50.0%, "
                                 "mean gap +0.10"]
