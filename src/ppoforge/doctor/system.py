"""Python, the torch build, and the CPU.

Each check reads its facts through a small `gather_*` function into a dataclass, so tests can hand
the check any machine they like. The CPU bf16 verdict comes from /proc/cpuinfo flags (AMX, AVX-512-BF16)
*and* a measured matmul rate: without those flags oneDNN emulates bf16 and it runs slower than fp32.
"""

from __future__ import annotations

import ctypes.util
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ppoforge.doctor.report import CheckResult, fail, ok, warn
from ppoforge.doctor.versions import TORCH_SAFE_LOAD, at_least
from ppoforge.runtime.device import CPU_BF16_FLAGS, read_cpuinfo


@dataclass
class TorchFacts:
    python: str
    torch: str
    cuda: str | None     # torch.version.cuda: the CUDA the wheel was built for
    hip: str | None      # torch.version.hip: set on ROCm wheels
    cudnn: int | None
    cxx11_abi: bool


def gather_torch() -> TorchFacts:
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return TorchFacts(platform.python_version(), torch.__version__, torch.version.cuda, torch.version.hip,
                      cudnn, bool(torch._C._GLIBCXX_USE_CXX11_ABI))


def wheel_flavour(cuda: str | None, hip: str | None) -> str:
    if hip:
        return f"ROCm {hip}"
    return f"CUDA {cuda}" if cuda else "CPU-only"


def check_python_torch(f: TorchFacts) -> CheckResult:
    name = "python_torch"
    evidence = (f"Python {f.python}; torch {f.torch} ({wheel_flavour(f.cuda, f.hip)} wheel), "
                f"torch.version.cuda {f.cuda or '-'}, cuDNN {f.cudnn or '-'}, C++11 ABI {int(f.cxx11_abi)}")
    if not at_least(f.python, "3.10"):
        return fail(name, evidence + "; ppoforge needs Python >= 3.10", "use Python 3.10+ (uv venv -p 3.12)")
    if not at_least(f.torch, TORCH_SAFE_LOAD):
        return warn(name, evidence + f"; torch < {TORCH_SAFE_LOAD}: transformers refuses to load .bin "
                    "weights and torch.load is not weights_only by default",
                    f"pip install 'torch>={TORCH_SAFE_LOAD}' (same index URL as your current wheel)")
    return ok(name, evidence)


# ---- CPU ------------------------------------------------------------------------------------------


@dataclass
class CpuFacts:
    cores: int                 # logical CPUs this process may run on
    online: int                # logical CPUs in the machine
    model: str
    flags: set[str]
    fp32_gflops: float | None  # measured; None when skipped (--quick)
    bf16_gflops: float | None
    quota: float | None = None  # CPUs allowed by the cgroup (docker run --cpus), None when unlimited
    allocator: str = "glibc"   # the malloc in use: jemalloc / tcmalloc when preloaded
    jemalloc: str | None = None  # a jemalloc this system has (to preload), when not in use


def malloc_in_use(maps: str = "/proc/self/maps") -> str:
    """jemalloc or tcmalloc when one is mapped into this process (LD_PRELOAD), else glibc."""
    try:
        text = Path(maps).read_text()
    except OSError:
        return "glibc"
    return next((name for name in ("jemalloc", "tcmalloc") if f"lib{name}" in text), "glibc")


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup") -> float | None:
    """`docker run --cpus N` as N, from cgroup v2 cpu.max or v1 cfs quota/period; None when unlimited."""
    try:
        quota, period = Path(root, "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota = Path(root, "cpu", "cpu.cfs_quota_us").read_text().strip()
            period = Path(root, "cpu", "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    if quota in ("max", "-1"):
        return None
    return int(quota) / int(period)


def matmul_gflops(dtype: torch.dtype, n: int = 512, seconds: float = 0.15) -> float:
    """GFLOP/s of an n x n matmul on one thread, from the fastest of repeated runs.

    One thread and best-of-N: on a busy machine a multi-threaded matmul waits at OpenMP barriers for
    preempted threads and its rate says more about the neighbours than about the CPU.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        a @ b  # warm-up: oneDNN picks its kernel on the first call
        best, start = float("inf"), time.perf_counter()
        while time.perf_counter() - start < seconds:
            tick = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - tick)
    finally:
        torch.set_num_threads(threads)
    return 2 * n**3 / best / 1e9


def gather_cpu(measure: bool) -> CpuFacts:
    model, flags = read_cpuinfo()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    fp32 = matmul_gflops(torch.float32) if measure else None
    bf16 = matmul_gflops(torch.bfloat16) if measure else None
    allocator = malloc_in_use()
    jemalloc = None if allocator == "jemalloc" else ctypes.util.find_library("jemalloc")
    return CpuFacts(cores, os.cpu_count() or cores, model, flags, fp32, bf16, cgroup_cpu_quota(), allocator, jemalloc)


def check_cpu(f: CpuFacts, precision: str, device: str) -> CheckResult:
    name = "cpu"
    fast = sorted(set(CPU_BF16_FLAGS) & f.flags)
    usable = min(f.cores, f.quota) if f.quota else f.cores
    quota = f" (cgroup quota {f.quota:g})" if f.quota else ""
    evidence = (f"{f.model}; {usable:g} usable of {f.online} logical CPUs{quota}; bf16 fast path: "
                f"{', '.join(fast) if fast else 'none (no amx_bf16 / avx512_bf16 flag)'}")
    if f.fp32_gflops is not None and f.bf16_gflops is not None:
        evidence += (f"; 512x512 matmul on one thread: fp32 {f.fp32_gflops:.0f} GFLOP/s, "
                     f"bf16 {f.bf16_gflops:.0f} GFLOP/s ({f.bf16_gflops / f.fp32_gflops:.1f}x)")
    evidence += f"; malloc: {f.allocator}"
    if f.allocator == "glibc":  # docs/rlhf.md: jemalloc takes 30-40 % off the peak RSS of training on CPU
        evidence += (f" (where memory binds, preload jemalloc: LD_PRELOAD={f.jemalloc})" if f.jemalloc else
                     " (where memory binds: install libjemalloc2 and preload it, docs/rlhf.md)")
    bf16_slow = not fast or (f.bf16_gflops is not None and f.bf16_gflops < f.fp32_gflops)
    if precision == "bf16" and device == "cpu" and bf16_slow:
        return warn(name, evidence + "; bf16 on this CPU is emulated and slower than fp32",
                    "--precision fp32 on this CPU")
    if usable < 2:
        return warn(name, evidence + "; one CPU: env stepping and training share it",
                    "give the container more CPUs (docker run --cpus 4)")
    return ok(name, evidence)
