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
before = faults()
for _ in range(16):  # allocate, touch and free the same 64 MB block, as every training step does
    torch.zeros(16 << 20).sum()
print(faults() - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning is Linux-only")
def test_tuned_malloc_reuses_freed_blocks_instead_of_faulting_them_in():
    block = (64 << 20) // resource.getpagesize()  # pages in one block
    default, tuned = _faults("default"), _faults("tuned")
    assert default > 15 * block  # every one of the 16 blocks is a fresh mmap, faulted in page by page
    # measured 4-6 blocks' worth: glibc's bins take a few rounds to settle (posix_memalign's padding),
    # then the freed block is reused with no faults at all
    assert tuned < 10 * block


def test_opt_out(monkeypatch):
    from ppoforge.runtime import allocator

    monkeypatch.setattr(allocator, "_applied", None)
    monkeypatch.setenv("PPOFORGE_MALLOC_TUNING", "0")
    assert allocator.keep_freed_memory() is False
