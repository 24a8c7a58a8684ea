"""Backends, the N-process all-reduce (real, hung, crashed), the FSDP2 step (real, wrong, hung, unsupported),
the multi-node rendezvous, /dev/shm and memlock."""

import resource
from concurrent.futures import ThreadPoolExecutor

import pytest

from ppoforge.doctor.distributed import (
    DistFacts,
    Rendezvous,
    check_allreduce,
    check_dist_backends,
    check_fsdp,
    check_memlock,
    check_rendezvous,
    check_shm,
    rendezvous_target,
    run_allreduce,
    shm_bytes,
)
from ppoforge.runtime.fsdp import cpu_unsupported_reason
from ppoforge.runtime.launch import free_port

MIB, GIB = 2**20, 2**30


def test_backends():
    assert check_dist_backends(DistFacts(True, False, None, 0)).status == "ok"
    r = check_dist_backends(DistFacts(True, False, None, 2))
    assert r.status == "fail" and "no NCCL" in r.evidence
    assert check_dist_backends(DistFacts(False, False, None, 0)).status == "fail"
    assert "NCCL 2.21.5" in check_dist_backends(DistFacts(True, True, "2.21.5", 2)).evidence


def test_allreduce_hang_becomes_a_fail_with_the_nccl_fixes():
    r = check_allreduce(gpus=2, nccl=True, timeout=1.5, code="import time; time.sleep(60)")
    assert r.status == "fail" and "nccl all-reduce: hung" in r.evidence and "killed" in r.evidence
    for fix in ("NCCL_P2P_DISABLE=1", "NCCL_SOCKET_IFNAME", "--ipc=host"):
        assert fix in r.fix


def test_allreduce_hang_on_gloo_gives_the_gloo_fixes():
    r = check_allreduce(gpus=0, nccl=False, timeout=1.0, code="import time; time.sleep(60)")
    assert r.status == "fail" and "gloo" in r.evidence and "GLOO_SOCKET_IFNAME" in r.fix


def test_allreduce_rank_crash_is_reported():
    code = "import sys; sys.stderr.write('RuntimeError: connection refused\\n'); sys.exit(3)"
    r = check_allreduce(gpus=0, nccl=False, timeout=20, code=code)
    assert r.status == "fail" and "exit codes [3, 3]" in r.evidence and "connection refused" in r.evidence


@pytest.mark.slow
@pytest.mark.torchrun
def test_real_gloo_allreduce():
    r = check_allreduce(gpus=0, nccl=False, timeout=60)
    assert r.status == "ok", r.evidence
    assert "both ranks got 12.0" in r.evidence


def test_small_shm_in_a_container_warns():
    r = check_shm(64 * MIB, container=True)
    assert r.status == "warn" and "0.06 GiB" in r.evidence and "--ipc=host" in r.fix and "--shm-size" in r.fix
    assert "remount" in check_shm(64 * MIB, container=False).fix
    assert check_shm(8 * GIB, container=True).status == "ok"
    assert check_shm(None, container=True).status == "warn"


def test_shm_bytes_reads_a_filesystem(tmp_path):
    assert shm_bytes(str(tmp_path)) > 0
    assert shm_bytes(str(tmp_path / "missing")) is None


def test_memlock():
    assert check_memlock(resource.RLIM_INFINITY, gpus=8).status == "ok"
    r = check_memlock(64 * 1024, gpus=8)
    assert r.status == "warn" and "64 KiB" in r.evidence and "--ulimit memlock=-1" in r.fix
    assert check_memlock(64 * 1024, gpus=0).status == "ok"


@pytest.mark.slow
@pytest.mark.torchrun
def test_real_gloo_allreduce_over_three_processes():
    passed, what = run_allreduce("gloo", 60, nproc=3)
    assert passed and what == "all 3 ranks got 24.0 (= 4 x (1 + 2 + 3))", what


def test_rendezvous_target_from_options_or_the_environment():
    assert rendezvous_target(None, None, None, {}) is None
    env = {"MASTER_ADDR": "node0", "SLURM_NNODES": "4", "SLURM_NODEID": "2"}
    assert rendezvous_target(None, None, None, env) == Rendezvous("node0", 29500, 4, 2)
    assert rendezvous_target("10.0.0.1:1234", 2, 1, env) == Rendezvous("10.0.0.1", 1234, 2, 1)
    assert check_rendezvous(None).status == "skip"


def test_two_nodes_meet_and_a_missing_node_fails_with_the_fixes():
    port = free_port()
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda r: check_rendezvous(Rendezvous("127.0.0.1", port, 2, r), timeout=20),
                                (0, 1)))
    assert [r.status for r in results] == ["ok", "ok"], [r.evidence for r in results]
    assert "all 2 node(s) met" in results[0].evidence
    alone = check_rendezvous(Rendezvous("127.0.0.1", free_port(), 2, 1), timeout=2)  # nobody hosts it
    assert alone.status == "fail" and "node 1 of 2 at 127.0.0.1" in alone.evidence and "nc -zv" in alone.fix


@pytest.mark.torchrun
def test_real_fsdp_step_on_gloo_or_the_reason_this_torch_cannot():
    r = check_fsdp(gpus=0, nccl=False, timeout=120)
    if cpu_unsupported_reason():  # torch 2.6: FSDP2 is CUDA-only
        assert r.status == "skip" and "record_event" in r.evidence and "needs 2+ GPUs" in r.evidence
    else:
        assert r.status == "ok", r.evidence
        assert "2-process gloo FSDP2 step" in r.evidence and "relative gap" in r.evidence


@pytest.mark.skipif(cpu_unsupported_reason() is not None, reason=str(cpu_unsupported_reason()))
@pytest.mark.parametrize(("code", "says"), [
    ("print('2.0 1.0')", "the sharded gradients are wrong"),  # a norm that is not the unsharded one
    ("import sys; sys.exit(3)", "exit codes [3, 3]"),
    ("import time; time.sleep(60)", "hung: no result within 1.5 s"),
])
def test_fsdp_check_fails_on_wrong_crashed_or_hung_ranks(code, says):
    r = check_fsdp(gpus=0, nccl=False, timeout=1.5 if "sleep" in code else 30, code=code)
    assert r.status == "fail" and says in r.evidence + r.fix, r
