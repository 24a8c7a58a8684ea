"""One run at a time in a run dir (runtime/rundir.py: RunDirLock, hold): a second holder is refused in one
line naming the first, whether it is another process or another open file in this one; a holder that
ended, however it ended, holds nothing."""

import fcntl
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from ppoforge.errors import UserError, classify
from ppoforge.runtime.rundir import LOCK_FILE, RunDirLock, hold

HOLDER = textwrap.dedent("""
    import os, sys
    from ppoforge.runtime.rundir import RunDirLock
    lock = RunDirLock(sys.argv[1])
    lock.acquire()
    print("held", flush=True)
    if sys.argv[2] == "die":  # as kill -9 or the OOM killer ends a run: no release, the file stays
        os.kill(os.getpid(), 9)
    sys.stdin.readline()  # until the test says
    lock.release()
""")


def _holder(run, how: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run), how], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_flock_locks_belong_to_open_files_so_two_in_one_process_conflict(tmp_path):
    """Why RunDirLock needs no second mechanism for one process: flock on a second open() of the same file
    is refused, though the same process holds the first."""
    path = tmp_path / "f"
    path.write_text("")
    first, second = os.open(path, os.O_RDWR), os.open(path, os.O_RDWR)
    try:
        fcntl.flock(first, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(BlockingIOError):
            fcntl.flock(second, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(first)
        os.close(second)


def test_a_second_lock_in_one_process_is_refused_in_one_line_naming_the_holder(tmp_path):
    run = tmp_path / "runs" / "run"
    first = RunDirLock(run)
    first.acquire()
    with pytest.raises(UserError) as e:
        RunDirLock(run).acquire()
    code, line = classify(e.value)
    assert code == 2 and "\n" not in line
    assert line.startswith(f"run_dir: {run} is in use by pid {os.getpid()} on {socket.gethostname()} (started 20")
    assert line.endswith("); allowed: another --run-dir, or wait for that run to end"), line
    first.release()
    assert not (tmp_path / "runs").exists()  # made for the lock, left empty: removed
    again = RunDirLock(run)
    again.acquire()
    (run / "config.yaml").write_text("x")
    again.release()
    assert [p.name for p in run.iterdir()] == ["config.yaml"]  # the lock file goes, the run's files stay


def test_hold_nests_in_one_process_and_refuses_another_lock(tmp_path):
    with hold(tmp_path / "run"):
        with hold(tmp_path / "run"):  # the CLI's hold around the trainer's
            assert (tmp_path / "run" / LOCK_FILE).is_file()
        with pytest.raises(UserError, match="is in use by pid"):
            RunDirLock(tmp_path / "run").acquire()
    assert not (tmp_path / "run").exists()


def test_a_lock_whose_process_was_killed_is_taken_over(tmp_path):
    run = tmp_path / "run"
    proc = _holder(run, "die")
    assert proc.wait() == -signal.SIGKILL
    assert f'"pid": {proc.pid}' in (run / LOCK_FILE).read_text()  # its file stays; its lock died with it
    lock = RunDirLock(run)
    lock.acquire()
    assert f'"pid": {os.getpid()}' in (run / LOCK_FILE).read_text()
    lock.release()


def test_a_lock_held_by_a_live_process_is_refused_until_that_process_ends(tmp_path):
    run = tmp_path / "run"
    proc = _holder(run, "wait")
    try:
        with pytest.raises(UserError, match=rf"^run_dir: {run} is in use by pid {proc.pid} on "):
            RunDirLock(run).acquire()
    finally:
        proc.communicate("\n")
    lock = RunDirLock(run)
    lock.acquire()
    lock.release()


def test_only_rank_0_holds_under_torchrun(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    with hold(tmp_path / "run"):
        assert not (tmp_path / "run").exists()
