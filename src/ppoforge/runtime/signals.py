"""SIGINT/SIGTERM become a flag the training loop checks between updates.

The trainer then saves a checkpoint and exits 0, so a preempted job resumes instead of losing work.
A second signal while stopping restores the default handler behaviour (an immediate interrupt).
"""

from __future__ import annotations

import signal
import threading


class StopFlag:
    """Context manager installing handlers; `bool(flag)` is True once a stop was requested."""

    def __init__(self):
        self.signal_name: str | None = None
        self._old: dict = {}

    def __bool__(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum, frame):
        if self.signal_name is not None:  # second signal: give up on the graceful path
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        return False
