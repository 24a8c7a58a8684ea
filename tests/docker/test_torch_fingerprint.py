"""docker/torch_fingerprint.py names the installed torch and its CUDA stack by version and files."""

import subprocess
import sys
from importlib import metadata
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "docker" / "torch_fingerprint.py"


def test_fingerprint_lists_torch_and_only_its_binary_stack():
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert lines[0] == "torch distributions: 1"
    assert lines[1].startswith(f"torch {metadata.version('torch')} RECORD sha256:")
    names = [line.split()[0] for line in lines[1:]]
    assert all(n == "torch" or n.startswith("nvidia-") or n in ("triton", "pytorch-triton") for n in names)
    assert "filelock" not in names and "jinja2" not in names  # pure-Python requirements the lock may move
    # Deterministic: the Dockerfile compares two runs with diff.
    again = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, check=True).stdout
    assert again == out
