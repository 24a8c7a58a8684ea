"""Run directories: nothing already written is lost, and nothing is half-written.

- A new run refuses a run dir that already holds a run (`--resume` continues it, `--overwrite` starts
  over), so a second `train` with the same `--run-dir` cannot silently replace a checkpoint. A run has
  started once its trainer wrote `config.yaml` (or a checkpoint): what an attempt wrote before that (a
  `data_report.json` of data it refused) holds nothing to resume, so a retry clears it and goes on.
- Every file a trainer rewrites (checkpoint, config) is written to a temp file beside it, fsynced and
  renamed over the target: a crash or a full disk at any moment leaves the old file or the new one.
  A temp file left by a write that was killed is removed by the next write of the same file.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ppoforge.errors import UserError

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
