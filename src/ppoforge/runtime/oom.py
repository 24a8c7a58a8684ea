"""Out-of-memory in a micro-batch or a generation batch: halve it and go on, with the same math.

The trainers split work whose result does not depend on the split — accumulated micro-batches
(weighted by their token shares, `core/accumulation.py`) and generation (each row draws its own
pre-drawn uniforms) — so on an OOM they can redo the step in halves instead of dying. `retry_halving`
is that loop, the one the trainers call: `is_oom` recognises CUDA's `OutOfMemoryError` and the CPU
allocator's "can't allocate memory"; `halve` frees what the failed attempt held and returns the smaller
size, or raises a Fault when one row does not fit.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from typing import TypeVar

import torch

from ppoforge.errors import Fault
from ppoforge.runtime import allocator

T = TypeVar("T")


def is_oom(e: BaseException) -> bool:
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower())


def halve(size: int, what: str, e: BaseException) -> int:
    """The next size to try after an OOM at `size` (said once on stderr); Fault when `size` is 1."""
    if size <= 1:
        malloc = (", jemalloc preloaded or PPOFORGE_MALLOC_TUNING=0 (CPU: less peak memory, a little slower; "
                  "docs/rlhf.md)" if allocator.tuned() else "")
        raise Fault(f"out of memory with {what} 1 ({str(e).splitlines()[0][:120]}); allowed: a smaller model, "
                    f"shorter sequences{malloc} or a device with more memory")
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    smaller = size // 2
    print(f"ppoforge: out of memory at {what} {size}: continuing with {smaller} (the same math, more steps)",
          file=sys.stderr)
    return smaller


def retry_halving(attempt: Callable[[int], T], size: int, what: str, retry: bool = True) -> tuple[T, int]:
    """`attempt(size)`, and on an out-of-memory `attempt(size // 2)`, ... until it fits; (its result, the
    size that fit). `retry=False` (a sharded step, where a rank alone redoing it would break the
    lockstep): the OOM goes on unchanged."""
    while True:
        try:
            return attempt(size), size
        except Exception as e:
            if not is_oom(e) or not retry:
                raise
            size = halve(size, what, e)
