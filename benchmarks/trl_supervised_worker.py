"""Time TRL 1.12's SFTTrainer or RewardTrainer on one workload; prints one BENCH_RESULT line.

Runs in the TRL venv (.bench-venvs/trl), one process per measurement. The model, tokenizer and data
are the workload directory's (rlhf_workloads.py): SFT trains `policy/` on sft.jsonl (prompt /
completion strings: TRL's completion-only loss), the reward model trains `reward/` (a
Qwen2ForSequenceClassification) on pairs.jsonl (explicit prompt). Same shape as the ppoforge side:
`--batch` examples per optimizer step in micro-batches of `--micro` (gradient accumulation), AdamW,
linear schedule, no evaluation, no checkpoints, fp32 on the CPU (`--precision bf16`: TRL's bf16 flag,
which is its default and on the CPU means bf16 autocast; `--padding-free`: SFTConfig's padding_free), no
gradient checkpointing (TRL 1.12 turns it on by default; ppoforge does not, and recomputing would only
slow TRL down here).

How a step is timed: a TrainerCallback stamps perf_counter at on_step_begin and on_step_end (the
data loading of the step's micro-batches happens inside, as in ppoforge's step); the first
`--warmup` steps are dropped, the medians of the rest reported. Peak RSS: the process's VmHWM.
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
    import trl
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback

    torch.set_num_threads(args.threads)
    wdir = Path(args.workload_dir).resolve()
    tok = AutoTokenizer.from_pretrained(wdir / "tokenizer")
    tok.padding_side = "right"
    steps = args.warmup + args.steps
    marks: list[tuple[float, float]] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t, self.c = time.perf_counter(), time.process_time()

        def on_step_end(self, *a, **k):
            marks.append((time.perf_counter() - self.t, time.process_time() - self.c))

    common = dict(per_device_train_batch_size=args.micro, gradient_accumulation_steps=args.batch // args.micro,
                  max_steps=steps, learning_rate=2e-4, lr_scheduler_type="linear", logging_steps=10**6,
                  save_strategy="no", eval_strategy="no", report_to=[], use_cpu=True, bf16=args.precision == "bf16",
                  dataloader_num_workers=0, gradient_checkpointing=False, disable_tqdm=True, seed=0,
                  max_length=args.max_length)
    peft_config = None
    if args.layout == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                                 task_type="CAUSAL_LM" if args.task == "sft" else "SEQ_CLS")
    with tempfile.TemporaryDirectory(prefix="bench-trl-sup-") as out:
        if args.task == "sft":
            data = load_dataset("json", data_files=str(wdir / "sft.jsonl"), split="train")
            model = AutoModelForCausalLM.from_pretrained(wdir / "policy", dtype=torch.float32)
            if args.padding_free:  # TRL refuses a max_length it would not enforce; every row here is shorter
                common["max_length"] = None
            sft_args = trl.SFTConfig(output_dir=out, padding_free=args.padding_free, **common)
            trainer = trl.SFTTrainer(model=model, args=sft_args, train_dataset=data,
                                     processing_class=tok, peft_config=peft_config, callbacks=[Clock()])
        else:
            data = load_dataset("json", data_files=str(wdir / "pairs.jsonl"), split="train")
            model = AutoModelForSequenceClassification.from_pretrained(wdir / "reward", num_labels=1,
                                                                       dtype=torch.float32)
            trainer = trl.RewardTrainer(model=model, args=trl.RewardConfig(output_dir=out, **common),
                                        train_dataset=data, processing_class=tok, peft_config=peft_config,
                                        callbacks=[Clock()])
        trainer.train()
    wall, cpu = [m[0] for m in marks[args.warmup:]], [m[1] for m in marks[args.warmup:]]
    median = statistics.median(wall)
    print("BENCH_RESULT " + json.dumps({
        "framework": "trl", "task": args.task, "layout": args.layout, "step_s": wall, "median_s": median,
        "median_cpu_s": statistics.median(cpu), "examples_per_s": args.batch / median,
        "peak_rss_gib": rlhf_workloads.peak_rss_gib(),
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
    }), flush=True)


if __name__ == "__main__":
    main()
