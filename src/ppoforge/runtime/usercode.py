"""The user-code boundary: every call into code the user wrote — a reward function, an environment's
methods and constructor, the import of a `py:` module — goes through `call_user`, so each has the same
guarantees.

- A time limit (`call_timeout`, runtime/timeouts.py): past it a `CallTimeout` naming the call (a Fault,
  exit 1). SIGINT/SIGTERM inside the call abandons it (`StopRequested`); the trainer checkpoints the
  last completed update and exits 0.
- Whatever the code raises is that code's failure: a one-line `UserError` naming it (exit 2), and the
  trainer checkpoints as for any failure. BaseExceptions too: `sys.exit(0)` in a reward would otherwise
  end a failed run with exit 0 and no word, `sys.exit(3)` in a module's top level with exit 3.
- Passed on unchanged: our own one-line errors (`UserError`, `Fault`: a nested check, a time limit) and
  the signals (`StopRequested`, `Interrupted`), which are not the code's doing.

A KeyboardInterrupt is the user's Ctrl-C or the code's own `raise`; only the SIGINT handler in force
tells them apart. While a StopFlag handles SIGINT (runtime/signals.py: the training loop), a Ctrl-C
raises StopRequested or Interrupted, never a bare KeyboardInterrupt, so a bare one is the code's failure.
Under any other handler (Python's default while the trainer is built and user modules are imported, and
in the held-out evaluation before the first update; a library caller's own) it may be a real Ctrl-C,
so it goes on unchanged and the run ends as interrupted (exit 130): stopping on a keypress is never
turned into an error.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

from ppoforge.errors import Fault, UserError
from ppoforge.runtime.signals import Interrupted, graceful_sigint
from ppoforge.runtime.timeouts import StopRequested, call_with_timeout


def call_user(fn, where: str, seconds: float | None = None):
    """`fn()` under a limit of `seconds` (None: none of its own, e.g. inside a caller's limit); what it
    raises becomes one line naming `where` (see the module docstring)."""
    try:
        return call_with_timeout(fn, seconds, where)
    except (UserError, Fault, StopRequested, Interrupted):
        raise
    except KeyboardInterrupt as e:
        if not graceful_sigint():
            raise  # possibly the user's Ctrl-C: an interrupt, not a failure
        raise failure(e, where) from None
    except BaseException as e:  # noqa: BLE001 - user code: whatever it raises is the user's to fix
        raise failure(e, where) from None


def failure(e: BaseException, where: str) -> UserError:
    """`WHERE raised TYPE: its first line that says something` (NLTK's LookupError opens with a row of
    asterisks); for a BaseException (sys.exit, KeyboardInterrupt) also what is allowed instead."""
    msg = next((line.strip() for line in str(e).splitlines() if any(c.isalnum() for c in line)), "")
    line = f"{where} raised {type(e).__name__}{': ' + msg[:200] if msg else ''}"
    if not isinstance(e, Exception):
        line += "; allowed: return a result, or raise an Exception to fail (user code cannot end the run)"
    return UserError(line)


def load_python(spec: str, what: str = "reward", noun: str = "function", prefix: str = "py",
                timeout: float | None = None):
    """`module.path:NAME` or `/path/file.py:NAME` (a module is looked up from the cwd too): the callable
    NAME, its module imported under `timeout` seconds (its top level is user code). `what`, `noun` and
    `prefix` word the errors (environments load classes: lm/envs/protocol.py)."""
    target, sep, func = spec.rpartition(":")
    if not sep or not target or not func:
        raise UserError(f"{what} {prefix}:{spec}: expected {prefix}:module.path:{noun} or "
                        f"{prefix}:/path/file.py:{noun}")
    if target.endswith(".py") and not Path(target).expanduser().is_file():
        raise UserError(f"{what} {prefix}:{spec}: no file {Path(target).expanduser()}")
    module = call_user(lambda: _import(target, what), f"{what} {prefix}:{spec}: importing {target}", timeout)
    fn = getattr(module, func, None)
    if not callable(fn):
        raise UserError(f"{what} {prefix}:{spec}: {target} has no {noun} {func!r}")
    return fn

def _import(target: str, what: str):
    """The module `target`: a file path (loaded under a private name), or a dotted module name."""
    if target.endswith(".py"):
        path = Path(target).expanduser()
        module_spec = importlib.util.spec_from_file_location(f"ppoforge_{what}_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        return module
    if "" not in sys.path:
        sys.path.insert(0, "")  # like `python -m`: modules in the current directory are importable
    return importlib.import_module(target)
