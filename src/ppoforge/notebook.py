"""`ppoforge notebook`: JupyterLab with authentication always on, on 127.0.0.1 unless told otherwise.

Published recipes for GPU boxes start Jupyter with an empty token on 0.0.0.0 as root: remote code
execution for anyone who reaches the port. Here every launch is authenticated (a token, generated or
given, or an argon2 password hash), and the settings that open a server up (an empty secret, a `*`
CORS origin, XSRF checks off, root without asking) are refused with one line and exit code 2.

Design: `plan()` is a pure function from the options to the exact jupyter argv and environment, so the
policy is unit-tested without starting a server; `launch()` only prints and execs it (the server becomes
the process, so SIGTERM from tini or `docker stop` reaches it directly). The token travels in the
child's environment (JUPYTER_TOKEN, readable by this user only), never on the command line, where
`ps` shows it to every user of a shared machine.

Option names are not enough: a `--config` file, a `jupyter_server_config` in JUPYTER_CONFIG_DIR or
~/.jupyter, or `--ServerApp.tornado_settings=...` can set an empty token or switch XSRF off under
another name. So the exec'd process is this module (`serve`): it configures JupyterLab exactly as
`jupyter lab` would, checks the settings the server ended up with (`check_server`), and only then
starts it listening. A Jupyter config file is Python: the check catches one that turns a protection
off, not one written to subvert Jupyter itself.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import secrets
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ppoforge.errors import UserError

TOKEN_ENV = "PPOFORGE_NOTEBOOK_TOKEN"
TOKEN_FILE_ENV = "PPOFORGE_NOTEBOOK_TOKEN_FILE"
PASSWORD_HASH_ENV = "PPOFORGE_NOTEBOOK_PASSWORD_HASH"
MIN_TOKEN_CHARS = 16
WIDE_HOSTS = ("0.0.0.0", "::", "*", "")
NEW_TOKEN = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"
NEW_HASH = "python -c 'from jupyter_server.auth import passwd; print(passwd())'"
INSTALL_FIX = "pip install 'ppoforge[notebook]'"

# Jupyter options that decide who can get in: set through this command's own checked flags only.
_OWN_FLAGS = {"token": "--token-file or $" + TOKEN_ENV, "password": "--password-hash",
              "hashed_password": "--password-hash", "ip": "--ip", "allow_origin": "--allow-origin",
              "allow_origin_pat": "--allow-origin (one exact origin)", "allow_root": "--allow-root",
              "password_required": "--password-hash"}
_PASSTHROUGH = re.compile(r"^--(?:[A-Za-z]\w*\.)?(\w+)(?:=(.*))?$")


@dataclass
class NotebookOptions:
    ip: str = "127.0.0.1"
    port: int = 8888
    root_dir: str = "."
    token_file: str | None = None
    password_hash: str | None = None
    allow_origin: str = ""
    allow_root: bool = False
    extra: list[str] = field(default_factory=list)  # passed to jupyter lab after the checks


@dataclass
class Launch:
    argv: list[str]
    env: dict[str, str]
    auth: str            # "token" or "password"
    token: str | None    # the token, to print once, when this command generated it
    token_source: str    # where the token came from, for the banner
    warnings: list[str]


def _read_token(opts: NotebookOptions, env: dict[str, str]) -> tuple[str, str, bool]:
    """(token, where it came from, generated?): --token-file, $PPOFORGE_NOTEBOOK_TOKEN, else a new one."""
    path = opts.token_file or env.get(TOKEN_FILE_ENV)
    if path:
        try:
            token = Path(path).read_text().strip()
        except OSError as e:
            raise UserError(f"notebook: cannot read the token file {path}: {e.strerror}; allowed: a readable "
                            f"file holding one token of >= {MIN_TOKEN_CHARS} characters") from None
        source = f"the file {path}"
    elif TOKEN_ENV in env:
        token, source = env[TOKEN_ENV].strip(), f"${TOKEN_ENV}"
    else:
        return secrets.token_urlsafe(32), "generated for this launch", True
    if len(token) < MIN_TOKEN_CHARS:
        what = "is empty" if not token else f"has {len(token)} characters"
        raise UserError(f"notebook: the token from {source} {what}: an empty or short token lets anyone in; "
                        f"allowed: >= {MIN_TOKEN_CHARS} characters, e.g. {NEW_TOKEN}")
    return token, source, False


def _check_password_hash(text: str) -> str:
    text = text.strip()
    if not text:
        raise UserError(f"notebook: the password hash is empty: that is no password; allowed: an argon2 hash "
                        f"from {NEW_HASH}")
    if not text.startswith("argon2:"):
        raise UserError(f"notebook: the password hash {text.split(':')[0]!r}:... is not argon2 (sha1 hashes are "
                        f"cracked in seconds); allowed: 'argon2:...' from {NEW_HASH}")
    return text


def _check_extra(extra: list[str]) -> None:
    """Pass-through jupyter options may not touch authentication or turn a protection off."""
    for arg in extra:
        m = _PASSTHROUGH.match(arg)
        if not m:
            continue
        name, value = m.group(1), (m.group(2) or "true").strip().lower()
        if name == "disable_check_xsrf" and value not in ("false", "0"):
            raise UserError("notebook: disabling XSRF protection is refused (any web page you visit could run "
                            "code on this server); allowed: leave ServerApp.disable_check_xsrf off")
        if name in _OWN_FLAGS:
            raise UserError(f"notebook: {arg.split('=')[0]} is set by ppoforge notebook itself, with checks; "
                            f"allowed: use {_OWN_FLAGS[name]}")


def _check_origin(origin: str) -> None:
    if origin.strip() == "*":
        raise UserError("notebook: --allow-origin '*' lets every web site call this server's API (with your "
                        "cookies); allowed: one exact origin such as https://lab.example.com, or none")


def wide_warning(ip: str, port: int) -> str:
    return (f"ppoforge notebook: warning: binding {ip or '*'} listens on every network interface; anyone who "
            f"reaches port {port} meets the login page. Inside a container publish it on 127.0.0.1 only "
            f"(-p 127.0.0.1:{port}:{port}); on a host prefer --ip 127.0.0.1 and an SSH tunnel from your "
            f"laptop: ssh -L {port}:localhost:{port} user@host")


def plan(opts: NotebookOptions, env: dict[str, str], euid: int) -> Launch:
    """The jupyter lab command and environment for these options, or a UserError saying what is unsafe."""
    _check_origin(opts.allow_origin)
    _check_extra(opts.extra)
    warnings = []
    if euid == 0:
        if not opts.allow_root:
            raise UserError("notebook: refusing to run Jupyter as root (uid 0): a notebook is a shell for "
                            "whoever logs in; allowed: run as a normal user (docker run --user 1000:1000), "
                            "or pass --allow-root")
        warnings.append("ppoforge notebook: warning: running as root (--allow-root): whoever logs in owns "
                        "this machine or container")
    if opts.ip.strip() in WIDE_HOSTS:
        warnings.append(wide_warning(opts.ip, opts.port))
    child_env = {k: v for k, v in env.items() if k not in ("JUPYTER_TOKEN", "JUPYTER_TOKEN_FILE")}
    argv = [sys.executable, "-m", "ppoforge.notebook", f"--ServerApp.ip={opts.ip}", f"--ServerApp.port={opts.port}",
            "--ServerApp.port_retries=0", "--ServerApp.open_browser=False",
            f"--ServerApp.root_dir={opts.root_dir}"]
    password_hash = opts.password_hash if opts.password_hash is not None else env.get(PASSWORD_HASH_ENV)
    if password_hash is not None:
        argv += [f"--PasswordIdentityProvider.hashed_password={_check_password_hash(password_hash)}",
                 "--PasswordIdentityProvider.password_required=True"]
        token, source, generated, auth = None, "none (password login)", False, "password"
    else:
        token, source, generated = _read_token(opts, env)
        child_env["JUPYTER_TOKEN"] = token
        auth = "token"
    if opts.allow_origin:
        argv.append(f"--ServerApp.allow_origin={opts.allow_origin}")
    if opts.allow_root:
        argv.append("--ServerApp.allow_root=True")
    return Launch(argv + list(opts.extra), child_env, auth, token if generated else None, source, warnings)


def banner(launch: Launch, opts: NotebookOptions) -> str:
    host = "127.0.0.1" if opts.ip.strip() in WIDE_HOSTS else opts.ip
    url = f"http://{host}:{opts.port}/lab"
    if launch.auth == "password":
        return f"ppoforge notebook: JupyterLab at {url} (password login)"
    if launch.token is not None:
        return (f"ppoforge notebook: JupyterLab at {url}?token={launch.token}\n"
                f"ppoforge notebook: this token was generated for this launch and is printed only here")
    return f"ppoforge notebook: JupyterLab at {url} (token from {launch.token_source})"


def launch(opts: NotebookOptions) -> None:
    """Check, print the URL once, and become the JupyterLab server (`serve`, which checks it once more)."""
    if importlib.util.find_spec("jupyterlab") is None:
        raise UserError(f"notebook: JupyterLab is not installed; fix: {INSTALL_FIX}")
    if not 1 <= opts.port <= 65535:
        raise UserError(f"notebook: --port {opts.port} is out of range; allowed: 1-65535")
    if not Path(opts.root_dir).is_dir():
        raise UserError(f"notebook: --root-dir {opts.root_dir} is not a directory; allowed: an existing folder")
    todo = plan(opts, dict(os.environ), os.geteuid())
    for line in todo.warnings:
        print(line, file=sys.stderr)
    print(banner(todo, opts), flush=True)
    sys.stderr.flush()
    os.execve(todo.argv[0], todo.argv, todo.env)


_SET_BY = ("Jupyter's configuration (a pass-through option, a --config file, or jupyter_server_config in "
           "JUPYTER_CONFIG_DIR or ~/.jupyter)")


def _auth_problem(identity) -> str | None:
    from jupyter_server.auth.identity import PasswordIdentityProvider  # optional extra (ppoforge[notebook])

    if not isinstance(identity, PasswordIdentityProvider):
        return (f"{_SET_BY} replaces Jupyter's login with {type(identity).__name__}; allowed: Jupyter's own token "
                "or password login")
    token, hashed = identity.token or "", identity.hashed_password or ""
    if hashed and not hashed.startswith("argon2:"):
        return f"{_SET_BY} sets a password hash that is not argon2; allowed: --password-hash 'argon2:...'"
    if not hashed and len(token) < MIN_TOKEN_CHARS:
        what = "no token and no password" if not token else f"a token of {len(token)} characters"
        return f"{_SET_BY} leaves {what}: anyone who reaches the port gets in; allowed: --token-file or --password-hash"
    return None


def check_server(app) -> None:
    """Refuse a configured, not yet listening Jupyter server whose effective settings open it up: no (or
    a short) token and no password, XSRF checks off, any origin allowed. Whatever set them."""
    settings = app.web_app.settings
    problem = _auth_problem(app.identity_provider)
    if problem is None and (settings.get("disable_check_xsrf") or not settings.get("xsrf_cookies", True)):
        problem = (f"{_SET_BY} switches XSRF protection off (any web page you visit could run code on this "
                   "server); allowed: leave disable_check_xsrf and xsrf_cookies as they are")
    headers = settings.get("headers") or {}
    if problem is None and ("*" in (settings.get("allow_origin"), headers.get("Access-Control-Allow-Origin"))
                            or settings.get("allow_origin_pat")):
        problem = (f"{_SET_BY} lets other web sites call this server's API (allow_origin '*', allow_origin_pat "
                   "or an Access-Control-Allow-Origin header); allowed: --allow-origin with one exact origin")
    if problem:
        raise UserError(f"notebook: {problem}")


class _Held:
    refused: str = ""


@contextlib.contextmanager
def _held_stderr():
    """File descriptor 2 goes to a temp file inside the block (Jupyter's log handler keeps writing to the
    same fd afterwards, so no handler is left pointing at a buffer); then its content is written to the
    real stderr — or, when `refused` is set, that line alone."""
    held, saved = _Held(), os.dup(2)
    with tempfile.TemporaryFile() as buffer:
        sys.stderr.flush()
        os.dup2(buffer.fileno(), 2)
        try:
            yield held
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            buffer.seek(0)
            sys.stderr.write(held.refused or buffer.read().decode(errors="replace"))
            sys.stderr.flush()


def serve(argv: list[str]) -> int:
    """The exec'd server process: JupyterLab configured from `argv` and its config files as `jupyter lab`
    configures it, checked, then started (the port opens only in `start`)."""
    # optional extra (ppoforge[notebook]): only the exec'd server process imports Jupyter
    from jupyter_core.application import NoStart
    from jupyterlab.labapp import LabApp

    with _held_stderr() as held:  # Jupyter's start-up log: shown once the server passed, else only the refusal
        app = LabApp.initialize_server(argv=argv)
        try:
            check_server(app)
        except UserError as e:
            held.refused = f"ppoforge: error: {e}\n"
    if held.refused:
        return 2
    with contextlib.suppress(NoStart):  # what `jupyter lab` does too
        app.start()
    return 0


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1:]))
