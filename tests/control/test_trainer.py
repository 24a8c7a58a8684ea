"""Control trainer: smoke, exact resume after SIGTERM, learning CartPole, evaluation."""

import json
import math
import os
import signal

import pytest
import torch

from ppoforge.config import build_config
from ppoforge.control.config import ControlConfig
from ppoforge.control.evaluate import evaluate
from ppoforge.control.trainer import CHECKPOINT, ControlTrainer, train
from ppoforge.runtime import metrics as metrics_mod

TINY = {"num_envs": 2, "num_steps": 32, "total_steps": 384, "progress": False, "device": "cpu",
        "checkpoint_every": 1000}


def _rows(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "charts/SPS"} for r in rows]  # timing differs by nature


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
def test_smoke_params_change_losses_finite_files_written(tmp_path, env_id):
    cfg = build_config(ControlConfig, {**TINY, "env_id": env_id, "normalize_obs": env_id == "Pendulum-v1"})
    trainer = ControlTrainer(cfg, tmp_path)
    before = [p.detach().clone() for p in trainer.agent.parameters()]
    result = trainer.run()
    assert result.updates == 6 and result.global_step == 384
    for old, new in zip(before, trainer.agent.parameters(), strict=True):
        assert not torch.equal(old, new)
    rows = _rows(tmp_path)
    assert len(rows) == 6
    for key in ("losses/policy_loss", "losses/value_loss", "losses/entropy", "losses/approx_kl"):
        assert all(isinstance(r[key], float) and math.isfinite(r[key]) for r in rows), key
    assert (tmp_path / CHECKPOINT).exists() and (tmp_path / "config.yaml").exists()
    assert list((tmp_path / "tb").iterdir())
    summary = json.loads((tmp_path / "summary.json").read_text())  # the schema every trainer writes
    assert {k: summary[k] for k in ("trainer", "steps", "unit", "stopped_by", "export", "updates")} == \
        {"trainer": "control", "steps": 384, "unit": "env_step", "stopped_by": None, "export": None, "updates": 6}
    assert summary["losses/value_loss"] == pytest.approx(rows[-1]["losses/value_loss"])


def test_bf16_training_runs_on_cpu(tmp_path):
    cfg = build_config(ControlConfig, {**TINY, "precision": "bf16", "tensorboard": False})
    ControlTrainer(cfg, tmp_path).run()
    losses = [r["losses/value_loss"] for r in _rows(tmp_path)]
    assert losses and all(isinstance(v, float) and math.isfinite(v) for v in losses)


def test_sigterm_saves_and_resume_matches_an_uninterrupted_run_bit_for_bit(tmp_path, monkeypatch):
    cfg = build_config(ControlConfig, {**TINY, "normalize_obs": True, "normalize_reward": True,
                                       "tensorboard": False})
    train(cfg, tmp_path / "straight")

    real_log = metrics_mod.MetricsLogger.log
    calls = {"n": 0}

    def log_then_sigterm(self, step, metrics):
        real_log(self, step, metrics)
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler would, mid-run

    monkeypatch.setattr(metrics_mod.MetricsLogger, "log", log_then_sigterm)
    stopped = train(cfg, tmp_path / "resumed")
    assert stopped.stopped_by == "SIGTERM" and stopped.updates == 3
    monkeypatch.setattr(metrics_mod.MetricsLogger, "log", real_log)
    finished = train(cfg, tmp_path / "resumed", resume=True)
    assert finished.stopped_by is None and finished.updates == 6
    assert _rows(tmp_path / "resumed") == _rows(tmp_path / "straight")


@pytest.mark.slow
def test_learns_cartpole(tmp_path):
    cfg = build_config(ControlConfig, {"total_steps": 120_000, "seed": 1, "progress": False, "device": "cpu",
                                       "tensorboard": False})
    result = train(cfg, tmp_path)
    recent = result.recent_returns[-20:]
    assert sum(recent) / len(recent) >= 195, recent
    assert (tmp_path / "learning_curve.png").stat().st_size > 10_000
    scores = evaluate(tmp_path, episodes=5)
    assert sum(scores["deterministic"]) / 5 >= 195, scores
