"""A trainer's run strung from its pieces, once for RLHF, the supervised loop and control PPO: `run` trains to the
end as the CLI does, `step` runs one update of it for the Python API's `step()`, and `end` closes either after the
last update. Both go through `resilience.run_update`, so an update driven by hand logs, checkpoints and rolls back
exactly as one of `train_loop`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from ppoforge.runtime.resilience import RunGuard, Trainer, run_update, train_loop
from ppoforge.runtime.signals import StopFlag


class Loop(Trainer, Protocol):
    """A trainer `run` and `step` drive: the `resilience.Trainer` with its run's pieces."""

    run_guard: RunGuard

    def open_run(self) -> None: ...  # before this process's first update: the run dir's logs, the first evaluation

    def after_update(self, result) -> None: ...  # `train_loop`'s after_update: log, evaluate, progress

    def finish(self) -> Path | None: ...  # after the last update: the export (its folder; None: nothing exported)

    def close_run(self) -> None: ...  # the logs and the progress bar closed

    def summarize(self, stopped: str | None, export: Path | None): ...  # summary.json; the run's result

    def plot(self) -> None: ...  # the curves from metrics.jsonl (the caller's call: the doctor's smoke runs draw none)


def run(loop: Loop, total: int, checkpoint_every: int):
    """Train to `total` updates or a stop signal (the last update checkpointed); returns `loop.summarize`'s result."""
    loop.open_run()
    try:
        stopped = train_loop(loop, loop.run_guard, total, checkpoint_every, loop.after_update)
    except BaseException:
        loop.close_run()
        raise
    return end(loop, stopped, finished=loop.update == total and not stopped)


def end(loop: Loop, stopped: str | None, finished: bool):
    """After the run's last update (`finished`: then the export) or a stop: the logs closed, the summary written."""
    try:
        export = loop.finish() if finished else None
    finally:
        loop.close_run()
    return loop.summarize(stopped, export)


def step(loop: Loop, total: int, checkpoint_every: int) -> tuple[object, str | None]:
    """One update of an opened run (`open_run`), as one turn of `train_loop`: (what its `train_one_update`
    returned, after `after_update` logged it — None when a stop signal came before an update completed; the
    signal's name or None). After a rollback the update is run again."""
    got: list = []

    def after_update(result) -> None:
        loop.after_update(result)
        got.append(result)

    with StopFlag() as stop:
        while not got and run_update(loop, loop.run_guard, total, checkpoint_every, after_update, stop):
            pass
    return (got[-1] if got else None), stop.signal_name
