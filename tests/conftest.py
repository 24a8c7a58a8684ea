"""What the whole suite shares: one compute thread per pytest-xdist worker, the smollm2 tests kept on one
worker, and `torchrun_runs`, several `ppoforge` command lines in ONE 2-rank torchrun launch.

`make test` runs the suite on two xdist workers (`-m "not torchrun"`), then the tests marked `torchrun`
(2+ processes in one process group, with collective timeouts) on their own, so no worker competes with
their ranks for the two cores. With torch's default of a thread per core, two workers would run four
compute threads on two cores; each worker therefore computes on one thread, and exports
OMP_NUM_THREADS=1 to the processes its tests start (`python -m ppoforge ...`, notebook kernels).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
from threadpoolctl import threadpool_limits

import ppoforge
from ppoforge.runtime.launch import torchrun

if os.environ.get("PYTEST_XDIST_WORKER"):  # set by pytest-xdist in each worker before it reads this file
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    threadpool_limits(1)  # numpy's BLAS too


MODULE_LAUNCHES = {"two_ranks", "ranks"}  # the module-scoped fixtures that make one 2-rank launch


def pytest_itemcollected(item):
    """Every test that needs the built SmolLM2 goes to one worker: it is built once (~40 s), not once each.
    So do the tests of a module that read its one 2-rank launch (a module-scoped fixture runs once per
    worker that has tests using it). Marked as each test is collected, before pytest-xdist's
    `pytest_collection_modifyitems` reads the groups (--dist loadgroup): on pytest 9 a conftest's
    modifyitems hook runs after xdist's, tryfirst or not."""
    names = set(getattr(item, "fixturenames", ()))
    if "smollm2_cache" in names:
        item.add_marker(pytest.mark.xdist_group("smollm2"))
    elif MODULE_LAUNCHES & names:
        item.add_marker(pytest.mark.xdist_group(f"launch:{item.module.__name__}"))


@pytest.fixture(autouse=True)
def _xdist_group_holds(request):
    """pytest-xdist keeps a group on one worker by renaming its tests `NODEID@GROUP` (--dist loadgroup); a
    pytest that ignores the rename (9.2 did) silently spreads them, building SmolLM2 and each launch twice."""
    mark = request.node.get_closest_marker("xdist_group")
    if mark is not None and getattr(request.config.option, "loadgroup", False):
        assert request.node.nodeid.endswith("@" + mark.args[0]), f"{request.node.nodeid}: group {mark.args[0]} lost"


RUN_MANY = textwrap.dedent("""
    # Each rank runs every command line of the JSON list in argv[1] through `ppoforge.cli.main`, in one
    # process group, writes their exit codes to codes.<RANK>.json in argv[2], then ends as cli.main ends
    import json, os, sys

    from ppoforge.cli import main
    from ppoforge.runtime import distributed

    leave = distributed.finish
    distributed.finish = lambda code: None  # cli.main calls it after each run: stay in the group
    codes = [main(argv) for argv in json.load(open(sys.argv[1]))]
    with open(os.path.join(sys.argv[2], "codes." + os.environ["RANK"] + ".json"), "w") as f:
        json.dump(codes, f)
    leave(max(codes, default=0))
""")


def _launch_runs(argvs: list[list[str]], folder: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run `argvs` one after another on 2 ranks in one torchrun launch (the torch + transformers import
    and the rendezvous paid once, not once per run); fails the test unless every run exited 0 on both.

    The process group is the first run's: its `dist_timeout` holds for the collectives of all of them.
    In its own session: on a timeout the launcher and its workers are killed together."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "run_many.py").write_text(RUN_MANY)
    (folder / "argvs.json").write_text(json.dumps([[str(a) for a in argv] for argv in argvs]))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(ppoforge.__file__).parents[1]), str(folder)]),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.Popen(torchrun([str(folder / "argvs.json"), str(folder)], 2, module="run_many"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun still running after {timeout} s:\n{err[-3000:]}")
    assert proc.returncode == 0, err[-3000:]
    for rank in (0, 1):
        assert json.loads((folder / f"codes.{rank}.json").read_text()) == [0] * len(argvs), err[-3000:]
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="session")
def torchrun_runs():
    """(argvs, folder[, timeout]) -> CompletedProcess: several `ppoforge` runs in one 2-rank launch."""
    return _launch_runs
