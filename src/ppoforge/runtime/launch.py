"""torchrun command lines built in one place: the tests, the doctor's multi-process checks and the
scaling benchmark all launch `python -m torch.distributed.run` the same way (this Python, a free port).
"""

from __future__ import annotations

import socket
import sys


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (bind to 0, read it back, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def torchrun(args: list[str], nproc: int, port: int = 0, nnodes: int = 1, node_rank: int = 0,
             rdzv_endpoint: str | None = None, module: str = "ppoforge") -> list[str]:
    """`python -m torch.distributed.run ... -m <module> args`: one node (`--standalone`, or on
    127.0.0.1:port), or with `rdzv_endpoint` a c10d rendezvous that `nnodes` such launches join."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    if rdzv_endpoint is None and not port:
        cmd += ["--standalone"]  # torchrun binds a free port itself: no race with other jobs for it
    elif rdzv_endpoint is None:
        cmd += ["--nnodes", "1", "--master_addr", "127.0.0.1", "--master_port", str(port)]
    else:
        cmd += ["--nnodes", str(nnodes), "--node_rank", str(node_rank), "--rdzv_backend", "c10d",
                "--rdzv_endpoint", rdzv_endpoint, "--rdzv_id", f"ppoforge-{port}"]
    return [*cmd, "-m", module, *args]
