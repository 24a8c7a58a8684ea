"""Calls into user code (reward functions, environments) that may hang: a time limit, and SIGTERM wins.

`call_with_timeout(fn, seconds, what)` runs `fn` in this (the main) thread under a SIGALRM timer. When
the timer fires — or SIGINT/SIGTERM arrives while the call runs — the signal handler raises inside the
call: Python runs handlers between bytecodes, and a blocking system call (`sleep`, a socket read) is
interrupted by the signal and, since the handler raised, not retried. So a reward that never returns
costs at most `seconds`, and a stop request costs at most the time to the next bytecode, instead of
waiting for the call forever. What stays out of reach: C code that holds the GIL and never returns.

Off the main thread (signals are main-thread only) the call runs without a limit.
"""

from __future__ import annotations

import contextlib
import signal
import threading

from ppoforge.errors import Fault


class CallTimeout(Fault):
    """A user call (reward, environment) ran past its time limit."""


class StopRequested(BaseException):
    """SIGINT/SIGTERM arrived inside an interruptible call: unwind it, then stop the run gracefully.
    A BaseException, so a user's `except Exception` inside the call cannot swallow it."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal_name = signal_name


_interruptible = threading.local()


def inside_interruptible_call() -> bool:
    """True while `call_with_timeout` runs a call (the stop handler then raises instead of waiting)."""
    return getattr(_interruptible, "depth", 0) > 0


@contextlib.contextmanager
def _interruptible_region():
    _interruptible.depth = getattr(_interruptible, "depth", 0) + 1
    try:
        yield
    finally:
        _interruptible.depth -= 1


def call_with_timeout(fn, seconds: float | None, what: str, knob: str = "call_timeout"):
    """`fn()`, or CallTimeout naming `what` once it has run `seconds`; StopRequested on SIGINT/SIGTERM.
    `knob`: the config field that sets the limit, named in the error."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        return fn()

    def expire(signum, frame):
        raise CallTimeout(f"{what} did not return within {seconds:g} s ({knob}); allowed: a faster "
                          f"function, or a larger --{knob.replace('_', '-')}")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        with _interruptible_region():
            return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
