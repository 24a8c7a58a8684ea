"""Control PPO under torchrun (gloo, 2 CPU processes): num_envs sharded, global advantage statistics and
minibatch weights, one gradient all-reduce per step — the same parameters as one process with the same
global batch. Pendulum (SyncVectorEnv: env i seeded seed + i whatever the rank), one minibatch per epoch,
autograd on both sides (the hand-derived gradients are single-process). Tolerance: fp32, 1e-5."""

import pytest
import torch

from ppoforge.cli import main
from ppoforge.runtime.metrics import read_metrics

ARGS = ["--env-id", "Pendulum-v1", "--num-envs", "4", "--num-steps", "16", "--total-steps", "128",
        "--num-minibatches", "1", "--update-epochs", "2", "--hand-gradients", "false", "--device", "cpu",
        "--torch-threads", "1", "--progress", "false", "--tensorboard", "false", "--dist-timeout", "60"]


NORMALIZED = ["--normalize-obs", "true", "--normalize-reward", "true"]
EXTRA = {"plain": [], "normalized": NORMALIZED}
# the 2-rank run of each test: all of them in ONE torchrun launch (tests/conftest.py: torchrun_runs), which
# pays the import and the rendezvous once
LAUNCHED = {"test_two_ranks_equal_one_rank[plain]": ARGS, "test_two_ranks_equal_one_rank[normalized]":
            [*ARGS, *NORMALIZED], "test_a_two_rank_checkpoint_resumes_on_one_rank": [*ARGS, "--total-steps", "64"]}


@pytest.fixture(scope="module")
def two_ranks(request, tmp_path_factory, torchrun_runs) -> dict:
    """{test name: its 2-rank run dir}: the selected tests' runs, made in one launch."""
    root = tmp_path_factory.mktemp("two_ranks")
    tests = [item.name for item in request.session.items if item.module is request.module and item.name in LAUNCHED]
    run_dirs = {test: root / str(i) for i, test in enumerate(tests)}
    if tests:
        torchrun_runs([["train", "control", "--run-dir", str(run_dirs[t]), *LAUNCHED[t]] for t in tests],
                      root / "launch")
    return run_dirs


@pytest.fixture
def launched(two_ranks, request):
    """This test's 2-rank run dir, made by the module's one launch (`two_ranks`)."""
    return two_ranks[request.node.name]


@pytest.mark.slow
@pytest.mark.torchrun
@pytest.mark.parametrize("variant", list(EXTRA))
def test_two_ranks_equal_one_rank(tmp_path, variant, launched):
    """With the normalizers on, each rank's statistics are the global ones (every rank's envs gathered)."""
    extra = EXTRA[variant]
    one, two = tmp_path / "one", launched
    assert main(["train", "control", "--run-dir", str(one), *ARGS, *extra]) == 0
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
@pytest.mark.torchrun
def test_a_two_rank_checkpoint_resumes_on_one_rank(launched):
    """Agent, optimizer, normalizers, policy RNG (shared by the ranks) and counters resume; rank 0's
    environments are not the others', so every rank restarts its episodes (docs/distributed.md)."""
    run = launched
    assert main(["train", "control", "--resume", str(run), "--total-steps", "128"]) == 0
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [64, 128]
    assert torch.load(run / "checkpoint.pt", weights_only=True)["update"] == 2
