"""Security: running as root, and Jupyter servers (running or configured) that anyone can use.

Jupyter is not required: running servers are found through their runtime files (jpserver-*.json,
nbserver-*.json, what `jupyter server list --json` reads) and configured ones through
jupyter_server_config / jupyter_notebook_config (.py or .json) in the config dir. A server with neither
a token nor a password is a `fail`: on a GPU box that is remote code execution for anyone who can reach
the port, worse when it is bound to 0.0.0.0.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ppoforge.doctor.report import CheckResult, fail, ok, skip, warn
from ppoforge.doctor.versions import installed_version

WIDE_HOSTS = ("0.0.0.0", "::", "*", "")
JUPYTER_FIX = ("give it a token or password (jupyter server password; never c.ServerApp.token = '') and bind "
               "it to localhost (--ServerApp.ip=127.0.0.1), then reach it with ssh -L 8888:localhost:8888")


def check_root(uid: int) -> CheckResult:
    if uid == 0:
        return warn("root", "running as root (uid 0): a bad path or a hostile pickle costs the whole machine",
                    "run as a normal user: docker run --user $(id -u):$(id -g), or USER in the Dockerfile")
    return ok("root", f"running as uid {uid}")


@dataclass
class JupyterServer:
    source: str      # the runtime or config file
    host: str        # the ip it listens on ('' = every interface)
    token: bool
    password: bool

    @property
    def open(self) -> bool:
        return not (self.token or self.password)


def runtime_dirs(env: dict[str, str], home: Path) -> list[Path]:
    data = Path(env["JUPYTER_DATA_DIR"]) if env.get("JUPYTER_DATA_DIR") else None
    xdg = Path(env.get("XDG_DATA_HOME") or home / ".local" / "share") / "jupyter"
    dirs = [Path(env["JUPYTER_RUNTIME_DIR"])] if env.get("JUPYTER_RUNTIME_DIR") else []
    dirs += [d / "runtime" for d in (data, xdg, home / "Library" / "Jupyter") if d is not None]
    return list(dict.fromkeys(dirs))


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError, TypeError):
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def read_servers(dirs: list[Path]) -> list[JupyterServer]:
    """Running servers from their runtime files; files of dead processes are skipped."""
    servers = []
    for d in dirs:
        for path in sorted(d.glob("jpserver-*.json")) + sorted(d.glob("nbserver-*.json")):
            try:
                info = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if "pid" in info and not _alive(info["pid"]):
                continue
            servers.append(JupyterServer(str(path), str(info.get("hostname", "")), bool(info.get("token")),
                                         bool(info.get("password"))))
    return servers


_ASSIGN = re.compile(r"^c\.(\w+)\.(token|password|hashed_password|ip)\s*=\s*(['\"])(.*?)\3")


def parse_config_py(text: str) -> dict[str, str]:
    """{'token': ..., 'password': ..., 'ip': ...} from the `c.X.key = '...'` lines of a config .py."""
    found = {}
    for line in text.splitlines():
        m = _ASSIGN.match(line.strip())
        if m:
            found["password" if m.group(2) == "hashed_password" else m.group(2)] = m.group(4)
    return found


def parse_config_json(text: str) -> dict[str, str]:
    found = {}
    for section in json.loads(text).values():
        if isinstance(section, dict):
            for key in ("token", "password", "hashed_password", "ip"):
                if isinstance(section.get(key), str):
                    found["password" if key == "hashed_password" else key] = section[key]
    return found


def read_configs(config_dir: Path, env: dict[str, str]) -> list[JupyterServer]:
    """Configured servers; only files that set a token, password or ip say anything."""
    servers = []
    for stem in ("jupyter_server_config", "jupyter_notebook_config", "jupyter_lab_config"):
        for suffix, parse in ((".py", parse_config_py), (".json", parse_config_json)):
            path = config_dir / f"{stem}{suffix}"
            try:
                found = parse(path.read_text())
            except (OSError, ValueError):
                continue
            if found:
                token = found.get("token", env.get("JUPYTER_TOKEN") or "generated") != ""
                servers.append(JupyterServer(str(path), found.get("ip", "localhost"), token,
                                             bool(found.get("password"))))
    return servers


def _describe(s: JupyterServer) -> str:
    auth = "token" if s.token else ("password" if s.password else "NO token and NO password")
    host = "every interface" if s.host in WIDE_HOSTS else s.host
    return f"{s.source}: {host}, {auth}"


def check_jupyter(running: list[JupyterServer], configured: list[JupyterServer],
                  installed: str | None) -> CheckResult:
    name = "jupyter"
    everything = running + configured
    evidence = (f"Jupyter {installed or 'not installed'}; {len(running)} running server(s)"
                + "".join(f"; {_describe(s)}" for s in everything))
    bad = [s for s in everything if s.open]
    if bad:
        wide = any(s.host in WIDE_HOSTS for s in bad)
        who = "anyone who reaches the port" if wide else "any local user or forwarded port"
        return fail(name, f"{evidence}; {who} runs code as this user", JUPYTER_FIX)
    if not installed and not everything:
        return skip(name, "no Jupyter installed, running or configured "
                    "(pip install jupyterlab for notebook access)")
    return ok(name, evidence)


def gather_jupyter() -> tuple[list[JupyterServer], list[JupyterServer], str | None]:
    env, home = dict(os.environ), Path.home()
    config_dir = Path(env.get("JUPYTER_CONFIG_DIR") or home / ".jupyter")
    installed = next((f"{d} {v}" for d in ("jupyter_server", "notebook")
                      if (v := installed_version(d))), None)
    return read_servers(runtime_dirs(env, home)), read_configs(config_dir, env), installed
