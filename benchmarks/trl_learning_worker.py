"""Train TRL's GRPOTrainer on learning_task.py's problems for a wall-clock budget, saving LoRA snapshots.

Runs in a TRL venv (.bench-venvs/trl-current: the newest TRL; with peft and reasoning-gym), one process
per run, started by learning_vs_trl.py. The settings are ppoforge_learning_worker.py's, in TRL's words:
the same SmolLM2-135M-Instruct checkpoint and tokenizer, the task folder's training rows (plain-text
prompts, tokenized as they are), `learning_task.answer_reward`; G = 8 (`num_generations`), 4 prompts per
optimizer step (32 completions: `per_device_train_batch_size` 16 x `gradient_accumulation_steps` 2, so
one optimizer step per generation batch and no old-log-prob pass), peft LoRA r 16 / alpha 32 / dropout 0
on every linear layer, learning rate 5e-4 constant with no warm-up, AdamW (TRL's defaults: no weight
decay, eps 1e-8, gradient-norm clip 1.0), beta 0, temperature 0.7, 10 new tokens, the newline ending a
completion as it does on ppoforge's side (the model's generation config lists it as an EOS; TRL masks the
completion after the first EOS it lists), `loss_type="grpo"` and `scale_rewards="group"` (ppoforge's
`seq_mean_token_mean` and group scaling), gradient checkpointing off (as on ppoforge's side).

`--precision fp32` is `bf16=False` (the fastest TRL setting on the CPUs measured in docs/benchmarks.md);
bf16 is `bf16=True`, GRPOConfig's default (autocast over fp32 weights).

The clock and the snapshots are ppoforge_learning_worker.py's: training steps (on_step_begin to
on_step_end) are summed until `--budget-s` (or `--max-updates` steps ran), then the trainer is told to stop;
snapshots every `--every-s` seconds or `--every-updates` steps; snapshot saves are not counted; the
trainer's construction (model loading) is outside the clock.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import learning_task  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task-dir", required=True)
    p.add_argument("--model-dir", required=True, help="the SmolLM2-135M-Instruct folder (ppoforge's cache)")
    p.add_argument("--out", required=True)
    p.add_argument("--budget-s", type=float, default=480.0)
    p.add_argument("--every-s", type=float, default=60.0)
    p.add_argument("--max-updates", type=int, default=None)
    p.add_argument("--every-updates", type=int, default=None)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    import peft
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model_state_dict
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    policy = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    newline = tok.convert_tokens_to_ids("Ċ")
    eos = policy.generation_config.eos_token_id
    policy.generation_config.eos_token_id = [*(eos if isinstance(eos, list) else [eos]), newline]
    rows = learning_task.read_rows(Path(args.task_dir) / "train.jsonl")
    cfg = json.loads((Path(args.task_dir) / "task.json").read_text())["settings"]  # the preset's
    completions = cfg["batch_size"] * cfg["num_generations"]
    data = Dataset.from_dict({"prompt": [r["prompt"] for r in rows], "entry": [r["entry"] for r in rows]})
    lora = LoraConfig(**learning_task.LORA)
    state = {"trained": 0.0, "mark": args.every_s, "snaps": 0, "stop": False}

    class Budget(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, targs, tstate, control, **k):
            state["trained"] += time.perf_counter() - self.t
            trained = state["trained"]
            last = trained >= args.budget_s or tstate.global_step == args.max_updates
            due = (tstate.global_step % args.every_updates == 0) if args.every_updates else trained >= state["mark"]
            if due or last:
                weights = get_peft_model_state_dict(trainer.model, adapter_name="default")
                save_file({n: v.detach().float().contiguous() for n, v in weights.items()},
                          out / f"snap_{state['snaps']}.safetensors")
                score = trainer._metrics["train"].get("reward", [float("nan")])[-1]
                log.write(json.dumps({"snapshot": state["snaps"], "train_s": trained, "updates": tstate.global_step,
                                      "score": score}) + "\n")
                log.flush()
                state["snaps"] += 1
                while state["mark"] <= trained:
                    state["mark"] += args.every_s
            if last:
                control.should_training_stop = True
            return control

    with tempfile.TemporaryDirectory(prefix="bench-learning-trl-") as tmp, open(out / "snapshots.jsonl", "w") as log:
        config = trl.GRPOConfig(
            output_dir=tmp, report_to=[], save_strategy="no", disable_tqdm=True, seed=args.seed, use_cpu=True,
            bf16=args.precision == "bf16",
            per_device_train_batch_size=16, gradient_accumulation_steps=completions // 16,
            num_generations=cfg["num_generations"], max_completion_length=cfg["max_new_tokens"],
            temperature=cfg["temperature"], beta=0.0, learning_rate=float(cfg["learning_rate"]),
            lr_scheduler_type="constant", warmup_steps=0, max_steps=10**5, logging_steps=1,
            gradient_checkpointing=False, loss_type="grpo", scale_rewards="group")
        trainer = trl.GRPOTrainer(model=policy, reward_funcs=learning_task.answer_reward, args=config,
                                  train_dataset=data, processing_class=tok, peft_config=lora, callbacks=[Budget()])
        trainer.train()
    (out / "run.json").write_text(json.dumps({
        "framework": "trl", "version": trl.__version__, "transformers": transformers.__version__,
        "peft": peft.__version__, "torch": torch.__version__, "precision": args.precision,
        "updates": trainer.state.global_step, "train_s": state["trained"], "completions_per_update": completions,
        "mixed_precision": trainer.accelerator.mixed_precision}, indent=1))


if __name__ == "__main__":
    main()
