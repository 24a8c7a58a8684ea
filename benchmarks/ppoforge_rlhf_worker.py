"""Time ppoforge's LM PPO update on one workload; prints one BENCH_RESULT line like trl_ppo_worker.py.

Runs in ppoforge's venv, one process per measurement. Same workload directory as the TRL side (same
weights, tokenizer, prompts), same PPO shape: batch = all prompts, 1 mini-batch, 1 PPO epoch, the
workload's micro-batch, `max_new_tokens` from the workload, stop at EOS, temperature 0.7, k1 KL with
beta 0.05. Layouts: `full` is TRL's 4 models (policy, frozen reference copy, critic trunk initialized
from the reward checkpoint as TRL's value model is, separate reward model); `lora` is ppoforge's
default (frozen base with adapters, reference = adapters off). The reward is the same
AutoModelForSequenceClassification checkpoint in both layouts (`reward="model:<dir>"`).

How an update is timed: `RLHFTrainer.train_one_update()` is exactly one PPO update (sample, score,
reference/value pass, GAE, PPO epoch, metrics with their host sync); we time each call with
perf_counter and process_time, drop the first `--warmup`, and report the medians. Trainer
construction (model loading) is outside the timed span, as on the TRL side. Peak RSS is the
process's VmHWM at the end.

Tokenizer: the workload's word-level tokenizer sits in its own folder (see rlhf_workloads.py: next to
a qwen2 config.json, transformers 5 replaces it with a byte-level Qwen2Tokenizer). The config's
`tokenizer` field points there; the reward checkpoint has no tokenizer files, so it shares the
policy's (as TRL's PPO requires of its reward model).
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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload-dir", required=True, help="directory written by rlhf_workloads.build()")
    p.add_argument("--layout", choices=["full", "lora"], default="lora", help="ppoforge model layout")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="ppoforge precision")
    p.add_argument("--updates", type=int, default=5, help="timed PPO updates (after the warm-up)")
    p.add_argument("--warmup", type=int, default=1, help="untimed PPO updates run first")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--seed", type=int, default=0, help="trainer seed")
    p.add_argument("--grpo", action="store_true",
                   help="GRPO as trl_grpo_worker.py runs it: --prompts x --generations completions, beta 0.04 "
                        "(k3 in the loss), token-mean loss over the batch, one optimizer step, no critic")
    p.add_argument("--prompts", type=int, default=4, help="--grpo: prompts per update")
    p.add_argument("--generations", type=int, default=8, help="--grpo: completions per prompt")
    p.add_argument("--new-tokens", type=int, default=32, help="--grpo: new tokens")
    p.add_argument("--micro", type=int, default=8, help="--grpo: completions per forward/backward")
    p.add_argument("--shared-prefix", choices=["auto", "off"], default="auto",
                   help="ppoforge's shared_prefix: a group's completions as one row behind one prompt, or padded rows")
    return p.parse_args()


def rlhf_config(w: rlhf_workloads.Workload, wdir: Path, args: argparse.Namespace):
    from ppoforge.config import build_config
    from ppoforge.lm.rl.config import RLHFConfig

    return build_config(RLHFConfig, {
        "model": str(wdir / "policy"), "tokenizer": str(wdir / "tokenizer"), "layout": args.layout,
        "critic_model": str(wdir / "reward") if args.layout == "full" else None,
        "prompts": str(wdir / "prompts.jsonl"), "heldout_prompts": None, "use_chat_template": False,
        "reward": f"model:{wdir / 'reward'}",
        "max_prompt_tokens": w.prompt_len, "max_new_tokens": w.new_tokens,
        "batch_size": w.n_prompts, "mini_batch_size": w.n_prompts, "micro_batch_size": w.micro_batch,
        "ppo_epochs": 1, "total_updates": args.warmup + args.updates, "seed": args.seed,
        "precision": args.precision, "device": "cpu", "torch_threads": args.threads,
        "tensorboard": False, "progress": False, "shared_prefix": args.shared_prefix,
        **(grpo_fields(args) if args.grpo else {}),
    })


def grpo_fields(args: argparse.Namespace) -> dict:
    completions = args.prompts * args.generations
    return {"advantage": "grpo", "num_generations": args.generations, "scale_rewards": "group",
            "loss_agg": "token_mean", "kl_in": "loss", "kl_estimator": "k3", "kl_coef": 0.04, "temperature": 1.0,
            "batch_size": args.prompts, "mini_batch_size": completions, "micro_batch_size": args.micro,
            "max_new_tokens": args.new_tokens, "critic_model": None}


def main() -> None:
    args = parse_args()
    import torch
    import transformers

    import ppoforge
    from ppoforge.lm.rl.trainer import RLHFTrainer
    from ppoforge.runtime.allocator import keep_freed_memory

    keep_freed_memory()  # as the `ppoforge` command does at its entry
    torch.set_num_threads(args.threads)
    wdir = Path(args.workload_dir).resolve()
    w = rlhf_workloads.load_workload(wdir)
    t_setup = time.perf_counter()
    run_dir = tempfile.TemporaryDirectory(prefix="bench-ppoforge-")  # removed when the process exits
    trainer = RLHFTrainer(rlhf_config(w, wdir, args), Path(run_dir.name))
    setup_s = time.perf_counter() - t_setup
    # Both frameworks must see the same prompt token ids (this also proves the right tokenizer loaded).
    same = sorted(map(list, trainer.inputs.prompt_ids)) == sorted(rlhf_workloads.load_prompts(wdir))
    assert same, "ppoforge tokenized the workload prompts differently from the TRL side"

    gaps, cpu = [], []  # wall and process-CPU seconds per update
    for _ in range(args.warmup + args.updates):
        start, cpu_start = time.perf_counter(), time.process_time()
        metrics, _table = trainer.train_one_update()
        gaps.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
    timed = gaps[args.warmup:]
    median = statistics.median(timed)
    result = {
        "framework": "ppoforge", "layout": args.layout, "precision": args.precision, "workload": w.name,
        "threads": torch.get_num_threads(), "warmup": args.warmup, "updates": args.updates,
        "warmup_s": gaps[: args.warmup], "update_s": timed, "median_s": median,
        "cpu_s": cpu[args.warmup:], "median_cpu_s": statistics.median(cpu[args.warmup:]),
        "samples_per_s": (args.prompts * args.generations if args.grpo else w.n_prompts) / median,
        "peak_rss_gib": rlhf_workloads.peak_rss_gib(),
        "setup_s": setup_s, "last_metrics": {k: metrics.get(k) for k in ("objective/kl", "objective/scores",
                                                                      "objective/response_length",
                                                                      "perf/shared_prefix_unit")},
        "versions": {"ppoforge": ppoforge.__version__, "transformers": transformers.__version__,
                     "torch": torch.__version__},
    }
    print("BENCH_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
