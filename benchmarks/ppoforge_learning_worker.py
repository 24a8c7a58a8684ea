"""Train ppoforge's GRPO on learning_task.py's problems for a wall-clock budget, saving LoRA snapshots.

Runs in ppoforge's venv, one process per run (learning_vs_trl.py starts it). The settings are the
`arithmetic_demo` preset's (GRPO, G = 8, 4 prompts per update, LoRA r 16 / alpha 32 on every linear layer,
learning rate 5e-4 constant, beta 0, temperature 0.7, 10 new tokens ending at the newline, one optimizer
step per rollout), with the task folder's training rows as prompts and `learning_task.answer_reward` as
the reward; no held-out pass inside the run (learning_vs_trl.py scores the snapshots afterwards, with the
same code for both sides).

The clock: updates run until their summed wall time reaches `--budget-s` or `--max-updates` have run (model
loading before the first update is not counted; neither is saving a snapshot). After the first update past
each `--every-s` mark (or every `--every-updates` updates), and after the last, the policy's adapter
weights go to `snap_K.safetensors` (peft's own state-dict names) and one line {"snapshot", "train_s",
"updates", "score"} to snapshots.jsonl.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task-dir", required=True, help="folder written by learning_task.build()")
    p.add_argument("--out", required=True, help="folder for the snapshots")
    p.add_argument("--budget-s", type=float, default=480.0, help="training wall time")
    p.add_argument("--every-s", type=float, default=60.0, help="a snapshot after each this many seconds")
    p.add_argument("--max-updates", type=int, default=None, help="stop after this many updates too")
    p.add_argument("--every-updates", type=int, default=None,
                   help="a snapshot after every this many updates (instead of --every-s)")
    p.add_argument("--precision", choices=["fp32", "bf16", "auto"], default="auto")
    p.add_argument("--rollout-engine", choices=["auto", "lean", "hf", "vllm"], default="auto",
                   help="ppoforge's rollout engine (vllm: run with a python that has vLLM, make venv-vllm)")
    p.add_argument("--lm-head-fp32", action="store_true", help="lm_head_fp32: the LM head in fp32 under bf16")
    p.add_argument("--emulate-bf16", action="store_true",
                   help="bf16 matmuls computed as bf16 hardware rounds them, at fp32 speed (bf16_emulation.py)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="prompts per update (default: the preset's 4); still one optimizer step per rollout")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="a config field over the preset's (a YAML value), e.g. skip_flat_rollouts=false; repeatable")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    import torch
    import yaml
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    import ppoforge
    from ppoforge.config import build_config, read_preset
    from ppoforge.lm.rl.config import RLHFConfig
    from ppoforge.lm.rl.trainer import RLHFTrainer
    from ppoforge.runtime.allocator import keep_freed_memory
    from ppoforge.runtime.precision import resolve_precision

    keep_freed_memory()  # as the `ppoforge` command does at its entry
    if args.emulate_bf16:
        import bf16_emulation
        bf16_emulation.install()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    preset = read_preset("arithmetic_demo", "rlhf")
    task = json.loads((Path(args.task_dir) / "task.json").read_text())["settings"]  # a battery task's budgets
    cfg = build_config(RLHFConfig, {
        **preset, **{k: task[k] for k in ("max_new_tokens", "max_prompt_tokens") if k in task},
        "prompts": str(Path(args.task_dir) / "train.jsonl"), "heldout_prompts": None,
        "reward": f"py:{HERE / 'learning_task.py'}:answer_reward", "total_updates": 10**6, "seed": args.seed,
        "precision": args.precision, "torch_threads": args.threads, "checkpoint_every": 10**9,
        "tensorboard": False, "progress": False, "lm_head_fp32": args.lm_head_fp32,
        "rollout_engine": args.rollout_engine,
        "collapse_patience": 0,  # TRL's side has no such guard: both sides train every update, and are compared
        **({"batch_size": args.batch_size, "mini_batch_size": args.batch_size * preset["num_generations"]}
           if args.batch_size else {}),
        **{k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.set)}})
    run_dir = tempfile.TemporaryDirectory(prefix="bench-learning-ppoforge-")
    trainer = RLHFTrainer(cfg, Path(run_dir.name))
    trained, mark, snaps = 0.0, args.every_s, 0
    watched = ("objective/scores", "objective/entropy", "completions/clipped_ratio", "objective/response_length",
               "policy/clipfrac_avg", "policy/grad_norm", "policy/entropy_avg")
    with open(out / "snapshots.jsonl", "w") as log, open(out / "updates.jsonl", "w") as per_update:
        while trained < args.budget_s and trainer.update < (args.max_updates or 10**9):
            start = time.perf_counter()
            metrics, _ = trainer.train_one_update()
            trained += time.perf_counter() - start
            # what a collapse shows first (entropy up, completions at the budget, the score gone)
            per_update.write(json.dumps({"update": trainer.update} | {k: metrics[k] for k in watched if k in metrics})
                             + "\n")
            last = trained >= args.budget_s or trainer.update == args.max_updates
            due = (trainer.update % args.every_updates == 0) if args.every_updates else trained >= mark
            if due or last:
                state = get_peft_model_state_dict(trainer.layout.peft, adapter_name="default")
                weights = {k: v.detach().float().contiguous() for k, v in state.items()}
                save_file(weights, out / f"snap_{snaps}.safetensors")
                log.write(json.dumps({"snapshot": snaps, "train_s": trained, "updates": trainer.update,
                                      "score": metrics["objective/scores"]}) + "\n")
                log.flush()
                snaps += 1
                while mark <= trained:
                    mark += args.every_s
    (out / "run.json").write_text(json.dumps({
        "framework": "ppoforge", "version": ppoforge.__version__, "torch": torch.__version__,
        "precision": args.precision, "lm_head_fp32": args.lm_head_fp32,
        "rollout_engine": args.rollout_engine, "emulate_bf16": args.emulate_bf16, "set": args.set,
        "resolved_precision": resolve_precision(args.precision, torch.device("cpu")),
        "updates": trainer.update, "train_s": trained, "completions_per_update": cfg.batch_size * cfg.num_generations,
        "settings": {k: getattr(cfg, k) for k in ("num_generations", "batch_size", "learning_rate", "lora_r",
                                                  "lora_alpha", "kl_coef", "temperature", "max_new_tokens",
                                                  "loss_agg", "scale_rewards", "anneal_lr")}}, indent=1))


if __name__ == "__main__":
    main()
