"""SIGINT/SIGTERM become a flag the training loop checks between updates.

The trainer then saves a checkpoint and exits 0, so a preempted job resumes instead of losing work.
Inside a call into user code that may hang (`timeouts.call_with_timeout`: reward functions,
environments) the handler raises `StopRequested` instead, so a stop never waits for a call that does
not return; the trainer then saves the last completed update. A second signal while stopping
interrupts at once (`Interrupted`, a KeyboardInterrupt: the CLI exits 130).

While a StopFlag handles SIGINT, no Ctrl-C raises a bare KeyboardInterrupt, so one that reaches the
user-code boundary then was raised by user code (`graceful_sigint`, runtime/usercode.py).
"""

from __future__ import annotations

import signal
import threading

from ppoforge.runtime.timeouts import StopRequested, inside_interruptible_call


class Interrupted(KeyboardInterrupt):
    """The second SIGINT/SIGTERM while stopping: give up on the graceful path, at once."""


class StopFlag:
    """Context manager installing handlers; `bool(flag)` is True once a stop was requested."""

    def __init__(self):
        self.signal_name: str | None = None
        self._old: dict = {}

    def __bool__(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum, frame):
        if self.signal_name is not None:  # second signal: give up on the graceful path
            raise Interrupted
        self.signal_name = signal.Signals(signum).name
        if inside_interruptible_call():
            raise StopRequested(self.signal_name)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        return False


def graceful_sigint() -> bool:
    """True while a StopFlag handles SIGINT in this process: a Ctrl-C then raises StopRequested or
    Interrupted, never a bare KeyboardInterrupt."""
    return isinstance(getattr(signal.getsignal(signal.SIGINT), "__self__", None), StopFlag)
