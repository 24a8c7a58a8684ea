"""A run dir's config can name code to import (`py:module:function` rewards, environments): a resume
must not run code other than the run started with without the user saying so.

At the start of a run every `py:` item of the config is resolved to its file — without importing
anything (a module path is looked up on sys.path by hand, since `importlib.util.find_spec` imports
parent packages) — and its SHA-256 is written to `code.json`. `--resume` recomputes them first: when
a file changed, moved or is new, it refuses with one line naming the file and both hashes, until the
user passes `--trust-run-dir`. A config that names no code needs no trust.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import sys
from pathlib import Path

from ppoforge.errors import UserError
from ppoforge.runtime.rundir import atomic_write_text

CODE_FILE = "code.json"
_PY_ITEM = re.compile(r"(?:^|,)\s*(?:py|trl):([^,]+?):([A-Za-z_]\w*)\s*(?=,|$)")  # trl: a TRL env class


def code_items(cfg) -> list[str]:
    """Every `py:target:attr` (or `trl:target:Class`, lm/env.py) target named by a string field of `cfg`."""
    items = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, str):
            items += [m.group(1).strip() for m in _PY_ITEM.finditer(value)]
    return items


def module_file(target: str) -> Path | None:
    """The file `py:target:...` would execute: a .py path, or module `a.b` found on sys.path (cwd first)."""
    if target.endswith(".py"):
        path = Path(target).expanduser()
        return path.resolve() if path.is_file() else None
    parts = target.split(".")
    for root in ["", *sys.path]:
        base = Path(root or ".").joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate.resolve()
    return None


def fingerprint(cfg) -> dict[str, dict]:
    """{target: {"file": path or None, "sha256": hex or None}} for the code the config names."""
    out = {}
    for target in code_items(cfg):
        path = module_file(target)
        out[target] = {"file": str(path) if path else None,
                       "sha256": hashlib.sha256(path.read_bytes()).hexdigest() if path else None}
    return out


def record(run_dir: Path, cfg) -> None:
    atomic_write_text(Path(run_dir) / CODE_FILE, json.dumps(fingerprint(cfg), indent=1) + "\n")


def check_resume(run_dir: Path, cfg, trusted: bool) -> None:
    """Refuse to resume into code that is not the code the run started with, unless `trusted`."""
    now = fingerprint(cfg)
    if not now or trusted:
        return
    path = Path(run_dir) / CODE_FILE
    try:
        then = json.loads(path.read_text())
    except (OSError, ValueError):
        then = {}
    for target, seen in now.items():
        started = then.get(target)
        if started != seen:
            was = f"sha256 {started['sha256'][:12]}" if started and started.get("sha256") else "not recorded"
            is_ = f"sha256 {seen['sha256'][:12]}" if seen["sha256"] else "missing"
            raise UserError(f"resume: {run_dir}'s config imports py:{target} ({seen['file'] or 'no such file'}: "
                            f"{is_}, when the run started: {was}); allowed: check that code, then --resume "
                            f"{run_dir} --trust-run-dir")
