"""Time TRL 1.12's PPO (`trl.experimental.ppo.PPOTrainer`) on one workload; prints one BENCH_RESULT line.

Runs inside the TRL venv (.bench-venvs/trl, made by rlhf_vs_trl.py), one process per measurement so the
peak RSS is this run's alone. The workload (models, tokenizer, prompts) was written by
rlhf_workloads.build(); the setup follows shared/BENCHMARKS.md: TRL's 4 separate models (policy,
reference = a second copy of the policy weights, value and reward = AutoModelForSequenceClassification
loaded from the reward checkpoint, as TRL's own PPO example does), `stop_token="eos"`, 1 PPO epoch,
1 mini-batch = all prompts, micro-batch from the workload (so gradient accumulation = prompts / micro),
`num_sample_generations=0`, every other PPOConfig field at TRL's default (temperature 0.7, k1 KL,
lr 3e-6, rollout forward batch 64, i.e. the whole rollout in one `generate` for these workloads).

How an update is timed: PPOTrainer.train() is one loop with one iteration per PPO update (rollout,
reference/value/reward scoring, GAE, the PPO epoch, logging) and calls `on_step_end` on its callbacks
at the end of every iteration. A callback timestamps `on_train_begin` and every `on_step_end`; the gaps
between consecutive timestamps are whole updates (each also carries the previous iteration's trailing
`gc.collect()`, which TRL runs every update). The first `--warmup` gaps are dropped; we report the median
of the rest. Model loading and trainer construction are outside the timed span.

Precision: PPOTrainer builds its own `Accelerator()` without passing `mixed_precision`, so TRL's
`bf16=True` config default does NOT turn on autocast; TRL's PPO runs fp32 unless the environment sets
ACCELERATE_MIXED_PRECISION. `--precision bf16` sets it (bf16 autocast over fp32 weights, TRL's only
bf16 mode). Likewise gradient checkpointing (a config default of True) is never enabled by PPOTrainer.
The effective settings are read back from the trainer and reported.

Besides wall time we record each update's process CPU time (all threads): on a shared machine other
jobs stretch wall time, while CPU time moves much less, so it is a second, load-robust view.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rlhf_workloads  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload-dir", required=True, help="directory written by rlhf_workloads.build()")
    p.add_argument("--updates", type=int, default=5, help="timed PPO updates (after the warm-up)")
    p.add_argument("--warmup", type=int, default=1, help="untimed PPO updates run first")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="fp32 = TRL PPO's effective default; bf16 = accelerate's bf16 autocast")
    p.add_argument("--device", default="cpu",
                   help="cpu (the CPU figures: GPUs hidden), cuda or cuda:N (only that GPU visible)")
    p.add_argument("--seed", type=int, default=0, help="trainer seed (sampling, shuffling)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    rlhf_workloads.one_visible_gpu(args.device)
    os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16" if args.precision == "bf16" else "no"
    import accelerate
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        TrainerCallback,
    )
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    torch.set_num_threads(args.threads)
    wdir = Path(args.workload_dir)
    w = rlhf_workloads.load_workload(wdir)
    prompts = rlhf_workloads.load_prompts(wdir)
    t_setup = time.perf_counter()

    tok = AutoTokenizer.from_pretrained(wdir / "tokenizer")
    load_lm = lambda: AutoModelForCausalLM.from_pretrained(wdir / "policy", dtype=torch.float32)
    load_rm = lambda: AutoModelForSequenceClassification.from_pretrained(
        wdir / "reward", num_labels=1, dtype=torch.float32)
    policy, ref_policy, value_model, reward_model = load_lm(), load_lm(), load_rm(), load_rm()
    dataset = Dataset.from_dict({"input_ids": prompts})
    n_updates = args.warmup + args.updates

    out_dir = tempfile.TemporaryDirectory(prefix="bench-trl-")  # removed when the process exits
    config = PPOConfig(
        output_dir=out_dir.name, report_to="none", save_strategy="no",
        disable_tqdm=True, seed=args.seed, bf16=args.precision == "bf16",
        per_device_train_batch_size=w.micro_batch, gradient_accumulation_steps=w.n_prompts // w.micro_batch,
        num_mini_batches=1, num_ppo_epochs=1, total_episodes=n_updates * w.n_prompts,
        response_length=w.new_tokens, stop_token="eos", num_sample_generations=0,
    )

    stamps: list[tuple[float, float]] = []  # (wall, process CPU) at train begin and after each update

    class UpdateClock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            stamps.append((time.perf_counter(), time.process_time()))

        def on_step_end(self, *a, **k):
            stamps.append((time.perf_counter(), time.process_time()))

    trainer = PPOTrainer(args=config, processing_class=tok, model=policy, ref_model=ref_policy,
                         reward_model=reward_model, value_model=value_model, train_dataset=dataset,
                         eval_dataset=dataset, callbacks=[UpdateClock()])
    setup_s = time.perf_counter() - t_setup
    if (trainer.accelerator.device.type == "cuda") != args.device.startswith("cuda"):
        raise SystemExit(f"--device {args.device}, but TRL's accelerator chose {trainer.accelerator.device}")
    trainer.train()

    gaps = [b[0] - a[0] for a, b in zip(stamps, stamps[1:], strict=False)]
    cpu = [b[1] - a[1] for a, b in zip(stamps, stamps[1:], strict=False)]
    assert len(gaps) == n_updates, f"expected {n_updates} updates, timed {len(gaps)}"
    timed = gaps[args.warmup:]
    median = statistics.median(timed)
    result = {
        "framework": "trl", "layout": "trl-4-model", "precision": args.precision, "workload": w.name,
        "threads": torch.get_num_threads(), "warmup": args.warmup, "updates": args.updates,
        "warmup_s": gaps[: args.warmup], "update_s": timed, "median_s": median,
        "cpu_s": cpu[args.warmup:], "median_cpu_s": statistics.median(cpu[args.warmup:]),
        "samples_per_s": w.n_prompts / median, "peak_rss_gib": rlhf_workloads.peak_rss_gib(),
        "device": str(trainer.accelerator.device), "peak_cuda_gib": rlhf_workloads.peak_cuda_gib(), "setup_s": setup_s,
        "effective": {"mixed_precision": trainer.accelerator.mixed_precision,
                      "gradient_checkpointing": bool(trainer.policy_model.is_gradient_checkpointing),
                      "rollout_forward_batch": config.local_rollout_forward_batch_size,
                      "grad_accum": config.gradient_accumulation_steps},
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                     "torch": torch.__version__, "accelerate": accelerate.__version__},
    }
    print("BENCH_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
