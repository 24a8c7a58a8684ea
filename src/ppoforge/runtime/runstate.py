"""The run state every trainer checkpoints and goes back to, written once for control PPO, RLHF and the
supervised loop.

Besides its weights and its optimizer, an update changes the same few things in every trainer: the
update counter, the learning-rate scale (lowered by each rollback), the non-finite guard's counts, the
process RNGs and, where the trainer reads a dataset in order, its data cursor (control PPO has none: its
environments are its data). The trainers keep these as their own attributes (`Resumable`); this module
turns them into a checkpoint's entries and back (`step_state`, `load_step_state`), saves the trained
weights by name (`weights_state`, `load_weights`: a LoRA run keeps its adapters, not the base model; with
FSDP the sharded checkpoint holds them) and takes a run back to its last checkpoint (`rollback`).
What one trainer alone has stays in its own `state_dict`: control's policy RNG, environments and world
size; RLHF's KL controller, its torch Generator and the per-rank reseed on load.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import torch

from ppoforge.runtime import distributed
from ppoforge.runtime.checkpoint import rng_state, set_rng_state
from ppoforge.runtime.metrics import truncate_metrics
from ppoforge.runtime.resilience import FaultConfig, NonFiniteGuard


class Resumable(Protocol):
    """The trainer attributes the run state is made of (control, RLHF, supervised)."""

    cfg: FaultConfig        # rollback_lr_factor
    update: int             # completed updates
    lr_scale: float         # the learning rate's factor: 1, times rollback_lr_factor at each rollback
    guard: NonFiniteGuard   # its counts

    def resume(self) -> None: ...  # load the run dir's checkpoint (`checkpoint.resume_from`)


def step_state(trainer: Resumable) -> dict:
    """The entries every trainer's step state has: the process RNGs, the update counter, the guard's
    counts and the learning-rate scale (the trainer adds its cursor and its own generators)."""
    return {"rng": rng_state(), "update": trainer.update, "guard": trainer.guard.state_dict(),
            "lr_scale": trainer.lr_scale}


def load_step_state(trainer: Resumable, state: dict) -> None:
    """`step_state`'s entries back into `trainer` and the process RNGs."""
    set_rng_state(state["rng"])
    trainer.update = state["update"]
    trainer.guard.load_state_dict(state["guard"])
    trainer.lr_scale = state["lr_scale"]


def weights_state(named: Iterable[tuple[str, torch.nn.Parameter]], optimizer: torch.optim.Optimizer,
                  sharded: bool) -> dict:
    """The trained weights by name and the optimizer's state; nothing when the checkpoint is sharded
    (`checkpoint.sharded_writer` saves both itself)."""
    if sharded:
        return {}
    return {"trainable": {n: p.detach().clone() for n, p in named}, "optimizer": optimizer.state_dict()}


def load_weights(state: dict, named: Iterable[tuple[str, torch.nn.Parameter]],
                 optimizer: torch.optim.Optimizer) -> None:
    """`weights_state`'s entries back; a sharded checkpoint has none (`resume_from` loaded its weights)."""
    if "trainable" not in state:
        return
    with torch.no_grad():
        for name, p in named:
            p.copy_(state["trainable"][name])
    optimizer.load_state_dict(state["optimizer"])


def rollback(trainer: Resumable, logs: Iterable[Path], steps_per_update: int = 1) -> None:
    """The non-finite guard gave up on the current state: back to the last checkpoint, the guard's counts
    kept, the learning rate scaled by `rollback_lr_factor`; the lines of `logs` (step = update x
    `steps_per_update`) past the checkpoint dropped, since those updates run again."""
    counts, scale = dict(trainer.guard.counts), trainer.lr_scale * trainer.cfg.rollback_lr_factor
    distributed.barrier()  # rank 0's checkpoint is on disk
    trainer.resume()
    trainer.guard.counts.update(counts)
    trainer.lr_scale = scale
    if distributed.is_main():  # rank 0 alone writes the run dir
        for path in logs:
            truncate_metrics(path, trainer.update * steps_per_update)
