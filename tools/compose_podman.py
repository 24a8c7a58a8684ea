"""Run one service of docker/compose.yaml with podman, as `docker compose up SERVICE` would start it.

    python3 tools/compose_podman.py notebook --name nb-test --project ppoforge-ci -- --detach

For `make test-container`: this machine has podman but no compose, and the test must exercise the
compose file itself (its ports, volumes, ipc, ulimits, environment, command), not a second copy of it.
Design: only the keys docker/compose.yaml uses are translated, and any other key is an error, so a
setting added to the compose file can never be dropped here in silence. The GPU reservation becomes
`--device nvidia.com/gpu=all` (CDI) with --gpus, and is reported as skipped without it. Needs PyYAML.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

COMPOSE = Path(__file__).resolve().parents[1] / "docker" / "compose.yaml"
_VAR = re.compile(r"\$\{(\w+)(?:(:?[-?])([^}]*))?\}")
IGNORED = {"build": "built beforehand", "restart": "a test run is never restarted"}


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error} and ${VAR?error}."""
    def one(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2) or "", m.group(3) or ""
        value = env.get(name)
        missing = value is None or (op.startswith(":") and value == "")
        if op.endswith("?") and missing:
            raise SystemExit(f"compose: {name}: {arg or 'must be set'}")
        return arg if op.endswith("-") and missing else (value or "")
    return _VAR.sub(one, text)


def _walk(node, env):
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_walk(n, env) for n in node]
    if isinstance(node, dict):
        return {k: _walk(v, env) for k, v in node.items()}
    return node


def _volume(spec: str, project: str, here: Path) -> str:
    source, _, rest = spec.partition(":")
    if source.startswith((".", "/", "~")):  # a bind mount, relative to the compose file's folder
        return f"{(here / Path(source).expanduser()).resolve()}:{rest}"
    return f"{project}_{source}:{rest}"  # a named volume, prefixed like compose does


def _ulimit(name: str, value) -> str:
    soft, hard = (value["soft"], value["hard"]) if isinstance(value, dict) else (value, value)
    return f"--ulimit={name}={soft}:{hard}"


def run_args(service: dict, project: str, here: Path, gpus: bool, env: dict[str, str],
             ulimit_caps: dict[str, int] | None = None) -> list[str]:
    """podman run arguments (after `run`, before the image) for one compose service. `ulimit_caps` lowers
    a ulimit this host refuses to raise (unprivileged: no CAP_SYS_RESOURCE), saying so on stderr."""
    args, service, caps = [], dict(service), ulimit_caps or {}
    for key in [k for k in service if k in IGNORED]:
        print(f"compose_podman: {key}: ignored ({IGNORED[key]})", file=sys.stderr)
        service.pop(key)
    args += [f"--publish={p}" for p in service.pop("ports", [])]
    args += [f"--volume={_volume(v, project, here)}" for v in service.pop("volumes", [])]
    args += [f"--env={e}" for e in service.pop("environment", []) if "=" in e or e in env]
    if "ipc" in service:
        args.append(f"--ipc={service.pop('ipc')}")
    for name, value in service.pop("ulimits", {}).items():
        if name in caps:
            print(f"compose_podman: ulimit {name}: {value} lowered to {caps[name]} (this host refuses more)",
                  file=sys.stderr)
            value = caps[name]
        args.append(_ulimit(name, value))
    if "stop_grace_period" in service:
        grace = service.pop("stop_grace_period")
        args.append(f"--stop-timeout={int(grace[:-1]) * (60 if grace.endswith('m') else 1)}")
    devices = service.pop("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    if any(d.get("driver") == "nvidia" for d in devices):
        if gpus:
            args.append("--device=nvidia.com/gpu=all")
        else:
            print("compose_podman: deploy: GPU reservation skipped (no --gpus)", file=sys.stderr)
    image, command = service.pop("image"), service.pop("command", [])
    if service:
        raise SystemExit(f"compose_podman: keys not translated: {', '.join(sorted(service))}; add them here")
    return args + [image] + list(command)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("service")
    parser.add_argument("--file", default=str(COMPOSE))
    parser.add_argument("--project", default=None, help="prefix of named volumes (default: the file's name:)")
    parser.add_argument("--name", help="container name")
    parser.add_argument("--gpus", action="store_true", help="pass the GPU reservation on as a CDI device")
    parser.add_argument("--cap-ulimit", action="append", default=[], metavar="NAME=VALUE",
                        help="lower a compose ulimit this host cannot grant (e.g. memlock=8388608)")
    parser.add_argument("--print", action="store_true", help="print the podman command instead of running it")
    cut = argv.index("--") if "--" in argv else len(argv)
    args, extra = parser.parse_args(argv[:cut]), argv[cut + 1:]  # after --: more podman run options
    env = dict(os.environ)
    compose = _walk(yaml.safe_load(Path(args.file).read_text()), env)
    service = {k: v for k, v in compose["services"][args.service].items() if k != "<<"}
    project = args.project or compose.get("name", "ppoforge")
    podman = shlex.split(env.get("PODMAN", "podman"))
    name = [f"--name={args.name}"] if args.name else []
    caps = {k: int(v) for k, v in (c.split("=", 1) for c in args.cap_ulimit)}
    here = Path(args.file).resolve().parent
    cmd = podman + ["run"] + name + extra + run_args(service, project, here, args.gpus, env, caps)
    if args.print:
        print(shlex.join(cmd))
        return 0
    return subprocess.call(cmd)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
