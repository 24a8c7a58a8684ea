"""Distributed: backends, a real N-process all-reduce under a timeout, a multi-node rendezvous, /dev/shm
and the memlock limit.

The all-reduce runs in fresh interpreters (not fork: CUDA and fork do not mix): one per visible GPU
over NCCL when two or more are visible (what `torchrun --nproc_per_node <GPUs>` will do), else two over
gloo. The rendezvous check (only when MASTER_ADDR or --rdzv-endpoint names one) meets the other nodes'
doctors at HOST:PORT through torch's TCPStore — the store torchrun's c10d rendezvous uses — so a wrong
address, a closed port or a node that never arrives is a `fail` before a training job waits on it.
A hang is the classic NCCL failure — no error, just a stuck collective — so the parent kills every
rank at the deadline and turns the hang into a `fail` with the usual fixes.
"""

from __future__ import annotations

import copy
import os
import resource
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ppoforge.doctor.report import CheckResult, fail, ok, skip, warn

GIB = 2**30
WORKER = "from ppoforge.doctor.distributed import allreduce_worker; allreduce_worker()"
NCCL_FIXES = ("NCCL_P2P_DISABLE=1 (PCIe peer-to-peer broken, e.g. by an IOMMU or a VM); "
              "NCCL_SOCKET_IFNAME=<interface> (e.g. eth0; the default pick can be a dead bridge); "
              "NCCL_IB_DISABLE=1 without InfiniBand; docker run --ipc=host; rerun with NCCL_DEBUG=INFO")
GLOO_FIXES = ("GLOO_SOCKET_IFNAME=lo (or your real interface); make sure the hostname resolves "
              "(getent hosts $(hostname)) and 127.0.0.1 is not firewalled; docker run --ipc=host")


@dataclass
class DistFacts:
    gloo: bool
    nccl: bool
    nccl_version: str | None
    gpus: int


def gather_dist(gpus: int) -> DistFacts:
    nccl = dist.is_available() and dist.is_nccl_available()
    version = ".".join(map(str, torch.cuda.nccl.version())) if nccl else None
    return DistFacts(dist.is_available() and dist.is_gloo_available(), nccl, version, gpus)


def check_dist_backends(f: DistFacts) -> CheckResult:
    name = "dist_backends"
    evidence = f"gloo {'yes' if f.gloo else 'no'}, NCCL {f.nccl_version or 'no'}; {f.gpus} GPU(s) visible"
    if not f.gloo:
        return fail(name, evidence, "install an official torch wheel (gloo ships with it)")
    if f.gpus >= 2 and not f.nccl:
        return fail(name, evidence + "; two GPUs but no NCCL",
                    "install a CUDA torch wheel (NCCL ships with it) from https://download.pytorch.org/whl/")
    return ok(name, evidence)


def allreduce_worker() -> None:
    """One rank: init, all-reduce [rank + 1] * 4 over WORLD_SIZE ranks, print the sum (2 ranks: 12.0)."""
    backend, rank = os.environ["PPOFORGE_DOCTOR_BACKEND"], int(os.environ["RANK"])
    timeout = timedelta(seconds=float(os.environ["PPOFORGE_DOCTOR_TIMEOUT"]))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timeout, device_id=device if backend == "nccl" else None)
    x = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(x)
    print(x.sum().item(), flush=True)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(backend: str, timeout: float, code: str, nproc: int) -> tuple[list, list[tuple[str, str]]] | None:
    """Start `code` as `nproc` ranks; (processes, their (stdout, stderr)), or None when they hung (every
    rank is killed at the deadline)."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(nproc),
           "PPOFORGE_DOCTOR_BACKEND": backend, "PPOFORGE_DOCTOR_TIMEOUT": str(timeout),
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", code], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(nproc)]
    deadline, outputs = time.monotonic() + timeout, []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=max(deadline - time.monotonic(), 0.1)))
    except subprocess.TimeoutExpired:
        return None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return procs, outputs


def _hung(timeout: float, nproc: int) -> str:
    return f"hung: no result within {timeout:g} s, {'both' if nproc == 2 else 'all'} ranks killed"


def _errors(procs, outputs, seen: str = "") -> str:
    """The ranks' exit codes, what they printed (`seen`) and the first rank's last line of stderr."""
    errors = [err.strip().splitlines()[-1] for (_, err) in outputs if err.strip()]
    return f"exit codes {[p.returncode for p in procs]}{seen}" + (f"; {errors[0][:200]}" if errors else "")


def run_allreduce(backend: str, timeout: float, code: str = WORKER, nproc: int = 2) -> tuple[bool, str]:
    """(succeeded, what happened). Every rank is killed at the deadline."""
    ran = _run_ranks(backend, timeout, code, nproc)
    if ran is None:
        return False, _hung(timeout, nproc)
    procs, outputs = ran
    results = [out.strip().splitlines()[-1] if out.strip() else "" for out, _ in outputs]
    expected = str(4.0 * nproc * (nproc + 1) / 2)
    if all(p.returncode == 0 for p in procs) and results == [expected] * nproc:
        who = "both ranks" if nproc == 2 else f"all {nproc} ranks"
        return True, f"{who} got {expected} (= 4 x ({' + '.join(str(r + 1) for r in range(nproc))}))"
    return False, _errors(procs, outputs, f", results {results}")


def check_allreduce(gpus: int, nccl: bool, timeout: float = 30.0, code: str = WORKER) -> CheckResult:
    """The all-reduce `torchrun --nproc_per_node <GPUs>` will need: one process per GPU over NCCL, else
    two over gloo (CPU training)."""
    name = "allreduce"
    backend = "nccl" if gpus >= 2 and nccl else "gloo"
    nproc = gpus if backend == "nccl" else 2
    start = time.perf_counter()
    passed, what = run_allreduce(backend, timeout, code, nproc)
    evidence = f"{nproc}-process {backend} all-reduce: {what} ({time.perf_counter() - start:.1f} s)"
    if passed:
        return ok(name, evidence)
    return fail(name, evidence, NCCL_FIXES if backend == "nccl" else GLOO_FIXES)


# ---- FSDP2 -------------------------------------------------------------------------------------------
FSDP_WORKER = "from ppoforge.doctor.distributed import fsdp_worker; fsdp_worker()"
FSDP_TOLERANCE = 1e-4  # relative, on the gradient norm (fp32; float summation order differs)


def fsdp_worker() -> None:
    """One rank: a 2-layer Llama sharded with `shard_model` (fully_shard per layer + root), a forward and
    backward of this rank's rows of a fixed batch, the whole model's gradient norm; and the same on an
    unsharded copy over every row. Prints both norms."""
    from transformers import LlamaConfig, LlamaForCausalLM  # optional extra (ppoforge[lm])

    # start-up: runtime/fsdp imports torch.distributed.checkpoint (over a second), which `--quick` never needs
    from ppoforge.runtime.fsdp import shard_model

    backend, rank = os.environ["PPOFORGE_DOCTOR_BACKEND"], int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=float(os.environ["PPOFORGE_DOCTOR_TIMEOUT"])))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).to(device)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2 * world, 8), generator=torch.Generator().manual_seed(1)).to(device)
    reference(input_ids=ids, labels=ids).loss.backward()
    want = torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf"))
    shard_model(model, "fp32")
    mine = ids[2 * rank:2 * rank + 2]  # equal rows per rank: FSDP's gradient average is the global mean's
    model(input_ids=mine, labels=mine).loss.backward()
    got = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).full_tensor()
    print(f"{float(got):.9g} {float(want):.9g}", flush=True)
    dist.destroy_process_group()


def check_fsdp(gpus: int, nccl: bool, timeout: float = 60.0, code: str = FSDP_WORKER) -> CheckResult:
    """Can `fsdp: true` run here: a real FSDP2 forward and backward over the ranks `torchrun` will use
    (one per GPU over NCCL, else two CPU processes over gloo), checked against one unsharded process."""
    from ppoforge.runtime.fsdp import cpu_unsupported_reason  # start-up: as in `fsdp_worker` (a slow check)

    name = "fsdp"
    backend = "nccl" if gpus >= 2 and nccl else "gloo"
    nproc = gpus if backend == "nccl" else 2
    if backend == "gloo" and (reason := cpu_unsupported_reason()):
        return skip(name, f"{reason}; `fsdp: true` needs 2+ GPUs here (on CPU it runs with a newer torch)")
    start = time.perf_counter()
    ran = _run_ranks(backend, timeout, code, nproc)
    took = f"({time.perf_counter() - start:.1f} s)"
    fixes = NCCL_FIXES if backend == "nccl" else GLOO_FIXES
    if ran is None:
        return fail(name, f"{nproc}-process {backend} FSDP2 step: {_hung(timeout, nproc)} {took}", fixes)
    procs, outputs = ran
    try:
        norms = [tuple(map(float, out.strip().splitlines()[-1].split())) for out, _ in outputs]
    except (ValueError, IndexError):
        norms = []
    if any(p.returncode for p in procs) or len(norms) != nproc:
        return fail(name, f"{nproc}-process {backend} FSDP2 step: {_errors(procs, outputs)} {took}", fixes)
    gap = max(abs(got - want) / max(abs(want), 1e-12) for got, want in norms)
    evidence = (f"{nproc}-process {backend} FSDP2 step of a 2-layer Llama: gradient norm {norms[0][0]:.6g}, one "
                f"unsharded process {norms[0][1]:.6g} (relative gap {gap:.1e}) {took}")
    if gap > FSDP_TOLERANCE:
        return fail(name, evidence, "the sharded gradients are wrong: report it with `ppoforge doctor --json` "
                                    "and the torch version; train with fsdp: false meanwhile")
    return ok(name, evidence)


# ---- multi-node rendezvous -------------------------------------------------------------------------
RDZV_FIXES = ("the same HOST:PORT on every node (torchrun --rdzv-endpoint, or MASTER_ADDR / MASTER_PORT); HOST "
              "must resolve and PORT be open from every node (nc -zv HOST PORT; a firewall or a security group "
              "may block it); run the doctor on all nodes at once with --nnodes N and each --node-rank; set "
              "NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME to the interface that reaches HOST")


@dataclass(frozen=True)
class Rendezvous:
    host: str
    port: int
    nnodes: int
    node_rank: int


def rendezvous_target(endpoint: str | None, nnodes: int | None, node_rank: int | None,
                      env: dict) -> Rendezvous | None:
    """What to meet at: --rdzv-endpoint, else MASTER_ADDR[:MASTER_PORT] (29500, torchrun's default);
    node count and rank from the options, else NNODES / NODE_RANK, else Slurm's; None without an address."""
    if endpoint is None and env.get("MASTER_ADDR"):
        endpoint = f"{env['MASTER_ADDR']}:{env.get('MASTER_PORT', '29500')}"
    if not endpoint:
        return None
    host, _, port = endpoint.rpartition(":") if ":" in endpoint else (endpoint, "", "29400")
    nnodes = nnodes or int(env.get("NNODES") or env.get("SLURM_NNODES") or 1)
    node_rank = node_rank if node_rank is not None else int(env.get("NODE_RANK") or env.get("SLURM_NODEID") or 0)
    return Rendezvous(host, int(port), nnodes, node_rank)


def run_rendezvous(target: Rendezvous, timeout: float) -> tuple[bool, str]:
    """(met, what happened): node 0 hosts a TCPStore at HOST:PORT, every node checks in, and each waits
    until all `nnodes` have (node 0 also until every node has seen that, so it never leaves first)."""
    start = time.monotonic()
    try:
        store = dist.TCPStore(target.host, target.port, target.nnodes, is_master=target.node_rank == 0,
                         timeout=timedelta(seconds=timeout), wait_for_workers=False)
        for key in ("ppoforge_doctor/arrived", "ppoforge_doctor/seen"):
            store.add(key, 1)
            while target.node_rank == 0 or key.endswith("arrived"):  # node 0 hosts: it waits for both counts
                if (n := store.add(key, 0)) >= target.nnodes:
                    break
                if time.monotonic() - start > timeout:
                    return False, f"{n} of {target.nnodes} nodes arrived within {timeout:g} s"
                time.sleep(0.1)
    except Exception as e:  # noqa: BLE001 - any failure to meet is the same finding
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        return False, f"{type(e).__name__}: {first}"
    return True, f"all {target.nnodes} node(s) met ({time.monotonic() - start:.1f} s)"


def check_rendezvous(target: Rendezvous | None, timeout: float = 60.0) -> CheckResult:
    name = "rendezvous"
    if target is None:
        return skip(name, "no MASTER_ADDR or --rdzv-endpoint: a single-node run needs no rendezvous")
    where = f"node {target.node_rank} of {target.nnodes} at {target.host}:{target.port}"
    passed, what = run_rendezvous(target, timeout)
    if passed:
        return ok(name, f"{where}: {what}")
    return fail(name, f"{where}: {what}", RDZV_FIXES)


# ---- shared memory and pinned memory --------------------------------------------------------------
def shm_bytes(path: str = "/dev/shm") -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_frsize * st.f_blocks


def check_shm(size: int | None, container: bool) -> CheckResult:
    """DataLoader workers and NCCL's intra-node transport live in /dev/shm; Docker's default is 64 MiB."""
    name = "shm"
    fix = ("docker run --ipc=host (or --shm-size=8g)" if container
           else "sudo mount -o remount,size=8G /dev/shm")
    if size is None:
        return warn(name, "no /dev/shm", fix)
    evidence = f"/dev/shm {size / GIB:.2f} GiB" + (" (in a container)" if container else "")
    if size < GIB:
        return warn(name, evidence + "; < 1 GiB: NCCL and DataLoader workers fail with bus errors", fix)
    return ok(name, evidence)


def memlock_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]


def check_memlock(limit: int, gpus: int) -> CheckResult:
    """ulimit -l: NCCL over InfiniBand / GPUDirect pins memory and fails under a small limit."""
    name = "memlock"
    if limit == resource.RLIM_INFINITY:
        return ok(name, "ulimit -l unlimited")
    evidence = f"ulimit -l {limit // 1024} KiB"
    if gpus >= 2:
        return warn(name, evidence + "; NCCL over InfiniBand / GPUDirect needs to pin more",
                    "docker run --ulimit memlock=-1 (or ulimit -l unlimited; /etc/security/limits.conf)")
    return ok(name, evidence + " (matters only for multi-GPU NCCL over InfiniBand)")
