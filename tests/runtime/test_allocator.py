"""The glibc malloc tuning: freed large blocks are reused instead of faulted in again."""

import resource
import subprocess
import sys

import pytest

SCRIPT = """
import resource, sys
import torch
if sys.argv[1] == "tuned":
    from ppoforge.runtime.allocator import keep_freed_memory
    assert keep_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(24):  # allocate, touch and free the same 64 MB block, as every training step does
    before = faults()
    torch.zeros(16 << 20).sum()
    print(faults() - before)
"""


def _faults(mode: str) -> list[int]:
    """Page faults of each of 24 rounds that allocate, touch and free one 64 MB block."""
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
    return [int(line) for line in out.stdout.split()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning is Linux-only")
def test_tuned_malloc_reuses_freed_blocks_instead_of_faulting_them_in():
    block = (64 << 20) // resource.getpagesize()  # pages in one block
    default, tuned = _faults("default"), _faults("tuned")
    # untuned, every round's block is a fresh mmap, faulted in page by page
    assert all(n > 0.9 * block for n in default[-8:])
    # tuned, glibc's bins take a few rounds to settle (posix_memalign's padding; 4 to 10 rounds seen,
    # it varies by machine), then the freed block is reused with (next to) no faults at all
    assert all(n < 0.01 * block for n in tuned[-8:]), tuned


def test_opt_out(monkeypatch):
    from ppoforge.runtime import allocator

    monkeypatch.setattr(allocator, "_applied", None)
    monkeypatch.setenv("PPOFORGE_MALLOC_TUNING", "0")
    assert allocator.keep_freed_memory() is False
