"""Weak scaling of LM PPO under torchrun on CPU: 2 processes x 1 thread (global batch 2B) vs 1 process
x 1 thread (batch B), on the tiny random Qwen2 of `lm/models/tiny.py`. Efficiency = (per-update time of 1
process) / (per-update time of 2 processes): 1.0 is perfect, each process doing the same work as the
lone one; below it, the gradient all-reduce, the other collectives and the slowest rank's wait.

Per-update time = the median `perf/update_s` (rank 0's wall seconds of the whole update: sampling,
scoring, advantages, optimization, metrics) over the updates after the first (warm-up). Both runs go
through the CLI (`ppoforge train rlhf`), the 2-process one through `python -m torch.distributed.run`.
It needs 2 idle cores: on a shared machine the number mostly measures the neighbours — the script
prints `uptime` before and after, report it alongside.

`--fsdp` (implies `--layout full`): a third run, the same processes with `fsdp: true` (FSDP2: weights and
optimizer state sharded, each layer gathered for its forward and backward), beside the DDP-style one.
`--torchrun-one`: also one process under torchrun with batch B, against the plain one (what torchrun
itself costs: nothing is expected, a world of 1 creates no process group). On a GPU box: `--device cuda
--nproc <GPUs>` (one process per GPU).

    python benchmarks/ddp_weak_scaling.py --updates 8 --batch 8
    python benchmarks/ddp_weak_scaling.py --updates 8 --batch 8 --fsdp
    python benchmarks/ddp_weak_scaling.py --updates 8 --batch 8 --torchrun-one --device cuda --nproc 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ppoforge.lm.models.tiny import save_tiny_lm
from ppoforge.runtime.launch import torchrun
from ppoforge.runtime.metrics import read_metrics

PROMPTS = ["tell a story about the rain", "write one sentence about coffee", "describe the city at night",
           "a review of a good movie", "tell me about your friend", "the weather today is",
           "write about the sun", "describe my morning"]


def _args(model: Path, prompts: Path, run_dir: Path, batch: int, updates: int, layout: str, device: str
          ) -> list[str]:
    return ["train", "rlhf", "--run-dir", str(run_dir), "--model", str(model), "--prompts", str(prompts),
            "--layout", layout, *(["--learning-rate", "1e-5"] if layout == "full" else []),
            "--heldout-prompts", "none", "--reward", "length:8", "--batch-size", str(batch),
            "--mini-batch-size", str(batch), "--micro-batch-size", str(batch), "--ppo-epochs", "2",
            "--max-new-tokens", "16", "--max-prompt-tokens", "16", "--total-updates", str(updates),
            "--torch-threads", "1", "--device", device, "--progress", "false", "--tensorboard", "false",
            "--checkpoint-every", "100000", "--precision", "fp32"]  # as measured before rlhf's default became auto


def _update_s(run_dir: Path) -> float:
    times = [r["perf/update_s"] for r in read_metrics(run_dir / "metrics.jsonl")][1:]
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=8, help="PPO updates per run (the first is warm-up)")
    parser.add_argument("--batch", type=int, default=8, help="prompts per process and update (B)")
    parser.add_argument("--layout", choices=("lora", "full"), default="lora")
    parser.add_argument("--fsdp", action="store_true", help="also the processes with fsdp: true (full layout)")
    parser.add_argument("--torchrun-one", action="store_true", help="also 1 process under torchrun (its overhead)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--nproc", type=int, default=2, help="processes of the scaled runs (GPUs with cuda)")
    args = parser.parse_args()
    layout, n = ("full" if args.fsdp else args.layout), args.nproc
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    print("uptime before:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = save_tiny_lm(tmp / "model", hidden=64, layers=2)
        prompts = tmp / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
        def cli(name: str, batch: int) -> list[str]:
            return _args(model, prompts, tmp / name, batch, args.updates, layout, args.device)

        runs = {"one": [sys.executable, "-m", "ppoforge", *cli("one", args.batch)],
                "many": torchrun(cli("many", n * args.batch), n)}
        if args.fsdp:
            runs["many_fsdp"] = torchrun([*cli("many_fsdp", n * args.batch), "--fsdp", "true"], n)
        if args.torchrun_one:
            runs["torchrun_one"] = torchrun(cli("torchrun_one", args.batch), 1)
        for cmd in runs.values():
            subprocess.run(cmd, check=True, env=env, capture_output=True)
        t = {name: _update_s(tmp / name) for name in runs}
    print("uptime after: ", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    out = {"layout": layout, "device": args.device, "processes": n, "batch_per_process": args.batch,
           "updates": args.updates, "one_process_update_s": t["one"], f"{n}_processes_update_s": t["many"],
           "weak_scaling_efficiency": t["one"] / t["many"]}
    if args.fsdp:
        out |= {f"{n}_processes_fsdp_update_s": t["many_fsdp"],
                "fsdp_weak_scaling_efficiency": t["one"] / t["many_fsdp"]}
    if args.torchrun_one:
        out |= {"torchrun_one_process_update_s": t["torchrun_one"], "torchrun_overhead": t["torchrun_one"] / t["one"]}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
