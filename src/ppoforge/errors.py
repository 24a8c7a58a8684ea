"""The two failures a user sees, and how any other exception becomes one of them (the error boundary).

- `UserError`: bad input (a config value, a data file, a model path, a reward function's output, a path
  that cannot be written): one line naming what is wrong and what is allowed, exit code 2.
- `Fault`: the environment failed (a full disk, a reward that never returns, memory that ran out, a run
  that kept producing NaN): one line naming what failed and what was saved, exit code 1.

`classify` turns any exception into (exit code, one line): OSError by its errno (a path the user named
that is read-only or missing is input, a full disk is a fault), MemoryError as a fault, anything else as
an internal error — still one line, with `--debug` for the traceback. Trainers save what they completed
before the exception reaches the CLI (see `runtime/resilience.py`).
"""

from __future__ import annotations

import errno

EXIT_USER, EXIT_FAULT = 2, 1
_INPUT_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.ENOTDIR, errno.EISDIR,
                 errno.ENAMETOOLONG, errno.EEXIST}
_STORAGE_FIX = "free space on that filesystem or write the run elsewhere (--run-dir / --runs-root)"


class UserError(Exception):
    """Bad input from the user; the message is the whole story (one line). Exit code 2."""


class Fault(Exception):
    """The environment failed (disk, time, memory, numbers); the message is the whole story. Exit code 1."""


def _where(e: OSError) -> str:
    return f" {e.filename}" if e.filename else ""


def describe_os_error(e: OSError) -> tuple[int, str]:
    """(exit code, one line) for a failed file operation."""
    reason = e.strerror or str(e)
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return EXIT_FAULT, f"no space left writing{_where(e)} ({reason}); {_STORAGE_FIX}"
    if e.errno in _INPUT_ERRNOS:
        return EXIT_USER, f"cannot use{_where(e)} ({reason}); allowed: a path this user can read and write"
    return EXIT_FAULT, f"I/O error on{_where(e)} ({reason})"


def classify(e: BaseException) -> tuple[int, str]:
    """(exit code, the one line to print) for an exception that reached the command line; a trainer's
    note of what it saved (`ppoforge_kept`, set by runtime/resilience.py) ends the line."""
    code, line = _classify(e)
    kept = getattr(e, "ppoforge_kept", None)
    return code, f"{line}; {kept}" if kept else line


def _classify(e: BaseException) -> tuple[int, str]:
    if isinstance(e, UserError):
        return EXIT_USER, str(e)
    if isinstance(e, Fault):
        return EXIT_FAULT, str(e)
    if isinstance(e, OSError):
        return describe_os_error(e)
    if isinstance(e, MemoryError):
        return EXIT_FAULT, "out of memory; allowed: smaller batch / micro-batch / sequence sizes"
    if isinstance(e, UnicodeError):
        return EXIT_USER, f"text that is not valid UTF-8 ({e}); allowed: UTF-8 files"
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
    return EXIT_FAULT, (f"internal error {type(e).__name__}: {first} (a ppoforge bug: rerun with --debug for the "
                        "traceback and report it)")
