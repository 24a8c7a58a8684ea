"""Run every check in order, time each one, and turn the results into a report and an exit code.

The machine's facts that several checks share (GPU visibility, the container hint) are gathered once
here. A check that crashes becomes a `fail` row instead of a traceback: the doctor must finish on the
broken machines it exists for. `--quick` skips the slow checks (the all-reduce, the smoke runs, the
matmul benchmark and the chat-template probe, which imports transformers) so it fits a container
HEALTHCHECK.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ppoforge.doctor import (
    distributed,
    gpu,
    libraries,
    memory,
    rollout_engine,
    security,
    smoke,
    storage,
    system,
    templates,
)
from ppoforge.doctor.report import (
    CAPABILITY_KEYS,
    DEFAULT_REQUIRE,
    CheckResult,
    Report,
    fail,
    render_text,
    skip,
    to_json,
    verdicts,
)
from ppoforge.errors import UserError

SLOW = ("allreduce", "fsdp", "rendezvous", "control_smoke", "lm_smoke", "chat_template")  # skipped by --quick
QUICK_SKIP = "not run (--quick)"


@dataclass
class Options:
    device: str = "auto"
    precision: str = "fp32"
    quick: bool = False
    require: tuple[str, ...] = DEFAULT_REQUIRE
    runs_root: str = "runs"
    allreduce_timeout: float = 30.0
    rdzv_endpoint: str | None = None  # multi-node: HOST:PORT to meet the other nodes' doctors at
    nnodes: int | None = None
    node_rank: int | None = None
    model: str | None = None  # `memory`: will this model train here (ppoforge plan's verdict)


def parse_require(text: str) -> tuple[str, ...]:
    """'control,rlhf' -> ('control', 'rlhf'); 'all' -> every capability; '' or 'none' -> nothing."""
    names = [n.strip() for n in text.split(",") if n.strip() and n.strip() != "none"]
    if names == ["all"]:
        return CAPABILITY_KEYS
    unknown = [n for n in names if n not in CAPABILITY_KEYS]
    if unknown:
        raise UserError(f"--require: unknown capability {unknown[0]!r}; allowed (comma-separated): "
                        f"{', '.join(CAPABILITY_KEYS)}, all, none")
    return tuple(names)


def check_device_arg(text: str) -> str:
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", text):
        raise UserError(f"--device: {text!r} is not allowed; allowed: auto, cpu, cuda, cuda:N")
    return text


def timed(name: str, fn: Callable[[], CheckResult]) -> CheckResult:
    start = time.perf_counter()
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - a crashing check is a finding, not a doctor crash
        result = fail(name, f"the check itself crashed: {type(e).__name__}: {str(e)[:200]}",
                      "report it as a ppoforge bug, with the output of ppoforge doctor --json")
    result.seconds = time.perf_counter() - start
    return result


def _selected(opts: Options, facts: gpu.GpuFacts) -> tuple[str, tuple[int, int] | None]:
    """(device type the run will use, its GPU's compute capability or None)."""
    if opts.device == "cpu" or (opts.device == "auto" and not facts.torch_count):
        return "cpu", None
    if not facts.torch_count:
        return "cuda", None
    index = int(opts.device.split(":")[1]) if ":" in opts.device else 0
    try:
        return "cuda", torch.cuda.get_device_capability(index)
    except Exception:  # noqa: BLE001 - a bad index or a broken GPU: the checks themselves will say so
        return "cuda", None


def plan(opts: Options, facts: gpu.GpuFacts, workdir: Path) -> list[tuple[str, Callable[[], CheckResult]]]:
    """(name, check) in report order: build, hardware, precision, libraries, storage, distributed, security,
    smoke runs."""
    container = storage.container_hint()
    device_type, capability = _selected(opts, facts)
    home, explicit = storage.hf_home()
    installed = libraries.gather_installed()
    dist = distributed.gather_dist(facts.torch_count)
    checks = [
        ("python_torch", lambda: system.check_python_torch(system.gather_torch())),
        ("torch_wheel", lambda: libraries.check_torch_wheel(libraries.gather_wheel(facts))),
        ("cpu", lambda: system.check_cpu(system.gather_cpu(measure=not opts.quick), opts.precision,
                                         device_type)),
        ("gpu_visibility", lambda: gpu.check_gpu_visibility(facts, opts.device)),
        *[(f"gpu{i}", lambda i=i: gpu.check_gpu_device(gpu.gather_device(i), opts.precision))
          for i in range(facts.torch_count)],
        ("bf16_step", lambda: smoke.check_precision_step("bf16", opts.device, capability)),
        ("fp16_step", lambda: smoke.check_precision_step("fp16", opts.device, capability)),
        ("libraries_core", lambda: libraries.check_libraries("core", installed)),
        ("libraries_lm", lambda: libraries.check_libraries("lm", installed)),
        ("chat_template", lambda: templates.check_chat_template(templates.gather_templates())),
        ("checkpoint_roundtrip", lambda: storage.check_checkpoint_roundtrip(workdir)),
        ("runs_dir", lambda: storage.check_runs_dir(storage.gather_dir(opts.runs_root, container))),
        ("hf_cache", lambda: storage.check_hf_cache(storage.gather_dir(home, container), explicit,
                                                    dict(os.environ), storage.hub_reachability(dict(os.environ)))),
        ("dist_backends", lambda: distributed.check_dist_backends(dist)),
        ("allreduce", lambda: distributed.check_allreduce(facts.torch_count, dist.nccl,
                                                          opts.allreduce_timeout)),
        ("fsdp", lambda: distributed.check_fsdp(facts.torch_count, dist.nccl, 2 * opts.allreduce_timeout)),
        ("rendezvous", lambda: distributed.check_rendezvous(distributed.rendezvous_target(
            opts.rdzv_endpoint, opts.nnodes, opts.node_rank, dict(os.environ)))),
        ("shm", lambda: distributed.check_shm(distributed.shm_bytes(), container is not None)),
        ("memlock", lambda: distributed.check_memlock(distributed.memlock_limit(), facts.torch_count)),
        ("root", lambda: security.check_root(os.geteuid())),
        ("jupyter", lambda: security.check_jupyter(*security.gather_jupyter())),
        ("control_smoke", lambda: smoke.check_control_smoke(opts.device, opts.precision, workdir)),
        ("lm_smoke", lambda: smoke.check_lm_smoke(opts.device, opts.precision, workdir)),
        ("vllm", lambda: _vllm_check(opts.quick, workdir / "vllm")),
        ("memory", lambda: memory.check_memory(opts.model, opts.device, facts.torch_count)),
    ]
    return checks


def _vllm_check(quick: bool, workdir: Path) -> CheckResult:
    """vLLM's version and requirements always; its one-token smoke in the full doctor when it is installed."""
    facts = rollout_engine.gather_vllm()
    smoke_line = None if quick or facts["dist"] is None else rollout_engine.vllm_smoke(workdir)
    return rollout_engine.check_vllm(facts, smoke_line)


def run_doctor(opts: Options) -> Report:
    check_device_arg(opts.device)
    start = time.perf_counter()
    facts = gpu.gather_gpu()
    results: list[CheckResult] = []
    quick_skipped: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="ppoforge-doctor-") as tmp:
        for name, check in plan(opts, facts, Path(tmp)):
            if opts.quick and name in SLOW:
                results.append(skip(name, QUICK_SKIP))
                quick_skipped.add(name)
            else:
                results.append(timed(name, check))
    vs = verdicts(results, facts.torch_count, quick_skipped, opts.require, _selected(opts, facts)[0])
    seconds = time.perf_counter() - start
    return Report(opts.device, opts.precision, opts.quick, results, vs, seconds, opts.require)


def main(opts: Options, as_json: bool) -> int:
    """Print the report (table or JSON) and return the exit code."""
    report = run_doctor(opts)
    print(to_json(report) if as_json else render_text(report))
    return report.exit_code
