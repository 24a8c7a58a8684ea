"""A run dir's config can name code to import (`py:module:function` rewards, environments) and data to
train on: a resume must not run other code, or continue on other data, than the run started with
without the user saying so.

At the start of a run every `py:` item of the config is resolved to its file — without importing
anything (a module path is looked up on sys.path by hand, since `importlib.util.find_spec` imports
parent packages) — and its SHA-256 is written to `code.json`; every local file (or folder) a data field
names (`param(data=True)`: `prompts`, `data`) has its SHA-256 written to `data_files.json`. `--resume`
recomputes them first: when a file changed, moved or is new, it refuses with one line naming the file,
until the user passes `--trust-run-dir`. A changed data file would silently break the exact resume (the
data cursor and the shuffled order index the rows the run started with). Hub datasets and built-in sets
are not fingerprinted (pin a hub dataset's revision yourself).

What this protects against: code or data that drifted since the run started (an edited reward module,
a regenerated data file). It is not tamper-evidence: the hashes sit in the run dir, so whoever can edit
its config.yaml can edit code.json and data_files.json to match. A run dir is as trustworthy as its
author; resume only run dirs you trust.
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
DATA_FILE = "data_files.json"
_PY_ITEM = re.compile(r"(?:^|,)\s*(?:py|trl):([^,]+?):([A-Za-z_]\w*)\s*(?=,|$)")  # trl: a TRL env class


def code_items(cfg) -> list[str]:
    """Every `py:target:attr` (or `trl:target:Class`, lm/envs/protocol.py) target named by a string field of `cfg`."""
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


def _sha256(path: Path) -> str:
    """Of a file's bytes, or of a folder's files (relative names and contents, in sorted order)."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        if path.is_dir():
            digest.update(str(file.relative_to(path)).encode() + b"\0")
        with file.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def data_fingerprint(cfg) -> dict[str, dict]:
    """{field: {"file": resolved path, "sha256": hex}} for every data field naming a local file or folder."""
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.metadata.get("data") and isinstance(value, str) and value:
            path = Path(value).expanduser()
            if path.exists():
                out[f.name] = {"file": str(path.resolve()), "sha256": _sha256(path)}
    return out


def record(run_dir: Path, cfg) -> None:
    atomic_write_text(Path(run_dir) / CODE_FILE, json.dumps(fingerprint(cfg), indent=1) + "\n")
    atomic_write_text(Path(run_dir) / DATA_FILE, json.dumps(data_fingerprint(cfg), indent=1) + "\n")


def _recorded(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def resume_command(trainer: str, run_dir: Path, cfg) -> str:
    """How to continue a run: `ppoforge train TRAINER --resume RUN`, and where the config names py: code,
    that a resume after an edit of it needs --trust-run-dir (`check_resume` refuses code that is not what
    the run started with): the fix for a failing reward is often an edit of its file."""
    command = f"ppoforge train {trainer} --resume {run_dir}"
    files = list(dict.fromkeys(str(path) for target in code_items(cfg) if (path := module_file(target))))
    return f"{command} (add --trust-run-dir if you changed {', '.join(files)})" if files else command


def check_resume(run_dir: Path, cfg, trusted: bool) -> None:
    """Refuse to resume into code, or onto data, that is not what the run started with, unless `trusted`."""
    if trusted:
        return
    _check_code(run_dir, cfg)
    changed = data_change(run_dir, cfg)
    if changed:
        raise UserError(f"resume: {run_dir}'s {changed}: the data order would continue on other rows; allowed: "
                        f"restore that file, start a new run (another --run-dir, or --overwrite), or --resume "
                        f"{run_dir} --trust-run-dir to continue on the changed data")


def data_change(run_dir: Path, cfg) -> str | None:
    """'FIELD file PATH changed since the run started (...)' for the first data file whose content is not
    what `record` saw, else None (also for a run dir from before data was fingerprinted)."""
    then = _recorded(Path(run_dir) / DATA_FILE)
    if then is None:
        return None
    now = data_fingerprint(cfg)
    for name in sorted(set(then) | set(now)):
        started, seen = then.get(name), now.get(name)
        if (started or {}).get("sha256") != (seen or {}).get("sha256"):  # the content; it may have moved
            is_ = f"sha256 {seen['sha256'][:12]}" if seen else "missing"
            was = f"sha256 {started['sha256'][:12]}" if started else "not recorded"
            return (f"{name} file {(seen or started)['file']} changed since the run started ({is_}, when the run "
                    f"started: {was})")
    return None


def _check_code(run_dir: Path, cfg) -> None:
    now = fingerprint(cfg)
    if not now:
        return
    then = _recorded(Path(run_dir) / CODE_FILE) or {}
    for target, seen in now.items():
        started = then.get(target)
        if started != seen:
            was = f"sha256 {started['sha256'][:12]}" if started and started.get("sha256") else "not recorded"
            is_ = f"sha256 {seen['sha256'][:12]}" if seen["sha256"] else "missing"
            raise UserError(f"resume: {run_dir}'s config imports py:{target} ({seen['file'] or 'no such file'}: "
                            f"{is_}, when the run started: {was}); allowed: check that code, then --resume "
                            f"{run_dir} --trust-run-dir")
