"""Atomic checkpoints and exact RNG capture.

A checkpoint is written to a temporary file in the same directory, fsynced, then renamed over the
target and the directory fsynced: a crash at any moment leaves either the old file or the new one,
never half of one. Everything inside is plain tensors, numbers, strings, lists and dicts, so it loads
with `torch.load(weights_only=True)` — the default since torch 2.6 that broke many trainers' resume.
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path

import numpy as np
import torch

from ppoforge.errors import UserError


def atomic_write_bytes(path: Path, write) -> None:
    """Call `write(fileobj)` on a temp file beside `path`, then atomically move it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save_checkpoint(path: Path, state: dict) -> None:
    atomic_write_bytes(path, lambda f: torch.save(state, f))


def load_checkpoint(path: Path, map_location="cpu") -> dict:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"resume: no checkpoint at {path}")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same user-facing problem
        raise UserError(f"resume: {path} is not a readable ppoforge checkpoint ({type(e).__name__})") from None


def rng_state() -> dict:
    """Python, numpy-global and torch RNG states as weights_only-safe values."""
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state()
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy(), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
