"""Time ppoforge's `train sft` / `train reward` step on one workload; prints one BENCH_RESULT line like
trl_supervised_worker.py.

Same model, tokenizer and data as the TRL side, same shape: `--batch` examples per optimizer step in
micro-batches of `--micro`, AdamW with a linear schedule, fp32 on the CPU, no evaluation, no sample
generations, no checkpoints inside the timed steps. A step is `SupervisedTrainer.train_one_update()`
(next batch, micro-batch forwards and backwards, clip, AdamW, metrics with their host sync), timed with
perf_counter and process_time; the first `--warmup` are dropped. Also reports the mean tokens per
example as ppoforge tokenized them (SFT: prompt + completion + EOS; reward: chosen + rejected), which
the benchmark turns into tokens/s for both sides.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rlhf_workloads  # noqa: E402


def parse_args() -> argparse.Namespace:
    return rlhf_workloads.supervised_worker_args(__doc__.splitlines()[0]).parse_args()


def main() -> None:
    args = parse_args()
    import torch
    import transformers

    import ppoforge
    from ppoforge.config import build_config
    from ppoforge.lm.supervised.config import RewardConfig, SFTConfig
    from ppoforge.lm.supervised.loop import SupervisedTrainer
    from ppoforge.lm.supervised.reward_model import RewardObjective
    from ppoforge.lm.supervised.sft import SFTObjective
    from ppoforge.runtime.allocator import keep_freed_memory

    keep_freed_memory()  # as the `ppoforge` command does at its entry
    wdir = Path(args.workload_dir).resolve()
    steps = args.warmup + args.steps
    fields = {"tokenizer": str(wdir / "tokenizer"), "layout": args.layout, "eval_fraction": 0.0,
              "max_length": args.max_length, "batch_size": args.batch, "micro_batch_size": args.micro,
              "learning_rate": 2e-4, "warmup_ratio": 0.0, "seed": 0, "precision": args.precision, "device": "cpu",
              "torch_threads": args.threads, "checkpoint_every": 10**9, "eval_every": 10**9,
              "tensorboard": False, "progress": False}
    with tempfile.TemporaryDirectory(prefix="bench-ppoforge-sup-") as run_dir:
        if args.task == "sft":
            cfg = build_config(SFTConfig, {**fields, "model": str(wdir / "policy"), "data": str(wdir / "sft.jsonl"),
                                           "sample_prompts": 0})
            objective = SFTObjective(cfg, Path(run_dir))
            tokens = [len(ex.ids) for row in objective.train_items for ex in row]
        else:
            cfg = build_config(RewardConfig, {**fields, "model": str(wdir / "reward"),
                                              "data": str(wdir / "pairs.jsonl"), "shared_prefix": args.shared_prefix})
            objective = RewardObjective(cfg, Path(run_dir))
            tokens = [len(p.chosen) + len(p.rejected) for p in objective.train_items]
        trainer = SupervisedTrainer(cfg, Path(run_dir), objective)
        marks = []
        for _ in range(steps):
            t, c = time.perf_counter(), time.process_time()
            trainer.train_one_update()
            marks.append((time.perf_counter() - t, time.process_time() - c))
    wall, cpu = [m[0] for m in marks[args.warmup:]], [m[1] for m in marks[args.warmup:]]
    median = statistics.median(wall)
    print("BENCH_RESULT " + json.dumps({
        "framework": "ppoforge", "task": args.task, "layout": args.layout,
        "step_s": wall, "median_s": median, "median_cpu_s": statistics.median(cpu),
        "examples_per_s": args.batch / median, "tokens_per_example": sum(tokens) / len(tokens),
        "peak_rss_gib": rlhf_workloads.peak_rss_gib(),
        "versions": {"ppoforge": ppoforge.__version__, "transformers": transformers.__version__,
                     "torch": torch.__version__},
    }), flush=True)


if __name__ == "__main__":
    main()
