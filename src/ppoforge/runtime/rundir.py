"""Run directories: nothing already written is lost, and nothing is half-written.

- A new run refuses a run dir that already holds a run (`--resume` continues it, `--overwrite` starts
  over), so a second `train` with the same `--run-dir` cannot silently replace a checkpoint. A run has
  started once its trainer wrote `config.yaml` (or a checkpoint): what an attempt wrote before that (a
  `data_report.json` of data it refused) holds nothing to resume, so a retry clears it and goes on.
- Every file a trainer rewrites (checkpoint, config) is written to a temp file beside it, fsynced and
  renamed over the target: a crash or a full disk at any moment leaves the old file or the new one.
  A temp file left by a write that was killed is removed by the next write of the same file.
- One run at a time in a run dir (`hold`): an exclusive `flock` on `RUN_DIR/.lock`, held from before
  `--overwrite` clears the folder to the end of the run, refuses a second run (or a `--resume` of a run
  still going) in one line naming the holder. The kernel releases the lock when its process ends, however
  it ends, so a lock left by a killed run is no lock; the file is removed when its run ends. Locks belong
  to open file descriptions, so two holds in one process would conflict: `hold` counts a nested hold of
  a folder this process already holds (the CLI's around the trainer's). Under torchrun rank 0 alone holds.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

from ppoforge.errors import UserError

LOCK_FILE = ".lock"  # in the run dir while a run holds it: {"pid", "host", "started"}

# what trainers write into a run dir (removed by --overwrite; anything else in the folder is left alone)
RUN_FILES = ("checkpoint.pt", "checkpoint", "config.yaml", "code.json", "data_files.json", "metrics.jsonl",
             "completions.jsonl", "tb", "policy", "model", "summary.json", "samples.jsonl", "data_report.json",
             "learning_curve.png", "reward_kl.png", "reward_gaps.png")
STARTED = ("checkpoint.pt", "checkpoint", "config.yaml")  # a run began here: written when its trainer starts


def _temp_prefix(path: Path) -> str:
    return f".{path.name}."


def clean_stale_temps(path: Path) -> None:
    """Remove temp files of earlier, interrupted writes of `path` (`.<name>.*.tmp` beside it)."""
    for stale in Path(path).parent.glob(f"{_temp_prefix(Path(path))}*.tmp"):
        stale.unlink(missing_ok=True)


def atomic_write_bytes(path: Path, write) -> None:
    """Call `write(fileobj)` on a temp file beside `path`, then atomically move it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temps(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_temp_prefix(path), suffix=".tmp")
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


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, lambda f: f.write(text.encode()))


def new_run_dir(root: Path | str, name: str) -> Path:
    """A run dir not yet used under `root`: root/NAME-YYYYmmdd-HHMMSS (-2, -3... within the same second)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path(root) / f"{name}-{stamp}"
    suffix = 1
    while path.exists():
        suffix += 1
        path = Path(root) / f"{name}-{stamp}-{suffix}"
    return path


def prepare_new_run_dir(run_dir: Path, overwrite: bool) -> None:
    """Refuse a run dir that holds a started run, unless `overwrite` (then remove what an earlier run
    wrote); what an attempt left before its run started is removed either way. Under torchrun rank 0
    alone checks (the others would race with its first writes)."""
    if int(os.environ.get("RANK", "0")) > 0:
        return
    run_dir = Path(run_dir)
    present = [name for name in RUN_FILES if (run_dir / name).exists()]
    if any(name in STARTED for name in present) and not overwrite:
        raise UserError(f"run_dir: {run_dir} already holds a run ({', '.join(present)}); allowed: --resume "
                        f"{run_dir} to continue it, --overwrite to replace it, or another --run-dir")
    for name in present:
        target = run_dir / name
        shutil.rmtree(target) if target.is_dir() else target.unlink()


def _same_file(fd: int, path: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _holder(fd: int) -> str:
    """Who holds the lock, from what it wrote into the lock file (nothing yet in the moment after it locked)."""
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {int(info['pid'])} on {info['host']} (started {info['started']})"
    except (ValueError, KeyError, TypeError, OSError):
        return "another process"


class RunDirLock:
    """An exclusive, non-blocking `flock` on `run_dir/.lock` through one open file description. `acquire`
    creates the folder where it is missing (and `release` removes what it created, if still empty, so an
    attempt refused before it wrote anything leaves nothing), or raises one UserError naming the holder."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.fd: int | None = None
        self.created: list[Path] = []  # folders acquire made, deepest last

    def acquire(self) -> None:
        missing = [d for d in (self.run_dir, *self.run_dir.parents) if not d.exists()]
        for _ in range(100):  # a retry only follows a holder that ended in between: never many
            self.run_dir.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except FileNotFoundError:  # an ending holder removed the folder it had made: make it again
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                self._remove_created(missing)
                raise UserError(f"run_dir: {self.run_dir} is in use by {holder}; allowed: another --run-dir, or wait "
                                "for that run to end") from None
            except OSError as e:  # a filesystem without flock (some network mounts): run unlocked, and say so
                os.close(fd)
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                print(f"ppoforge: run_dir: {self.run_dir} cannot be locked ({e.strerror}): nothing stops a second "
                      "run from starting there", file=sys.stderr)
                return
            if _same_file(fd, self.path):
                break
            os.close(fd)  # the holder before us removed this file as it ended: lock the one there now
        else:
            raise UserError(f"run_dir: {self.run_dir}/{LOCK_FILE} keeps changing; allowed: a run dir one run uses")
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
        self.fd, self.created = fd, missing

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            if _same_file(self.fd, self.path):
                self.path.unlink()  # while still locked: whoever opened it retries on the file there next
        finally:
            os.close(self.fd)
            self.fd = None
        self._remove_created(self.created)

    @staticmethod
    def _remove_created(folders: list[Path]) -> None:
        for folder in folders:  # deepest first
            try:
                folder.rmdir()
            except OSError:  # not empty (the run wrote there), or gone: leave it
                return


_HELD: dict[str, list] = {}  # realpath -> [RunDirLock, depth]: the run dirs this process holds


@contextlib.contextmanager
def hold(run_dir: Path):
    """Hold `run_dir` for the run (`RunDirLock`) inside the block; nested holds of one folder in this
    process count (the CLI holds a run dir around the trainer's own `train`). Under torchrun only rank 0
    holds it (the others work in rank 0's run dir)."""
    if int(os.environ.get("RANK", "0")) > 0:
        yield
        return
    key = os.path.realpath(run_dir)
    if key in _HELD:
        _HELD[key][1] += 1
        try:
            yield
        finally:
            _HELD[key][1] -= 1
        return
    lock = RunDirLock(Path(run_dir))
    lock.acquire()
    _HELD[key] = [lock, 1]
    try:
        yield
    finally:
        del _HELD[key]
        lock.release()
