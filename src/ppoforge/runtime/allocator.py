"""Keep freed CPU memory in the process for reuse (glibc malloc), so training steps stop page-faulting.

glibc hands out large blocks as fresh mmap pages and returns freed memory to the OS past its trim
threshold. A PPO step allocates and frees the same large tensors every micro-batch — bf16 casts of
the weights, fp32 gradients, a (vocab, hidden) dense embedding gradient — so each one is faulted in
page by page again, every time. On the `smollm2` benchmark in the full layout that was ~1.3 s of a
~7 s PPO update (a 3.5 MB gradient cast took 2.7 ms instead of ~0.3 ms; zero-filling the 113 MB
embedding gradient 140 ms). Raising the mmap and trim thresholds keeps those pages mapped and reused,
without a preload. The price is memory: the process keeps its peak heap until it exits, and freed
blocks too small or too scattered for the next tensor stay resident, so the peak RSS grows — on a
512-token GRPO step at SmolLM2's size, 14.9 GiB against 13.0 without the tuning, which was 15 % slower
(87.5 against 101.0 s). Where memory binds, jemalloc preloaded does better than either (8.9 GiB,
~97 s: its size classes do not fragment; docs/rlhf.md); under it this tuning does nothing (it is
glibc's). `PPOFORGE_MALLOC_TUNING=0` leaves malloc alone; other C libraries (musl, macOS) are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters, from glibc's malloc.h
MMAP_THRESHOLD = 1 << 30  # blocks below 1 GiB come from the heap (and stay there when freed)
TRIM_THRESHOLD = 2**31 - 1  # (mallopt takes an int) in effect: never give the top of the heap back

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Tune glibc malloc once per process; True when the tuning is in effect."""
    global _applied
    if _applied is None:
        _applied = _tune()
    return _applied


def tuned() -> bool:
    """Is the tuning in effect in this process (without applying it)?"""
    return bool(_applied)


def _tune() -> bool:
    if os.environ.get("PPOFORGE_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - glibc only: musl's mallopt is a no-op
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
