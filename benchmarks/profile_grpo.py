"""Where a ppoforge GRPO update spends its time: torch.profiler over whole updates, split into phases.

Builds a benchmark workload (rlhf_workloads.py: random-init models of a given shape) and runs the GRPO
update `rlhf_vs_trl.py --grpo` times, `--updates` of them under torch.profiler after a warm-up. Each
phase is a `record_function` scope around the trainer's own call for it — decode (sampling, the KV-cache
loop), reward (decoding text, the reward model), reference (the rollout passes: reference log-probs),
forward / backward (the training micro-batches), optimizer (clip + AdamW) — and "other" is the rest of
the update (advantages, metrics, Python between the phases). Prints one markdown table: wall seconds
per update of each phase, its share, and the number of operators it dispatched (overhead-bound code is
many small ops; top-level operators only), plus the top operators by self CPU time.

    python benchmarks/profile_grpo.py --workload tiny --shared-prefix auto
    python benchmarks/profile_grpo.py --workload smollm2 --precision bf16 --updates 1
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import ppoforge_rlhf_worker  # noqa: E402
import rlhf_workloads  # noqa: E402

PHASES = ("decode", "reward", "reference", "forward", "backward", "optimizer")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="tiny", choices=sorted(rlhf_workloads.WORKLOADS))
    p.add_argument("--layout", choices=["full", "lora"], default="lora")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--shared-prefix", choices=["auto", "off"], default="auto")
    p.add_argument("--attn", choices=["auto", "eager", "sdpa"], default="auto")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--updates", type=int, default=3, help="profiled updates (after --warmup)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--top", type=int, default=12, help="operators listed by self CPU time")
    p.add_argument("--ops", action=argparse.BooleanOptionalAction, default=True,
                   help="run under torch.profiler and count operators (--no-ops: the phases' wall clocks alone, "
                        "without the profiler's own overhead)")
    p.add_argument("--phase-ops", nargs="*", default=[], choices=[*PHASES, "other"],
                   help="list the costliest top-level operators of these phases (calls and CPU ms per update)")
    return p.parse_args()


def scoped(name: str, fn):
    """fn inside a record_function scope and a wall clock: (wrapped fn, {"s": seconds, "calls": n})."""
    import torch

    acc = {"s": 0.0}

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        start = time.perf_counter()
        with torch.profiler.record_function(name):
            try:
                return fn(*args, **kwargs)
            finally:
                acc["s"] += time.perf_counter() - start
    return wrapped, acc


def phase_of(e) -> str:
    """The innermost phase scope around a profiler event ("other" outside all of them)."""
    parent = e.cpu_parent
    while parent is not None and parent.name not in PHASES:
        parent = parent.cpu_parent
    return "other" if parent is None else parent.name


def ops_per_phase(events) -> tuple[dict[str, int], dict[str, dict[str, list[float]]]]:
    """Top-level operators dispatched inside each phase's scope (an operator called by another is not
    counted again; aten's and the others', such as mkldnn's prepacked linear), in total and by name as
    [calls, CPU ms including what they call]."""
    counts: dict[str, int] = {}
    names: dict[str, dict[str, list[float]]] = {}
    for e in events:
        if "::" not in e.name or (e.cpu_parent is not None and "::" in e.cpu_parent.name):
            continue
        phase = phase_of(e)
        counts[phase] = counts.get(phase, 0) + 1
        calls_ms = names.setdefault(phase, {}).setdefault(e.name, [0, 0.0])
        calls_ms[0] += 1
        calls_ms[1] += e.cpu_time_total / 1000
    return counts, names


def main() -> None:
    args = parse_args()
    import torch

    from ppoforge.lm.rl.trainer import RLHFTrainer
    from ppoforge.runtime.allocator import keep_freed_memory

    keep_freed_memory()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="profile-grpo-") as tmp:
        wdir = rlhf_workloads.build(args.workload, Path(tmp) / "w")
        w = rlhf_workloads.load_workload(wdir)
        worker_args = ppoforge_rlhf_worker.worker_args(
            layout=args.layout, precision=args.precision, warmup=args.warmup, updates=args.updates,
            threads=args.threads, grpo=True, prompts=args.prompts, generations=args.generations,
            new_tokens=args.new_tokens, micro=args.micro, shared_prefix=args.shared_prefix, attn=args.attn)
        trainer = RLHFTrainer(ppoforge_rlhf_worker.rlhf_config(w, wdir, worker_args, wdir / "prompts.jsonl"),
                              Path(tmp) / "run")
        clocks = {}
        targets = {"decode": (trainer.collector, "generate"), "reward": (trainer.collector, "scores"),
                   "reference": (trainer, "passes"), "forward": (trainer.layout, "forward"),
                   "backward": (trainer.precision, "backward"), "optimizer": (trainer.precision, "apply")}
        for name, (owner, attr) in targets.items():
            fn, clocks[name] = scoped(name, getattr(owner, attr))
            setattr(owner, attr, fn)
        clip, clip_clock = scoped("optimizer", trainer.precision.clip)
        trainer.precision.clip = clip
        for _ in range(args.warmup):
            trainer.train_one_update()
        for acc in (*clocks.values(), clip_clock):
            acc["s"] = 0.0
        profiling = (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if args.ops
                     else contextlib.nullcontext())
        with profiling as prof:
            start = time.perf_counter()
            for _ in range(args.updates):
                metrics, _ = trainer.train_one_update()
            total = (time.perf_counter() - start) / args.updates
    clocks["optimizer"]["s"] += clip_clock["s"]
    events = prof.key_averages() if args.ops else []
    ops, by_name = ops_per_phase(prof.events()) if args.ops else ({}, {})
    seconds = {name: clocks[name]["s"] / args.updates for name in PHASES}
    seconds["other"] = total - sum(seconds.values())
    print(f"\n{args.workload}, {args.layout}, {args.precision}, shared_prefix {args.shared_prefix}: "
          f"{args.prompts} prompts x {args.generations} x {args.new_tokens} new tokens, micro {args.micro}, "
          f"{args.threads} threads; {total:.3f} s per update (profiler {'on' if args.ops else 'off'}), "
          f"shared-prefix unit {metrics.get('perf/shared_prefix_unit')}\n")
    print("| phase | s/update | share | ops/update |\n|---|---|---|---|")
    for name, s in seconds.items():
        print(f"| {name} | {s:.4f} | {s / total:.0%} | {ops.get(name, 0) // args.updates} |")
    top = sorted((e for e in events if e.key not in PHASES and not e.key.startswith("ProfilerStep")),
                 key=lambda e: e.self_cpu_time_total, reverse=True)[:args.top]
    print("\n| operator | calls/update | self CPU ms/update |\n|---|---|---|")
    for e in top:
        print(f"| {e.key} | {e.count // args.updates} | {e.self_cpu_time_total / 1000 / args.updates:.1f} |")
    print(f"\nall top-level operators: {sum(ops.values()) // args.updates} per update")
    for name in args.phase_ops:  # per update: calls (CPU ms), the costliest first
        common = sorted(by_name.get(name, {}).items(), key=lambda kv: -kv[1][1])[:args.top]
        print(f"\n{name}: " + ", ".join(f"{op} {calls // args.updates} ({ms / args.updates:.0f} ms)"
                                        for op, (calls, ms) in common))


if __name__ == "__main__":
    main()
