"""Root and Jupyter: runtime files of running servers, config files, and what counts as open."""

import json
import os
from pathlib import Path

from ppoforge.doctor.security import (
    check_jupyter,
    check_root,
    parse_cmdline,
    parse_config_py,
    read_configs,
    read_servers,
    runtime_dirs,
)

DEAD_PID = 4_194_999  # above the default pid_max: no such process


def test_root_warns():
    r = check_root(0)
    assert r.status == "warn" and "--user" in r.fix
    assert check_root(1000).status == "ok"


def _server(runtime, name, **info):
    runtime.mkdir(parents=True, exist_ok=True)
    (runtime / name).write_text(json.dumps({"pid": os.getpid(), "port": 8888, **info}))


def test_unauthenticated_running_jupyter_on_all_interfaces_fails(tmp_path):
    _server(tmp_path, "jpserver-1.json", hostname="0.0.0.0", token="", password=False)
    r = check_jupyter(read_servers([tmp_path]), [], "jupyter_server 2.14.2")
    assert r.status == "fail" and "every interface, NO token and NO password" in r.evidence
    assert "anyone who reaches the port" in r.evidence and "127.0.0.1" in r.fix and "password" in r.fix


def test_token_protected_server_is_ok_and_dead_servers_are_ignored(tmp_path):
    _server(tmp_path, "jpserver-1.json", hostname="localhost", token="abc123", password=False)
    _server(tmp_path, "nbserver-2.json", hostname="0.0.0.0", token="", password=False, pid=DEAD_PID)
    servers = read_servers([tmp_path])
    assert len(servers) == 1
    r = check_jupyter(servers, [], "jupyter_server 2.14.2")
    assert r.status == "ok" and "localhost, token" in r.evidence


def test_config_py_with_empty_token_fails(tmp_path):
    (tmp_path / "jupyter_server_config.py").write_text(
        "# c.ServerApp.token = 'commented-out'\nc.ServerApp.token = ''\nc.ServerApp.ip = '0.0.0.0'\n")
    configured = read_configs(tmp_path, env={})
    r = check_jupyter([], configured, None)
    assert r.status == "fail" and "jupyter_server_config.py" in r.evidence


def test_config_with_a_password_is_ok(tmp_path):
    (tmp_path / "jupyter_notebook_config.json").write_text(json.dumps(
        {"NotebookApp": {"token": "", "password": "argon2:$argon2id$v=19$..."}}))
    assert check_jupyter([], read_configs(tmp_path, env={}), None).status == "ok"
    (tmp_path / "jupyter_server_config.json").write_text(json.dumps({"ServerApp": {"token": "", "ip": "::"}}))
    assert check_jupyter([], read_configs(tmp_path, env={}), None).status == "fail"


def test_parse_config_py_reads_identity_provider_and_hashed_password():
    text = "c.IdentityProvider.token = \"\"\nc.PasswordIdentityProvider.hashed_password = 'x'\n"
    found = parse_config_py(text)
    assert found == {"token": "", "password": "x"}


def test_no_jupyter_is_a_skip():
    r = check_jupyter([], [], None)
    assert r.status == "skip" and "pip install jupyterlab" in r.evidence


def test_runtime_dirs_follow_the_env(tmp_path):
    dirs = runtime_dirs({"JUPYTER_RUNTIME_DIR": str(tmp_path / "rt")}, tmp_path)
    assert dirs[0] == tmp_path / "rt" and tmp_path / ".local" / "share" / "jupyter" / "runtime" in dirs


def _process_with_argv(*argv):
    """A live process whose /proc/PID/cmdline carries `argv`, standing in for a jupyter server."""
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *argv])
    deadline = time.monotonic() + 10
    cmdline = Path(f"/proc/{proc.pid}/cmdline")
    while argv and argv[-1].encode() not in cmdline.read_bytes():  # empty until the exec has finished
        assert time.monotonic() < deadline, "the stand-in process never showed its command line"
        time.sleep(0.01)
    return proc


def test_parse_cmdline_reads_the_flags_that_open_a_server():
    found = parse_cmdline(["python", "-m", "jupyterlab", "--ServerApp.allow_origin=*", "--ip", "0.0.0.0",
                           "--ServerApp.disable_check_xsrf", "--no-browser",
                           "--PasswordIdentityProvider.hashed_password=argon2:x"])
    assert found == {"allow_origin": "*", "ip": "0.0.0.0", "disable_check_xsrf": "true", "password": "argon2:x"}


def test_a_server_started_like_ppoforge_notebook_is_ok(tmp_path):
    from ppoforge.notebook import NotebookOptions, plan

    launch = plan(NotebookOptions(), env={}, euid=1000)
    proc = _process_with_argv(*launch.argv[1:])
    try:
        _server(tmp_path, "jpserver-1.json", pid=proc.pid, hostname="127.0.0.1", token=launch.env["JUPYTER_TOKEN"],
                password=False)
        r = check_jupyter(read_servers([tmp_path]), [], "jupyter_server 2.21.1")
    finally:
        proc.kill()
        proc.wait()
    assert r.status == "ok" and "127.0.0.1, token" in r.evidence and "XSRF" not in r.evidence


def test_password_on_the_command_line_counts_although_the_runtime_file_says_none(tmp_path):
    # jupyter_server 2 writes "password": false when the hash came as PasswordIdentityProvider.hashed_password
    proc = _process_with_argv("--PasswordIdentityProvider.hashed_password=argon2:$argon2id$v=19$x")
    try:
        _server(tmp_path, "jpserver-1.json", pid=proc.pid, hostname="127.0.0.1", token="", password=False)
        r = check_jupyter(read_servers([tmp_path]), [], "jupyter_server 2.21.1")
    finally:
        proc.kill()
        proc.wait()
    assert r.status == "ok" and "127.0.0.1, password" in r.evidence


def test_token_with_any_origin_or_xsrf_off_still_fails(tmp_path):
    proc = _process_with_argv("--ServerApp.allow_origin=*", "--ServerApp.disable_check_xsrf=True")
    try:
        _server(tmp_path, "jpserver-1.json", pid=proc.pid, hostname="127.0.0.1", token="t" * 32, password=False)
        r = check_jupyter(read_servers([tmp_path]), [], "jupyter_server 2.21.1")
    finally:
        proc.kill()
        proc.wait()
    assert r.status == "fail" and "allow_origin '*'" in r.evidence and "XSRF checks disabled" in r.evidence
    assert "web page" in r.evidence and "ppoforge notebook" in r.fix


def test_configs_with_any_origin_or_xsrf_off_fail(tmp_path):
    (tmp_path / "jupyter_server_config.py").write_text(
        "c.ServerApp.token = 'abcdefghijklmnopqrstuvwxyz'\nc.ServerApp.disable_check_xsrf = True\n")
    r = check_jupyter([], read_configs(tmp_path, env={}), None)
    assert r.status == "fail" and "XSRF checks disabled" in r.evidence
    (tmp_path / "jupyter_server_config.py").unlink()
    (tmp_path / "jupyter_server_config.json").write_text(json.dumps(
        {"ServerApp": {"allow_origin": "*", "disable_check_xsrf": False}}))
    r = check_jupyter([], read_configs(tmp_path, env={}), None)
    assert r.status == "fail" and "allow_origin '*'" in r.evidence and "XSRF" not in r.evidence
