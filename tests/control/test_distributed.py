"""Control PPO under torchrun (gloo, 2 CPU processes): num_envs sharded, global advantage statistics and
minibatch weights, one gradient all-reduce per step — the same parameters as one process with the same
global batch. Pendulum (SyncVectorEnv: env i seeded seed + i whatever the rank), one minibatch per epoch,
autograd on both sides (the hand-derived gradients are single-process). Tolerance: fp32, 1e-5."""

import os
import subprocess
from pathlib import Path

import pytest
import torch

import ppoforge
from ppoforge.cli import main
from ppoforge.runtime.launch import torchrun
from ppoforge.runtime.metrics import read_metrics

SRC = str(Path(ppoforge.__file__).parents[1])
ARGS = ["--env-id", "Pendulum-v1", "--num-envs", "4", "--num-steps", "16", "--total-steps", "128",
        "--num-minibatches", "1", "--update-epochs", "2", "--hand-gradients", "false", "--device", "cpu",
        "--torch-threads", "1", "--progress", "false", "--tensorboard", "false", "--dist-timeout", "60"]


NORMALIZED = ["--normalize-obs", "true", "--normalize-reward", "true"]


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], NORMALIZED], ids=["plain", "normalized"])
def test_two_ranks_equal_one_rank(tmp_path, extra):
    """With the normalizers on, each rank's statistics are the global ones (every rank's envs gathered)."""
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(["train", "control", "--run-dir", str(one), *ARGS, *extra]) == 0
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(torchrun(["train", "control", "--run-dir", str(two), *ARGS, *extra], 2),
                         capture_output=True, text=True, timeout=240, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    a = torch.load(one / "checkpoint.pt", weights_only=True)["agent"]
    b = torch.load(two / "checkpoint.pt", weights_only=True)["agent"]
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(f"max |2 ranks - 1 rank| = {worst:.3g}")
    assert worst <= 1e-5
    m1, m2 = read_metrics(one / "metrics.jsonl"), read_metrics(two / "metrics.jsonl")
    assert len(m1) == len(m2) == 2
    for key in ("losses/policy_loss", "losses/value_loss", "losses/approx_kl"):
        assert m2[-1][key] == pytest.approx(m1[-1][key], rel=1e-4, abs=1e-6), key
    assert (two / "config.yaml").read_text().startswith("# world_size: 2, per-rank batch: 2 envs")
    if extra:  # rank 0's checkpointed normalizers are the single process's
        n1 = torch.load(one / "checkpoint.pt", weights_only=True)["runner"]
        n2 = torch.load(two / "checkpoint.pt", weights_only=True)["runner"]
        for name in ("obs_rms", "ret_rms"):
            assert n2[name]["count"] == n1[name]["count"] > 1
            assert torch.allclose(torch.tensor(n2[name]["mean"]), torch.tensor(n1[name]["mean"]), rtol=1e-9, atol=1e-9)


@pytest.mark.slow
def test_a_two_rank_checkpoint_resumes_on_one_rank(tmp_path):
    """Agent, optimizer, normalizers, policy RNG (shared by the ranks) and counters resume; rank 0's
    environments are not the others', so every rank restarts its episodes (docs/distributed.md)."""
    run = tmp_path / "r"
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    two = subprocess.run(torchrun(["train", "control", "--run-dir", str(run), *ARGS, "--total-steps", "64"], 2),
                         capture_output=True, text=True, timeout=240, env=env)
    assert two.returncode == 0, two.stderr[-3000:]
    assert main(["train", "control", "--resume", str(run), "--total-steps", "128"]) == 0
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [64, 128]
    assert torch.load(run / "checkpoint.pt", weights_only=True)["update"] == 2
