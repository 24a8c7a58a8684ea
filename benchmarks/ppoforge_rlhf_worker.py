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
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import flops  # noqa: E402
import rlhf_workloads  # noqa: E402


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload-dir", required=True, help="directory written by rlhf_workloads.build()")
    p.add_argument("--layout", choices=["full", "lora"], default="lora", help="ppoforge model layout")
    p.add_argument("--precision", choices=["fp32", "bf16", "auto"], default="fp32",
                   help="ppoforge precision (auto: bf16 where the device computes it natively, else fp32)")
    p.add_argument("--updates", type=int, default=5, help="timed PPO updates (after the warm-up)")
    p.add_argument("--warmup", type=int, default=1, help="untimed PPO updates run first")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--device", default="cpu", help="ppoforge's device: cpu (the CPU figures), cuda or cuda:N")
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
    p.add_argument("--rollout-engine", choices=["auto", "lean", "hf", "vllm"], default="auto",
                   help="ppoforge's rollout engine (vllm: run this worker with a python that has vLLM)")
    p.add_argument("--attn", choices=["auto", "eager", "sdpa"], default="auto",
                   help="ppoforge's attn_implementation for the training and scoring forwards")
    return p


def parse_args() -> argparse.Namespace:
    return parser().parse_args()


def worker_args(**fields) -> argparse.Namespace:
    """The worker's arguments as its command line's defaults give them, with `fields` set: for a caller that
    builds the same trainer in its own process (profile_grpo.py, the tests)."""
    return argparse.Namespace(**(vars(parser().parse_args(["--workload-dir", ""])) | fields))


def rlhf_config(w: rlhf_workloads.Workload, wdir: Path, args: argparse.Namespace, prompts: Path):
    from ppoforge.config import build_config
    from ppoforge.lm.rl.config import RLHFConfig

    return build_config(RLHFConfig, {
        "model": str(wdir / "policy"), "tokenizer": str(wdir / "tokenizer"), "layout": args.layout,
        "critic_model": str(wdir / "reward") if args.layout == "full" else None,
        "prompts": str(prompts), "heldout_prompts": None, "use_chat_template": False,
        # a `task` workload: the TRL side's own Python reward (reasoning_workload.py) over the rows' `entry`
        "reward": f"py:{HERE / 'reasoning_workload.py'}:reasoning_reward" if w.task else f"model:{wdir / 'reward'}",
        "max_prompt_tokens": w.prompt_len, "max_new_tokens": w.new_tokens,
        "batch_size": w.n_prompts, "mini_batch_size": w.n_prompts, "micro_batch_size": w.micro_batch,
        "ppo_epochs": 1, "total_updates": args.warmup + args.updates, "seed": args.seed,
        "precision": args.precision, "device": args.device, "torch_threads": args.threads,
        "tensorboard": False, "progress": False, "shared_prefix": args.shared_prefix,
        "attn_implementation": args.attn, "rollout_engine": args.rollout_engine,
        **(grpo_fields(args, w) if args.grpo else {}),
    })


def grpo_fields(args: argparse.Namespace, w: rlhf_workloads.Workload) -> dict:
    completions = args.prompts * args.generations
    return {"advantage": "grpo", "num_generations": args.generations, "scale_rewards": "group",
            "loss_agg": "token_mean", "kl_in": "loss", "kl_estimator": "k3", "kl_coef": w.beta, "temperature": 1.0,
            "batch_size": args.prompts, "mini_batch_size": completions, "micro_batch_size": args.micro,
            "max_new_tokens": args.new_tokens, "critic_model": None,
            # TRL trains on every rollout; a flat one (every reward equal, as a small model's answers to
            # a `reasoning` prompt often are) must cost the same forward and backward here to be timed alike
            "skip_flat_rollouts": False}


def main() -> None:
    args = parse_args()
    import torch
    import transformers

    import ppoforge
    from ppoforge.lm.rl.trainer import RLHFTrainer
    from ppoforge.runtime.allocator import keep_freed_memory
    from ppoforge.runtime.precision import resolve_precision

    keep_freed_memory()  # as the `ppoforge` command does at its entry
    torch.set_num_threads(args.threads)
    wdir = Path(args.workload_dir).resolve()
    w = rlhf_workloads.load_workload(wdir)
    t_setup = time.perf_counter()
    run_dir = tempfile.TemporaryDirectory(prefix="bench-ppoforge-")  # removed when the process exits
    prompts = wdir / "prompts.jsonl"
    if w.task:  # as on the TRL side, every step's prompts are the file's first --prompts rows
        prompts = Path(run_dir.name) / "prompts.jsonl"
        prompts.write_text("".join((wdir / "prompts.jsonl").read_text().splitlines(keepends=True)[:args.prompts]))
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    trainer = RLHFTrainer(rlhf_config(w, wdir, args, prompts), Path(run_dir.name))
    setup_s = time.perf_counter() - t_setup
    # Both frameworks must see the same prompt token ids (this also proves the right tokenizer loaded).
    same = sorted(map(list, trainer.inputs.prompt_ids)) == sorted(r["input_ids"] for r in rows)
    assert same, "ppoforge tokenized the workload prompts differently from the TRL side"
    prompt_len = {r["prompt"]: len(r["input_ids"]) for r in rows}

    # per update: wall and process-CPU s, mean completion length, prompt lengths, shared-prefix unit size
    gaps, cpu, lengths, step_prompts, units, syncs, gen_share = [], [], [], [], [], [], []
    for _ in range(args.warmup + args.updates):
        start, cpu_start = time.perf_counter(), time.process_time()
        metrics, table = trainer.train_one_update()
        gaps.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
        lengths.append(metrics["objective/response_length"])  # the mean over the rollout, EOS included
        step_prompts.append([prompt_len[t["prompt"]] for t in table[::args.generations if args.grpo else 1]])
        units.append(metrics["perf/shared_prefix_unit"])
        syncs.append(metrics.get("perf/weight_sync_s", 0.0))
        gen_share.append(metrics["perf/generation_share"])
    timed = gaps[args.warmup:]
    median = statistics.median(timed)
    n = args.prompts * args.generations if args.grpo else w.n_prompts
    mean_len = statistics.mean(lengths[args.warmup:])
    timed_prompts = [sum(ps) / len(ps) for ps in zip(*step_prompts[args.warmup:], strict=True)]
    # LoRA: the frozen base's backward is activation gradients only (~1 x the forward); full: 2 x (flops.py).
    # Executed: shared_prefix auto prefills each prompt once and trains rows of `unit` completions per prompt copy
    g, unit = (args.generations if args.grpo else 1), statistics.mean(units[args.warmup:])
    est = flops.grpo_step_flops(flops.matmul_params(**dataclasses.asdict(w)), timed_prompts, mean_len * n, g,
                                backward=2 if args.layout == "lora" else 4, reference=w.beta > 0 if args.grpo else True,
                                gen_prompt_copies=1 if args.shared_prefix == "auto" else g,
                                train_prompt_copies=g / unit)
    result = {
        "framework": "ppoforge", "layout": args.layout, "precision": args.precision, "workload": w.name,
        "threads": torch.get_num_threads(), "warmup": args.warmup, "updates": args.updates,
        "warmup_s": gaps[: args.warmup], "update_s": timed, "median_s": median,
        "cpu_s": cpu[args.warmup:], "median_cpu_s": statistics.median(cpu[args.warmup:]),
        "samples_per_s": n / median, "completions_per_s": n / median, "mean_completion_len": mean_len,
        "step_lengths": lengths, "prompt_tokens": timed_prompts, "flops_per_step": est, "shared_prefix_units": units,
        "resolved_precision": resolve_precision(args.precision, torch.device(args.device)),
        "peak_rss_gib": rlhf_workloads.peak_rss_gib(), "device": args.device,
        "peak_cuda_gib": rlhf_workloads.peak_cuda_gib(),
        "setup_s": setup_s, "rollout_engine": trainer.engine.name,
        "weight_sync_s": syncs[args.warmup:], "generation_share": gen_share[args.warmup:],
        "logprob_mismatch_max": metrics.get("rollout/logprob_mismatch_max"),
        "last_metrics": {k: metrics.get(k) for k in ("objective/kl", "objective/scores",
                                                                      "objective/response_length",
                                                                      "perf/shared_prefix_unit")},
        "versions": {"ppoforge": ppoforge.__version__, "transformers": transformers.__version__,
                     "torch": torch.__version__},
    }
    print("BENCH_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
