"""runtime/distributed.py: world 1 is the identity (bit for bit), the shard arithmetic, the global draws
of SlicedRng, global statistics equal to the single-process ones, and — on 2 gloo processes — the flat
gradient all-reduce (a rank without rows included), the error flag and the collective timeout."""

import os

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from ppoforge.core.stats import global_mean_var, masked_mean, masked_var, whiten
from ppoforge.runtime import distributed
from ppoforge.runtime.launch import free_port


def test_world_one_is_the_identity():
    assert distributed.init(5.0) == distributed.World(0, 1, 0) and distributed.is_main()
    x = torch.randn(3)
    assert distributed.all_sum(x) is x and distributed.all_mean(x) is x and distributed.all_gather(x) is x
    assert distributed.reducer() is None and distributed.any_true(True) and not distributed.any_true(False)
    p = torch.nn.Parameter(torch.ones(2))
    extra = torch.tensor([1.0])
    assert distributed.all_reduce_grads([p], extra) is extra and p.grad is None
    assert distributed.checked(lambda a: a + 1, 1) == 2
    rng = np.random.default_rng(0)
    assert distributed.sliced_rng(rng, slice(0, 4), 4) is rng
    assert distributed.shard(6, "batch_size") == slice(0, 6)


def test_shards(monkeypatch):
    monkeypatch.setattr(distributed, "_world", distributed.World(1, 3, 1))
    assert distributed.shard(6, "batch_size") == slice(2, 4)
    assert [distributed.uneven_shard(n) for n in (7, 2)] == [slice(3, 5), slice(1, 2)]
    monkeypatch.setattr(distributed, "_world", distributed.World(2, 3, 2))
    assert distributed.uneven_shard(2) == slice(2, 2)  # more ranks than items: none
    with pytest.raises(distributed.UserError, match="batch_size: 4 does not divide by the 3 ranks"):
        distributed.shard(4, "batch_size")


def test_sliced_rng_draws_the_global_batch_and_keeps_its_rows():
    whole, part = np.random.default_rng(3), distributed.SlicedRng(np.random.default_rng(3), slice(2, 4), 4)
    for _ in range(3):
        np.testing.assert_array_equal(part.random(2, dtype=np.float32), whole.random(4, dtype=np.float32)[2:4])
        np.testing.assert_array_equal(part.standard_normal((2, 3), dtype=np.float32),
                                      whole.standard_normal((4, 3), dtype=np.float32)[2:4])
    assert part.bit_generator.state == whole.bit_generator.state


def test_global_statistics_with_one_rank_are_the_single_process_ones_bit_for_bit():
    """One process takes the N-rank path (float64 sums, rounded once to x's dtype): whiten with or without
    `all_sum` is the same computation, and the statistics are the float64 masked ones."""
    x, mask = torch.randn(5, 7), (torch.rand(5, 7) > 0.3).float()
    mean, var = global_mean_var(x, mask, lambda t: t)
    assert mean.dtype == var.dtype == x.dtype
    x64, mask64 = x.double(), mask.double()
    assert torch.equal(mean, masked_mean(x64, mask64).float()) and torch.equal(var, masked_var(x64, mask64).float())
    assert torch.equal(whiten(x, mask, all_sum=lambda t: t), whiten(x, mask))


def _worker(rank: int, port: int, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    distributed.init(timeout_s=5.0)
    out = {}
    # the flat all-reduce: rank 1 has no gradient for the second parameter (no rows of its own)
    a, b = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(3))
    a.grad = torch.full((2, 2), rank + 1.0)
    b.grad = torch.ones(3) if rank == 0 else None
    out["extra"] = distributed.all_reduce_grads([a, b], torch.tensor([rank + 1.0, 10.0])).tolist()
    out["grads"] = (a.grad.tolist(), b.grad.tolist())
    # global whitening over two shards equals whitening the concatenation
    torch.manual_seed(0)
    x, mask = torch.randn(4, 5), (torch.rand(4, 5) > 0.3).float()
    mine = slice(2 * rank, 2 * rank + 2)
    out["whiten_gap"] = float((whiten(x[mine], mask[mine], all_sum=distributed.all_sum)
                               - whiten(x, mask)[mine]).abs().max())
    out["gather"] = distributed.gather_rows([f"row of {rank}"])

    def reward():
        if rank == 1:
            raise ValueError("boom")
        return 1

    try:
        distributed.checked(reward)
    except Exception as e:  # noqa: BLE001 - what each rank sees is the test's subject
        out["error"] = (type(e).__name__, str(e), getattr(e, "ppoforge_shared", False))
    # a rank that never arrives: the other one's collective times out with one line
    if rank == 0:
        try:
            distributed.barrier()
        except Exception as e:  # noqa: BLE001
            out["timeout"] = (type(e).__name__, str(e))
    else:
        import time

        time.sleep(8)
    queue.put((rank, out))


@pytest.mark.slow
@pytest.mark.torchrun
def test_two_gloo_ranks_all_reduce_flag_errors_and_time_out():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()  # both ranks meet at it
    procs = [ctx.Process(target=_worker, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    for rank in (0, 1):
        assert results[rank]["extra"] == [3.0, 20.0]
        assert results[rank]["grads"] == ([[3.0, 3.0], [3.0, 3.0]], [1.0, 1.0, 1.0])
        assert results[rank]["whiten_gap"] < 1e-6
        assert results[rank]["gather"] == ["row of 0", "row of 1"]
    assert results[0]["error"] == ("RankFailed", "rank 1: internal error ValueError: boom (a ppoforge bug: rerun "
                                   "with --debug for the traceback and report it)", True)
    assert results[1]["error"][:2] == ("ValueError", "boom") and results[1]["error"][2]
    name, line = results[0]["timeout"]
    assert name == "DistTimeout" and line.startswith("rank 0: a collective did not complete within 5 s")



def test_mean_metrics_gathers_values_from_several_devices_on_the_backend_device(monkeypatch):
    """A host-side count (a multi-turn episode metric) beside device statistics: one stack on the
    collective's device, not "Expected all tensors to be on the same device". `meta` stands in for the GPU
    that NCCL reduces on (no GPU here); the fake all-reduce refuses any other device, as NCCL does."""
    seen = []

    def nccl_like_all_reduce(t):
        assert t.device.type == "meta", f"NCCL would refuse a {t.device} tensor"
        seen.append(t.shape)

    monkeypatch.setattr(distributed, "_active", True, raising=False)  # (absent before the switch)
    monkeypatch.setattr(distributed, "_world", distributed.World(0, 2, 0))
    monkeypatch.setattr(distributed, "_device", lambda: torch.device("meta"))
    monkeypatch.setattr(distributed.dist, "all_reduce", nccl_like_all_reduce)
    out = distributed.mean_metrics({"env/turns": torch.tensor(2.0), "objective/kl": torch.zeros((), device="meta"),
                                    "val/num_eos_tokens": torch.ones(1, device="meta")}, summed=("val/num_eos_tokens",))
    assert seen == [torch.Size([3])] and list(out) == ["env/turns", "objective/kl", "val/num_eos_tokens"]
    assert all(v.device.type == "meta" for v in out.values())


def test_forced_collectives_at_world_one_run_every_collective_and_change_nothing(monkeypatch):
    """PPOFORGE_FORCE_COLLECTIVES=1 at world 1: a one-process gloo group; every helper goes through its
    collective (counted) and returns what the world-1 shortcut returns; finish() leaves the group."""
    monkeypatch.setenv(distributed.FORCE_ENV, "1")
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    ops = []
    real = distributed._collective
    monkeypatch.setattr(distributed, "_collective", lambda op, *a: (ops.append(op.__name__), real(op, *a))[1])
    assert distributed.init(5.0) == distributed.World(0, 1, 0)
    try:
        assert distributed.collectives() and distributed.dist.is_initialized()
        x = torch.arange(3.0)
        assert distributed.all_sum(x) is x and x.tolist() == [0.0, 1.0, 2.0]  # in place, as before
        assert torch.equal(distributed.all_mean(torch.ones(2)), torch.ones(2))
        assert torch.equal(distributed.all_gather(x), x) and distributed.gather_rows(["a"]) == ["a"]
        assert distributed.any_true(True) and not distributed.any_true(False)
        assert distributed.checked(lambda a: a + 1, 1) == 2 and distributed.rank0_value("d") == "d"
        p = torch.nn.Parameter(torch.ones(2))
        p.grad = torch.full((2,), 3.0)
        assert distributed.all_reduce_grads([p], torch.tensor([5.0])).tolist() == [5.0] and p.grad.tolist() == [3.0] * 2
        distributed.broadcast_params([p])
        assert distributed.mean_metrics({"a": torch.tensor(4.0)})["a"].item() == 4.0
        assert distributed.reducer() is distributed.all_sum
        distributed.barrier()
        assert {"all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list",
                "barrier"} <= set(ops)
    finally:
        distributed.finish(0)  # the forced group is left; the process goes on (no os._exit)
    assert not distributed.collectives() and not distributed.dist.is_initialized()
    assert distributed.all_sum(x) is x
