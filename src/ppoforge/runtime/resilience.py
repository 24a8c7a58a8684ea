"""What every trainer shares so that a failing run loses nothing and a sick one does not train silently.

- `FaultConfig`: the fields every trainer config inherits (non-finite guard, call time limits).
- `RunGuard.update()`: a context around one update. It keeps a resume point taken at the update's
  start; when anything raises inside the update, it writes a checkpoint of the last completed update
  before the exception leaves, so `--resume` continues from there. A full in-memory copy of the state
  is kept when it is small (LoRA adapters, control nets: well under `SNAPSHOT_LIMIT`); for a large
  state only its step state is kept (what one update changes besides the weights and the optimizer:
  RNGs, data cursor, counters; `runtime/runstate.py`), which is enough while the update has not yet
  stepped the optimizer (sampling, rewards, environments: where user code fails). A failure after that
  keeps the last periodic checkpoint, and the message says which update it holds.
- `Trainer`: what `RunGuard` and `train_loop` drive (control PPO, RLHF, the supervised loop).
- `NonFiniteGuard`: an optimizer step whose loss or gradient norm is not finite is skipped (and an
  update whose rewards are not all finite is skipped whole), counted in `guard/*` metrics; after
  `nonfinite_patience` bad ones in a row the run stops with one line, or with `nonfinite_action:
  rollback` reloads the last checkpoint, scales the learning rate by `rollback_lr_factor` and goes on —
  at most `max_rollbacks` times in a run (`train_loop` counts them, one line each): a cause that a lower
  learning rate does not remove (a reward that is always NaN) would otherwise roll back forever.
- `CollapseGuard`: a run whose numbers are finite but whose policy degenerates (entropy blown up,
  completions pinned at the token budget, the reward fallen to a flat floor) for `collapse_patience`
  updates in a row is stopped — or rolled back — the same way, with one line naming the signs.
"""

from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from ppoforge.config import Validated, param
from ppoforge.errors import Fault
from ppoforge.runtime import distributed
from ppoforge.runtime.checkpoint import save_checkpoint
from ppoforge.runtime.signals import StopFlag
from ppoforge.runtime.timeouts import StopRequested

SNAPSHOT_LIMIT = 512 * 2**20  # bytes of state copied in memory at every update's start


@dataclass
class FaultConfig(Validated):
    """Fields shared by every trainer's config (declared once here); checked on construction (`Validated`)."""

    nonfinite_patience: int = param(3, "optimizer steps in a row with a non-finite loss or gradient norm (or "
                                    "updates with a non-finite reward) that the guard skips before it acts",
                                    lo=1, hi=10_000, resume=True)
    nonfinite_action: str = param("stop", "then: stop (keep the last checkpoint, one line, exit 1) or rollback "
                                  "(reload the last checkpoint, scale the learning rate, go on)",
                                  choices=("stop", "rollback"), resume=True)
    rollback_lr_factor: float = param(0.5, "rollback: multiply the learning rate by this", gt=0, hi=1.0,
                                      resume=True)
    max_rollbacks: int = param(5, "rollbacks (nonfinite_action or collapse_action: rollback) a run may make; the "
                               "next time the guard acts the run stops (the last checkpoint kept, one line, exit 1)",
                               lo=0, hi=1000, resume=True)
    call_timeout: float = param(600.0, "seconds one call into user code (a reward function, an environment "
                                "step) may take; then the run checkpoints and stops (exit 1)", gt=0, hi=1e6,
                                resume=True)
    dist_timeout: float = param(600.0, "under torchrun: seconds a collective waits for the other ranks (one that "
                                "hung or died); then every rank stops with one line naming the cause (exit 1)",
                                gt=0, hi=1e6, resume=True)


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


def nbytes(value) -> int:
    """Bytes of the tensors inside a nested state (dicts, lists, tuples)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v) for v in value)
    return 0


class Rollback(Exception):
    """Raised by a guard when `nonfinite_action` (or `collapse_action`) is rollback: reload the last checkpoint."""


class NonFiniteGuard:
    def __init__(self, patience: int, action: str):
        self.patience, self.action = patience, action
        self.streak = 0
        self.counts = {"guard/skipped_steps": 0, "guard/skipped_updates": 0, "guard/nonfinite_rewards": 0,
                       "guard/rewards_clipped": 0, "guard/rollbacks": 0}

    def _bad(self, what: str) -> None:
        self.streak += 1
        if self.streak < self.patience:
            return
        self.streak = 0
        what = f"{what}, {self.patience} times in a row (nonfinite_patience)"
        if self.action == "rollback":
            raise Rollback(what)  # counted in guard/rollbacks by train_loop, which rolls back
        raise Fault(f"{what}: stopped; allowed: a smaller learning rate, a finite reward, or nonfinite_action: "
                    "rollback")

    def step_ok(self, loss: torch.Tensor | float, grad_norm: torch.Tensor | float, scaled: bool = False) -> bool:
        """May the optimizer step? Not when the loss, or (unless a GradScaler handles it) the gradient
        norm, is NaN or infinite. One host sync for both numbers."""
        if isinstance(loss, torch.Tensor) or isinstance(grad_norm, torch.Tensor):
            # cpu: the one host sync of both numbers
            both = torch.stack([torch.as_tensor(x, dtype=torch.float32).reshape(()).cpu() for x in (loss, grad_norm)])
            loss, grad_norm = both.tolist()
        if math.isfinite(loss) and (scaled or math.isfinite(grad_norm)):
            self.streak = 0
            return True
        self.counts["guard/skipped_steps"] += 1
        self._bad(f"non-finite {'loss' if not math.isfinite(loss) else 'gradient norm'}")
        return False

    def rewards_ok(self, rewards: torch.Tensor, clip: float | None) -> tuple[bool, torch.Tensor]:
        """(train on this batch?, rewards clipped to +-clip). Any non-finite reward skips the update."""
        bad = ~torch.isfinite(rewards)
        if bad.any():
            self.counts["guard/nonfinite_rewards"] += int(bad.sum())
            self.counts["guard/skipped_updates"] += 1
            self._bad(f"non-finite rewards ({int(bad.sum())} of {rewards.numel()})")
            return False, rewards
        if clip is not None:
            self.counts["guard/rewards_clipped"] += int((rewards.abs() > clip).sum())
            rewards = rewards.clamp(-clip, clip)
        return True, rewards

    def state_dict(self) -> dict:
        return {"counts": dict(self.counts)}

    def load_state_dict(self, state: dict) -> None:
        self.counts.update(state.get("counts", {}))


class Trainer(Protocol):
    """What `RunGuard` and `train_loop` drive: control PPO, RLHF and the supervised loop."""

    cfg: FaultConfig        # max_rollbacks
    update: int             # completed updates
    optimizing: bool        # has the current update stepped the optimizer? (RunGuard resets it at each update)
    lr_scale: float         # the learning rate's factor, lowered by each rollback
    guard: NonFiniteGuard   # its counts: guard/rollbacks

    def state_dict(self) -> dict: ...  # all a checkpoint holds

    def step_state(self) -> dict: ...  # what one update changes besides the weights and the optimizer

    def train_one_update(self): ...  # one update; what it returns goes to train_loop's `after_update`

    def rollback(self) -> None: ...  # back to the last checkpoint when the non-finite guard gives up


class CollapseGuard:
    """Names an RL run that degenerates instead of learning, from three signs measured on each rollout
    against the run's first update (its baseline, kept in the checkpoint):

    - entropy: the sampled tokens' mean -log p (nats per token) above `ENTROPY_RATIO` x the first's;
    - budget: at least `BUDGET_SHARE` of the completions end at max_new_tokens without EOS, where at the
      first update fewer than half did (a policy that never learned EOS is not collapsing), and the mean
      score is below the best the run has reached (a reward that pays for length, maximized, is not either);
    - reward: every score of the rollout equal (no learning signal left), below the best mean the run
      has reached by at least `REWARD_FALL` of the range of scores it has seen (it fell there from real
      progress: a constant reward never trips it, nor a sparse one whose few successes made that best),
      and for so many prompts in a row that chance cannot explain it: with p the share of the run's earlier
      prompts (the last `HISTORY`, flat rollouts included) whose best score was above this flat score,
      (1 - p) ** prompts <= `REWARD_CHANCE`. Prompts, not completions, are counted: a confident policy
      answers a prompt's G completions alike, so a rollout of 4 prompts x 8 at p = 0.35 is all wrong once
      in 6 rollouts, not once in 10^6 (measured: a healthy fp32 GRPO run, two-digit arithmetic, 6 such
      rollouts in 42). p is a rate of prompts, not the mean score scaled to its range: a sparse reward (a
      few small scores, most 0: VADER on a tiny model's text) has a mean near its floor while 1 prompt in
      8 scores above it, and a flat rollout there is common, not a sign (issue 37).
    - one way: with groups (GRPO's G completions of a prompt), every group's scores equal while the prompts'
      differ (right on some, wrong on others) — the policy answers each prompt one way and no group has a
      signal left; for so many groups in a row that chance cannot explain it: (1 - q) ** groups <=
      `REWARD_CHANCE`, with q the share of the run's earlier groups (the last `HISTORY`) whose scores split
      (issue 36: a true/false task, both TRL and ppoforge, the sampled entropy ~0 and nothing learned after).

    An update with any sign adds to a streak, one without resets it; at `patience` (0: off) the run
    stops (`Fault`, one line: the signs and what to change) or rolls back (`Rollback`)."""

    ENTROPY_RATIO = 2.0
    BUDGET_SHARE = 0.9
    REWARD_FALL = 0.25
    REWARD_CHANCE = 1e-3
    HISTORY = 4096  # prompts' best scores kept for the chance test

    def __init__(self, patience: int, action: str):
        self.patience, self.action = patience, action
        self.first: dict | None = None
        self.best_reward, self.low, self.high, self.streak = -math.inf, math.inf, -math.inf, 0
        self.bests: list[float] = []  # each earlier prompt's best score, before the current flat streak
        self.streak_bests: list[float] = []  # the current streak of flat rollouts' prompts
        self.flat_prompts = 0
        self.splits: list[bool] = []  # did each earlier group's scores differ? (with groups, `worsts` given)
        self.one_way_groups = 0  # groups in the current streak of rollouts whose every group is flat

    def signs(self, entropy: float, clipped: float, reward: float, low: float, high: float,
              bests: list[float] | None = None, worsts: list[float] | None = None) -> list[str]:
        """The signs of this rollout: its token entropy, share of completions at the budget, mean score,
        lowest and highest score, and each prompt's best score (its independent groups of scores; None: one
        group, whose best is `high`) and, where a prompt has several completions, each prompt's worst."""
        bests = [high] if bests is None else list(bests)
        first = self.first = self.first or {"entropy": entropy, "clipped": clipped}
        out = []
        if entropy > self.ENTROPY_RATIO * first["entropy"] > 0:
            out.append(f"entropy {entropy:.2f} nats/token, {entropy / first['entropy']:.1f}x update 1's")
        if clipped >= self.BUDGET_SHARE and first["clipped"] < 0.5 and reward < self.best_reward:
            out.append(f"{clipped:.0%} of completions hit max_new_tokens (update 1: {first['clipped']:.0%})")
        self.low, self.high = min(self.low, low), max(self.high, high)
        out += self._flat_reward(reward, low, high, bests)
        if worsts is not None:
            out += self._one_way(low, high, [b != w for b, w in zip(bests, worsts, strict=True)])
        self.best_reward = max(self.best_reward, reward)
        return out

    def _flat_reward(self, reward: float, low: float, high: float, bests: list[float]) -> list[str]:
        """The reward sign: every score equal, fallen from the run's best, for more prompts than chance gives."""
        span = self.high - self.low
        if low == high and self.best_reward - reward >= self.REWARD_FALL * span > 0:
            self.flat_prompts += len(bests)
            self.streak_bests += bests
            # the run's rate before this streak; none seen (a resumed old checkpoint): no evidence yet
            p = sum(b > reward for b in self.bests) / len(self.bests) if self.bests else 0.0
            if (1 - p) ** self.flat_prompts <= self.REWARD_CHANCE:
                return [f"every score {reward:.3g} for {self.flat_prompts} prompts in a row, below the run's "
                        f"best mean {self.best_reward:.3g}"]
            return []
        # the streak ended: its flat prompts are part of the run's record from now on
        self.bests = (self.bests + self.streak_bests + list(bests))[-self.HISTORY:]
        self.flat_prompts, self.streak_bests = 0, []
        return []

    def _one_way(self, low: float, high: float, splits: list[bool]) -> list[str]:
        """The one-way sign: every group flat while the prompts' scores differ, for more groups than chance
        gives at the run's earlier rate of groups that split."""
        if low < high and not any(splits):
            self.one_way_groups += len(splits)
            q = sum(self.splits) / len(self.splits) if self.splits else 0.0
            if (1 - q) ** self.one_way_groups <= self.REWARD_CHANCE:
                return [f"every prompt's completions scored alike for {self.one_way_groups} prompts in a row "
                        f"(earlier in the run: {1 - q:.0%} of prompts'), right on some and wrong on others: no "
                        "group has a learning signal"]
            return []
        self.splits = (self.splits + [False] * self.one_way_groups + splits)[-self.HISTORY:]
        self.one_way_groups = 0
        return []

    def check(self, update: int, entropy: float, clipped: float, reward: float, low: float, high: float,
              bests: list[float] | None = None, worsts: list[float] | None = None) -> None:
        """After each update, with its rollout's figures (`signs`); raises when the streak reaches patience."""
        signs = self.signs(entropy, clipped, reward, low, high, bests, worsts)
        self.streak = self.streak + 1 if signs else 0
        if not self.patience or self.streak < self.patience:
            return
        self.streak = 0
        what = f"the policy degenerated for {self.patience} updates in a row (update {update}: {'; '.join(signs)})"
        if self.action == "rollback":
            raise Rollback(what)
        raise Fault(f"{what}: stopped; allowed: a lower learning_rate, precision fp32, dynamic_sampling: true, "
                    "a smaller clip_high, kl_coef > 0, ent_coef > 0, or collapse_action: rollback, or "
                    "collapse_patience: 0 (off)")

    def state_dict(self) -> dict:
        return {"first": self.first, "best_reward": self.best_reward, "low": self.low, "high": self.high,
                "streak": self.streak, "bests": list(self.bests), "streak_bests": list(self.streak_bests),
                "flat_prompts": self.flat_prompts, "splits": list(self.splits), "one_way_groups": self.one_way_groups}

    def load_state_dict(self, state: dict) -> None:
        self.first, self.best_reward, self.streak = state["first"], state["best_reward"], state["streak"]
        self.low, self.high = state["low"], state["high"]
        # checkpoints from before the per-prompt record lack it: the record restarts from here
        self.bests, self.streak_bests = list(state.get("bests", [])), list(state.get("streak_bests", []))
        self.flat_prompts = state.get("flat_prompts", 0) if "bests" in state else 0
        self.splits, self.one_way_groups = list(state.get("splits", [])), state.get("one_way_groups", 0)


class RunGuard:
    """Checkpoint-on-failure around each update of `trainer` (a `Trainer`). `resume_hint` is the command
    that continues the run.

    `write(state)`, when given, is a collective writer every rank calls (FSDP2's sharded checkpoint: it
    saves the live weights itself, so no snapshot of them is kept); on a failure it runs only when every
    rank knows of it (a shared error or a stop), since the others would otherwise never join it."""

    def __init__(self, trainer: Trainer, path: Path, resume_hint: str, write=None):
        self.trainer, self.path, self.resume_hint, self.write = trainer, Path(path), resume_hint, write
        self.full = write is None and nbytes(trainer.state_dict()) <= SNAPSHOT_LIMIT
        self.saved_update: int | None = None  # the update the newest checkpoint on disk holds

    def save(self, state: dict | None = None) -> None:
        state = self.trainer.state_dict() if state is None else state
        if self.write is not None:
            self.write(state)
        elif distributed.is_main():  # the replicated state: rank 0 writes it (runtime/distributed.py)
            save_checkpoint(self.path, state)
        self.saved_update = state["update"]

    @contextlib.contextmanager
    def update(self):
        point = _clone(self.trainer.state_dict() if self.full else self.trainer.step_state())
        self.trainer.optimizing = False
        try:
            yield
        except Rollback:  # back to the checkpoint on disk: the state in memory is not worth saving
            raise
        except StopRequested:
            self._save_point(point)
            raise
        except BaseException as e:
            # the same exception goes on (its traceback intact for --debug), saying what the run kept
            shared = self.write is None or getattr(e, "ppoforge_shared", False)
            e.ppoforge_kept = resume_note(self._save_point(point) if shared else self.saved_update, self.resume_hint)
            raise

    def _save_point(self, point: dict) -> int | None:
        """Checkpoint the state as of the failing update's start, where that state is known."""
        if not self.full and self.trainer.optimizing:
            return self.saved_update  # the optimizer already moved a state too large to copy
        state = point if self.full else {**self.trainer.state_dict(), **point}
        try:
            self.save(state)
        except OSError:  # the disk that failed the update may fail this too: the older checkpoint stays
            return self.saved_update
        return state["update"]


def resume_note(saved: int | None, hint: str) -> str:
    """What a failed run kept, for the end of its one-line error (see errors.classify)."""
    if saved is None:
        return "no checkpoint was written yet"
    return f"checkpoint at update {saved}: continue with {hint}"


def train_loop(trainer: Trainer, guard: RunGuard, total: int, checkpoint_every: int, after_update) -> str | None:
    """Run `trainer.train_one_update()` until `trainer.update == total` or a stop signal; returns the
    signal's name, or None. Each update — its logging (`after_update(result)`) and checkpoint included —
    runs inside `guard.update()`, so a failure anywhere in it leaves the last completed update on disk.
    A `Rollback` from a guard calls `trainer.rollback()` and goes on, `max_rollbacks` times at most
    (`roll_back`). Under torchrun the ranks agree on a stop after each update (one that reached one rank
    first stops them all there)."""
    with StopFlag() as stop:
        while trainer.update < total:
            if not run_update(trainer, guard, total, checkpoint_every, after_update, stop):
                break
    return stop.signal_name


def run_update(trainer: Trainer, guard: RunGuard, total: int, checkpoint_every: int, after_update,
               stop: StopFlag) -> bool:
    """One update of `train_loop` (the Python API's `step()` runs it alone, under its own StopFlag): the
    update, `after_update`, the checkpoint every `checkpoint_every` updates, at `total` and on a stop, all
    inside `guard.update()`; a rollback. False when the run stops here (a signal)."""
    try:
        with guard.update():
            after_update(trainer.train_one_update())
            stopping = distributed.any_true(bool(stop))
            if trainer.update % checkpoint_every == 0 or trainer.update == total or stopping:
                guard.save()
        return not stopping
    except Rollback as e:
        roll_back(trainer, guard, str(e))
        return True
    except StopRequested as e:  # a stop inside a user call: the last completed update is saved
        stop.signal_name = stop.signal_name or e.signal_name
        return False


def roll_back(trainer: Trainer, guard: RunGuard, why: str) -> None:
    """A guard gave up on the current state (`why`): back to the last checkpoint, counted in
    `guard/rollbacks` and said in one line — or, with `max_rollbacks` spent, stop there (a `Fault`:
    nothing new is saved, the checkpoint on disk is the last good state). Every rank decides alike (the
    guards act on global numbers)."""
    spent, budget = trainer.guard.counts["guard/rollbacks"], trainer.cfg.max_rollbacks
    if spent >= budget:
        fault = Fault(f"{why}: stopped after {spent} rollbacks (max_rollbacks: {budget}; the learning rate at "
                      f"x{trainer.lr_scale:.3g}); allowed: a smaller learning_rate, a finite reward, or a larger "
                      "max_rollbacks")
        fault.ppoforge_kept = resume_note(guard.saved_update, guard.resume_hint)
        raise fault
    trainer.rollback()
    trainer.guard.counts["guard/rollbacks"] = spent + 1  # the rollback kept the counts as they were
    if distributed.is_main():
        print(f"ppoforge: {why}: rollback {spent + 1} of {budget} (max_rollbacks) to update {trainer.update}, "
              f"the learning rate now x{trainer.lr_scale:.3g}", file=sys.stderr, flush=True)
