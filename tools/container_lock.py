"""Write the container's lock file: ppoforge's extras resolved with the base image's torch pinned.

    .venv/bin/python tools/container_lock.py      # docker/requirements-torch2.6.txt (+ .meta.json)
    .venv/bin/python tools/container_lock.py --torch 2.7.1 --out docker/requirements-torch2.7.txt

pip resolves and installs nothing (`pip install --dry-run --ignore-installed --report`). The lock lists
every package pinned `==`, except what the base image provides: torch and the packages only torch needs
(triton, nvidia-*, sympy, ...) become `# base:` comment lines, so `pip install --no-deps -r LOCK` in
the Dockerfile never touches the base's torch or its CUDA libraries. Beside the lock, LOCK.meta.json
keeps each package's declared requirements and pip's marker environment, so a test proves the pins
coherent offline. ppoforge's build backend (setuptools) is pinned too, for `--no-build-isolation`
builds without an index. pip resolves for `--python` (the oldest Python of the supported bases), on
Linux x86_64 (the host's platform markers are the image's).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
BUILD_REQUIRES = "setuptools>=68"


def _applies(req: Requirement, env: dict, extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**env, "extra": e}) for e in (extras or {""}))


def needed_without_torch(packages: dict[str, dict], roots: list[Requirement], env: dict) -> set[str]:
    """Names reachable from `roots` through declared requirements, never walking through torch."""
    seen, todo = set(), [(canonicalize_name(r.name), set(r.extras)) for r in roots]
    walked: set[tuple[str, frozenset]] = set()
    while todo:
        name, extras = todo.pop()
        seen.add(name)
        if name == "torch" or (name, frozenset(extras)) in walked or name not in packages:
            continue
        walked.add((name, frozenset(extras)))
        for text in packages[name]["requires_dist"]:
            req = Requirement(text)
            if _applies(req, env, extras):
                todo.append((canonicalize_name(req.name), set(req.extras)))
    return seen


def project_requirements(extras: str) -> list[str]:
    """ppoforge's own dependencies with those of `extras`, as pyproject.toml declares them."""
    sys.path.insert(0, str(ROOT / "tools"))
    from floor_constraints import direct_requirements

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return direct_requirements(project, extras.split(","))


def resolve(requirements: list[str], python: str) -> dict:
    """pip's installation report for `requirements` on CPython `python`, from scratch, installing nothing."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                        "--only-binary=:all:", "--python-version", python, "--target", str(Path(tmp) / "t"),
                        "--report", str(report), *requirements], check=True)
        return json.loads(report.read_text())


def lock(report: dict, roots: list[Requirement], meta: dict) -> tuple[list[str], list[str], dict]:
    """(pins, base pins, metadata): the base is torch and whatever only torch needs."""
    env = report["environment"]
    packages = {canonicalize_name(item["metadata"]["name"]): {
        "version": item["metadata"]["version"], "requires_dist": item["metadata"].get("requires_dist") or []}
        for item in report["install"]}
    needed = needed_without_torch(packages, [r for r in roots if _applies(r, env, set())], env)
    pins = sorted(f"{n}=={p['version']}" for n, p in packages.items() if n in needed and n != "torch")
    base = sorted(f"{n}=={p['version']}" for n, p in packages.items() if n not in needed or n == "torch")
    return pins, base, {**meta, "environment": env, "packages": packages}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch", default="2.6.0", help="the base image's torch version (default 2.6.0)")
    parser.add_argument("--python", default="3.11.2", help="the oldest Python of the bases (default 3.11.2, "
                        "Debian bookworm's; the official 2.6 image has a newer 3.11)")
    parser.add_argument("--extras", default="lm,notebook", help="ppoforge extras to lock (default lm,notebook)")
    parser.add_argument("--out", default="docker/requirements-torch2.6.txt", help="the lock file to write")
    args = parser.parse_args(argv)
    if platform.machine() != "x86_64" or sys.platform != "linux":
        raise SystemExit("run this on Linux x86_64 (the image's platform), or the platform markers differ")
    project = project_requirements(args.extras)
    requirements = [f"torch=={args.torch}", BUILD_REQUIRES] + [r for r in project if not r.startswith("torch")]
    report = resolve(requirements, args.python)
    report["environment"].update(python_full_version=args.python, python_version=args.python.rsplit(".", 1)[0])
    meta = {"torch": args.torch, "python": args.python, "extras": args.extras.split(","), "requirements": project}
    pins, base, meta = lock(report, [Requirement(r) for r in requirements], meta)
    out = ROOT / args.out
    command = (f"python tools/container_lock.py --torch {args.torch} --python {args.python} --extras {args.extras} "
               f"--out {args.out}")
    header = [f"# ppoforge[{args.extras}] resolved with torch=={args.torch} pinned, for CPython {args.python}+ "
              "on Linux x86_64.", f"# Generated by: {command}",
              "# Installed by docker/Dockerfile with: pip install --no-deps -r THIS_FILE",
              "# Provided by the base image and not installed from here (the build checks torch is unchanged):"]
    out.write_text("\n".join(header + [f"# base: {b}" for b in base] + pins) + "\n")
    out.with_suffix(".meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    print(f"{out.relative_to(ROOT)}: {len(pins)} pins, {len(base)} from the base image")


if __name__ == "__main__":
    main(sys.argv[1:])
