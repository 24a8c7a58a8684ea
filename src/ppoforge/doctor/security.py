"""Security: running as root, and Jupyter servers (running or configured) that anyone can use.

Jupyter is not required: running servers are found through their runtime files (jpserver-*.json,
nbserver-*.json, what `jupyter server list --json` reads) plus the command line of their live process
(/proc/PID/cmdline: a password, a CORS origin or XSRF switched off are set there and the runtime file
does not record them), and configured ones through jupyter_server_config / jupyter_notebook_config
(.py or .json) in the config dir. A server with neither a token nor a password, with allow_origin '*'
or with XSRF checks disabled is a `fail`: on a GPU box that is remote code execution for anyone who can
reach the port (or, for the last two, for any web page its user visits). `ppoforge notebook` starts
servers that pass.
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
JUPYTER_FIX = ("start it with ppoforge notebook (a token, 127.0.0.1, XSRF on), or give it a token or password "
               "(jupyter server password; never c.ServerApp.token = ''), no allow_origin '*', no "
               "disable_check_xsrf, bind it to localhost (--ServerApp.ip=127.0.0.1) and reach it with ssh -L "
               "8888:localhost:8888")


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
    allow_origin: str = ""   # ServerApp.allow_origin ('*' = every web site may call the API)
    xsrf_off: bool = False   # ServerApp.disable_check_xsrf

    @property
    def open(self) -> bool:
        return not (self.token or self.password)

    def problems(self) -> list[str]:
        return ((["NO token and NO password"] if self.open else [])
                + (["allow_origin '*'"] if self.allow_origin.strip() == "*" else [])
                + (["XSRF checks disabled"] if self.xsrf_off else []))


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


_FLAG = re.compile(r"^--(?:\w+\.)?(token|password|hashed_password|ip|allow_origin|disable_check_xsrf)(?:=(.*))?$")
_TRUE = ("true", "1", "yes")


def parse_cmdline(argv: list[str]) -> dict[str, str]:
    """The security settings a jupyter command line gives: `--ServerApp.allow_origin=*`, `--ip 0.0.0.0`, ..."""
    found = {}
    for i, arg in enumerate(argv):
        m = _FLAG.match(arg)
        if not m:
            continue
        value = m.group(2)
        if value is None:  # `--key value`, or a bare boolean flag
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            value = "true" if m.group(1) == "disable_check_xsrf" and nxt.startswith("-") else nxt
        found["password" if m.group(1) == "hashed_password" else m.group(1)] = value
    return found


def _cmdline(pid) -> list[str]:
    try:
        return Path(f"/proc/{int(pid)}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except (OSError, ValueError, TypeError):
        return []


def read_servers(dirs: list[Path]) -> list[JupyterServer]:
    """Running servers from their runtime files and command lines; files of dead processes are skipped."""
    servers = []
    for d in dirs:
        for path in sorted(d.glob("jpserver-*.json")) + sorted(d.glob("nbserver-*.json")):
            try:
                info = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if "pid" in info and not _alive(info["pid"]):
                continue
            flags = parse_cmdline(_cmdline(info.get("pid")))
            servers.append(JupyterServer(str(path), str(info.get("hostname", "")), bool(info.get("token")),
                                         bool(info.get("password") or flags.get("password")),
                                         flags.get("allow_origin", ""),
                                         flags.get("disable_check_xsrf", "").lower() in _TRUE))
    return servers


_ASSIGN = re.compile(r"^c\.(\w+)\.(token|password|hashed_password|ip|allow_origin)\s*=\s*(['\"])(.*?)\3")
_XSRF = re.compile(r"^c\.\w+\.disable_check_xsrf\s*=\s*(True|False)\b")


def parse_config_py(text: str) -> dict[str, str]:
    """{'token': ..., 'password': ..., 'ip': ..., 'allow_origin': ..., 'disable_check_xsrf': 'True'} from the
    `c.X.key = ...` lines of a config .py."""
    found = {}
    for line in text.splitlines():
        m = _ASSIGN.match(line.strip())
        if m:
            found["password" if m.group(2) == "hashed_password" else m.group(2)] = m.group(4)
        xsrf = _XSRF.match(line.strip())
        if xsrf:
            found["disable_check_xsrf"] = xsrf.group(1)
    return found


def parse_config_json(text: str) -> dict[str, str]:
    found = {}
    for section in json.loads(text).values():
        if isinstance(section, dict):
            for key in ("token", "password", "hashed_password", "ip", "allow_origin"):
                if isinstance(section.get(key), str):
                    found["password" if key == "hashed_password" else key] = section[key]
            if isinstance(section.get("disable_check_xsrf"), bool):
                found["disable_check_xsrf"] = str(section["disable_check_xsrf"])
    return found


def read_configs(config_dir: Path, env: dict[str, str]) -> list[JupyterServer]:
    """Configured servers; only files that set a token, password, ip, allow_origin or XSRF say anything."""
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
                                             bool(found.get("password")), found.get("allow_origin", ""),
                                             found.get("disable_check_xsrf", "").lower() in _TRUE))
    return servers


def _describe(s: JupyterServer) -> str:
    auth = "token" if s.token else ("password" if s.password else "NO token and NO password")
    host = "every interface" if s.host in WIDE_HOSTS else s.host
    return f"{s.source}: {host}, {auth}" + "".join(f", {p}" for p in s.problems() if not p.startswith("NO "))


def check_jupyter(running: list[JupyterServer], configured: list[JupyterServer],
                  installed: str | None) -> CheckResult:
    name = "jupyter"
    everything = running + configured
    evidence = (f"Jupyter {installed or 'not installed'}; {len(running)} running server(s)"
                + "".join(f"; {_describe(s)}" for s in everything))
    bad = [s for s in everything if s.problems()]
    if any(s.open for s in bad):
        wide = any(s.host in WIDE_HOSTS for s in bad if s.open)
        who = "anyone who reaches the port" if wide else "any local user or forwarded port"
        return fail(name, f"{evidence}; {who} runs code as this user", JUPYTER_FIX)
    if bad:
        return fail(name, f"{evidence}; any web page this user opens can call the server's API and run code",
                    JUPYTER_FIX)
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
