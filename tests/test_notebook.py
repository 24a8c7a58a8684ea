"""`ppoforge notebook`: the launch plan refuses every unsafe setting, and a real server demands its token."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from ppoforge.cli import main
from ppoforge.errors import UserError
from ppoforge.notebook import TOKEN_ENV, NotebookOptions, plan

TOKEN = "a-token-of-enough-length-0123456789"
ARGON2 = "argon2:$argon2id$v=19$m=10240,t=10,p=8$c2FsdA$aGFzaA"


def _flags(launch) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in launch.argv[3:] if "=" in a)


def test_default_is_a_fresh_random_token_on_localhost_passed_in_the_environment():
    a, b = plan(NotebookOptions(), {}, euid=1000), plan(NotebookOptions(), {}, euid=1000)
    assert a.argv[1:3] == ["-m", "ppoforge.notebook"] and _flags(a)["ServerApp.ip"] == "127.0.0.1"
    assert a.auth == "token" and a.token == a.env["JUPYTER_TOKEN"] and len(a.token) >= 32
    assert a.token != b.token
    assert not any(a.token in arg for arg in a.argv)  # never on the command line, where ps shows it
    assert a.warnings == [] and "ServerApp.allow_root" not in _flags(a)


def test_token_from_the_environment_or_a_file_is_used_and_not_printed(tmp_path):
    launch = plan(NotebookOptions(), {TOKEN_ENV: TOKEN, "JUPYTER_TOKEN_FILE": "/elsewhere"}, euid=1000)
    assert launch.env["JUPYTER_TOKEN"] == TOKEN and launch.token is None and "JUPYTER_TOKEN_FILE" not in launch.env
    (tmp_path / "token").write_text(TOKEN + "\n")
    launch = plan(NotebookOptions(token_file=str(tmp_path / "token")), {TOKEN_ENV: "x" * 40}, euid=1000)
    assert launch.env["JUPYTER_TOKEN"] == TOKEN and str(tmp_path / "token") in launch.token_source


@pytest.mark.parametrize("env, match", [
    ({TOKEN_ENV: ""}, "is empty"),
    ({TOKEN_ENV: "short"}, "has 5 characters"),
])
def test_empty_or_short_tokens_are_refused(env, match):
    with pytest.raises(UserError, match=match):
        plan(NotebookOptions(), env, euid=1000)


def test_empty_token_file_and_missing_file_are_refused(tmp_path):
    (tmp_path / "t").write_text("\n")
    with pytest.raises(UserError, match="is empty"):
        plan(NotebookOptions(token_file=str(tmp_path / "t")), {}, euid=1000)
    with pytest.raises(UserError, match="cannot read the token file"):
        plan(NotebookOptions(token_file=str(tmp_path / "missing")), {}, euid=1000)


def test_password_hash_must_be_argon2_and_not_empty():
    launch = plan(NotebookOptions(password_hash=ARGON2), {TOKEN_ENV: TOKEN}, euid=1000)
    assert launch.auth == "password" and "JUPYTER_TOKEN" not in launch.env
    assert _flags(launch)["PasswordIdentityProvider.hashed_password"] == ARGON2
    for bad, match in (("", "is empty"), ("sha1:abc:def", "not argon2")):
        with pytest.raises(UserError, match=match):
            plan(NotebookOptions(password_hash=bad), {}, euid=1000)


def test_any_origin_xsrf_off_and_auth_passthrough_are_refused():
    with pytest.raises(UserError, match="'\\*' lets every web site"):
        plan(NotebookOptions(allow_origin="*"), {}, euid=1000)
    for extra, match in ((["--ServerApp.disable_check_xsrf=True"], "XSRF"),
                         (["--ServerApp.disable_check_xsrf"], "XSRF"),
                         (["--ServerApp.token="], "--token-file"),
                         (["--IdentityProvider.token=abc"], "--token-file"),
                         (["--ServerApp.ip=0.0.0.0"], "use --ip"),
                         (["--ServerApp.allow_origin_pat=.*"], "--allow-origin")):
        with pytest.raises(UserError, match=match):
            plan(NotebookOptions(extra=extra), {}, euid=1000)
    launch = plan(NotebookOptions(allow_origin="https://lab.example.com",
                                  extra=["--ServerApp.disable_check_xsrf=False"]), {}, euid=1000)
    assert _flags(launch)["ServerApp.allow_origin"] == "https://lab.example.com"


def test_wide_binding_warns_with_the_ssh_tunnel_and_root_needs_asking():
    launch = plan(NotebookOptions(ip="0.0.0.0", port=9999), {}, euid=1000)
    assert len(launch.warnings) == 1 and "ssh -L 9999:localhost:9999 user@host" in launch.warnings[0]
    with pytest.raises(UserError, match="refusing to run Jupyter as root"):
        plan(NotebookOptions(), {}, euid=0)
    launch = plan(NotebookOptions(allow_root=True), {}, euid=0)
    assert _flags(launch)["ServerApp.allow_root"] == "True" and "running as root" in launch.warnings[0]


def test_cli_refusals_are_one_line_and_exit_2(capsys, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "")
    assert main(["notebook", "--allow-root"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ppoforge: error: notebook: the token from $PPOFORGE_NOTEBOOK_TOKEN is empty")
    assert "\n" not in err and "allowed:" in err
    monkeypatch.delenv(TOKEN_ENV)
    assert main(["notebook", "--allow-root", "--allow-origin", "*"]) == 2
    assert "'*'" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, headers: dict | None = None) -> tuple[int, str]:
    """(status, Location) without following redirects."""
    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):
            return None

    opener = urllib.request.build_opener(NoRedirect)
    try:
        with opener.open(urllib.request.Request(url, headers=headers or {}), timeout=5) as r:
            return r.status, ""
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Location", "")


def _wait_until_up(url: str, proc: subprocess.Popen, deadline: float) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"ppoforge notebook exited with {proc.returncode}")
        try:
            _get(url)
            return
        except OSError:
            time.sleep(0.3)
    raise AssertionError("ppoforge notebook did not answer within 40 s")


def _jupyter_env(tmp_path) -> dict[str, str]:
    return {**os.environ, TOKEN_ENV: TOKEN, "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
            "JUPYTER_CONFIG_DIR": str(tmp_path / "config"), "JUPYTER_DATA_DIR": str(tmp_path / "data"),
            "HOME": str(tmp_path)}


def _launch(tmp_path, port: int, env: dict, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ppoforge.cli", "notebook", "--port", str(port), "--root-dir", str(tmp_path)]
    cmd += ["--allow-root"] if os.geteuid() == 0 else []
    return subprocess.Popen(cmd + list(extra), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("case", ["config-file-empty-token", "tornado-settings-xsrf-off", "user-config-dir"])
def test_a_real_launch_refuses_settings_that_switch_a_protection_off_however_they_are_given(tmp_path, case):
    """The server's effective settings are checked before it listens: a --config file with an empty token,
    XSRF off through tornado_settings, or a jupyter_server_config.json in JUPYTER_CONFIG_DIR."""
    port, env = _free_port(), _jupyter_env(tmp_path)
    (tmp_path / "open.py").write_text("c.IdentityProvider.token = ''\n")
    (tmp_path / "config").mkdir()
    extra = {"config-file-empty-token": ["--", f"--config={tmp_path / 'open.py'}"],
             "tornado-settings-xsrf-off": ["--", "--ServerApp.tornado_settings={'disable_check_xsrf': True}"],
             "user-config-dir": []}[case]
    if case == "user-config-dir":
        (tmp_path / "config" / "jupyter_server_config.json").write_text(
            json.dumps({"ServerApp": {"allow_origin_pat": ".*"}}))
    proc, base, answered = _launch(tmp_path, port, env, *extra), f"http://127.0.0.1:{port}", None
    try:
        deadline = time.monotonic() + 40
        while proc.poll() is None and time.monotonic() < deadline and answered is None:
            try:
                answered = _get(f"{base}/api/contents")[0]  # what anyone without the token would get
            except OSError:
                time.sleep(0.3)
    finally:
        if proc.poll() is None:
            proc.terminate()
        out, err = proc.communicate(timeout=20)
    assert answered is None, f"the server answered {answered} without a token"
    lines = [line for line in err.strip().splitlines() if "warning: running as root" not in line]  # uid 0 here
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("ppoforge: error: notebook: "), err
    assert "allowed:" in lines[0] and TOKEN not in out + err


def test_real_server_demands_the_token_and_the_doctor_calls_it_safe(tmp_path):
    """Starts JupyterLab through the CLI on a free port, as a user would, then stops it."""
    from ppoforge.doctor.security import check_jupyter, read_servers

    port, env = _free_port(), _jupyter_env(tmp_path)
    (tmp_path / "safe_config.py").write_text("c.ServerApp.shutdown_no_activity_timeout = 3600\n")
    proc = _launch(tmp_path, port, env, "--", f"--config={tmp_path / 'safe_config.py'}")  # a safe config works
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_until_up(f"{base}/api/status", proc, time.monotonic() + 40)
        status, location = _get(f"{base}/lab")
        assert status == 302 and location.startswith("/login")
        assert _get(f"{base}/api/contents")[0] == 403
        assert _get(f"{base}/api/contents", {"Authorization": f"token {TOKEN}"})[0] == 200
        assert _get(f"{base}/lab?token={TOKEN}")[0] == 200
        info = json.loads(next(Path(tmp_path / "runtime").glob("jpserver-*.json")).read_text())
        assert info["hostname"] == "127.0.0.1" and info["port"] == port
        r = check_jupyter(read_servers([tmp_path / "runtime"]), [], "jupyter_server")
        assert r.status == "ok" and "127.0.0.1, token" in r.evidence
    finally:
        proc.terminate()
        out = "".join(proc.communicate(timeout=20))
    assert "JupyterLab at http://127.0.0.1" in out and TOKEN not in out
