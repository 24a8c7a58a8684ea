"""Atomic checkpoints and exact RNG capture.

A checkpoint is written to a temporary file in the same directory, fsynced, then renamed over the
target and the directory fsynced (`rundir.atomic_write_bytes`): a crash or a full disk at any
moment leaves either the old file or the new one, never half of one; a full disk is reported as the
OSError it is (torch would say "unexpected pos"), so the run says "no space left". Everything inside is plain
tensors, numbers, strings, lists and dicts, so it loads with `torch.load(weights_only=True)` — the
default since torch 2.6 that broke many trainers' resume. `resume_from` loads one into a trainer (a
sharded FSDP2 directory too: `sharded_writer` writes those); what a trainer's checkpoint holds is
`runtime/runstate.py`'s.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from ppoforge.config import check_checkpoint_config
from ppoforge.errors import UserError
from ppoforge.runtime.rundir import atomic_write_bytes


class _Sink:
    """The temp file as torch.save sees it, keeping the OSError of a write that failed: torch's zip writer
    reports that as its own RuntimeError ("unexpected pos ...", "PytorchStreamWriter failed writing
    file"), which says nothing of the disk."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def save_checkpoint(path: Path, state: dict) -> None:
    """Write `state` to `path` atomically. A write the disk refused (full: ENOSPC) raises that OSError,
    naming `path` — errors.classify makes it "no space left writing PATH" — and the old file stays."""

    def write(f) -> None:
        sink = _Sink(f)
        try:
            torch.save(state, sink)
        except RuntimeError:
            if sink.error is None:
                raise
            raise sink.error from None

    try:
        atomic_write_bytes(path, write)
    except OSError as e:
        if e.filename is not None or e.errno is None:
            raise
        raise OSError(e.errno, e.strerror, str(path)) from None  # a write or flush names no file


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


def sharded_writer(path: Path, module, optimizer):
    """RunGuard's `write` for a sharded checkpoint directory at `path` (FSDP2, runtime/fsdp.py): every rank
    writes its shards of `module` and `optimizer`, rank 0 the rest of the state."""
    # FSDP2 and torch.distributed.checkpoint load for a sharded run only: CLI start-up imports this module
    from ppoforge.runtime.fsdp import save_sharded

    return lambda state: save_sharded(path, module, optimizer, state)


def resume_from(trainer, path: Path, sharded=None) -> None:
    """Load `path` into `trainer` (its `load(state)`), or a one-line UserError when the checkpoint does
    not fit the run (another model, layout or size than the config says: a run dir edited by hand), or
    was written under another config than `trainer.cfg` (`config.check_checkpoint_config`).
    `sharded`: the trainer's model, for a sharded checkpoint directory (`sharded_writer`) whatever world
    size wrote it; its weights and `trainer.optimizer` load there, the rest through `load`."""
    if sharded is not None:
        # FSDP2 and torch.distributed.checkpoint load for a sharded run only: CLI start-up imports this module
        from ppoforge.runtime.fsdp import load_sharded

        state = load_sharded(path, sharded, trainer.optimizer)
    else:
        state = load_checkpoint(path, map_location="cpu")
    check_checkpoint_config(trainer.cfg, state.get("config"), Path(path).parent / "config.yaml")
    try:
        trainer.load(state)
    except (KeyError, RuntimeError, ValueError, IndexError) as e:
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise UserError(f"resume: {path} does not fit this run's config ({type(e).__name__}: {first}); allowed: "
                        "the checkpoint of the run dir's own config.yaml") from None
    trainer.run_guard.saved_update = trainer.update
