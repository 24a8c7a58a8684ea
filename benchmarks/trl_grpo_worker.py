"""Time TRL 1.12's GRPOTrainer on one workload; prints one BENCH_RESULT line like ppoforge_rlhf_worker.py.

Runs in the TRL venv, one process per measurement. The workload directory's policy, tokenizer and
reward model (rlhf_workloads.py); the first `--prompts` prompts, `--generations` completions each of
`--new-tokens` tokens (EOS may stop them earlier), temperature 1.0, beta 0.04 (the KL to a frozen
reference copy, k3, in the loss), TRL's default `dapo` loss (token mean over the whole generation
batch), one optimizer step per generation: micro-batches of `--micro` completions accumulated over the
whole batch (`gradient_accumulation_steps` = steps_per_generation = completions / micro). fp32 on the
CPU, no gradient checkpointing (TRL's default is on: off as on the ppoforge side).

A step (generation, reward, reference and old log-probs, the accumulated backward passes and the
AdamW step) is timed between on_step_begin and on_step_end; the first `--warmup` steps are dropped.
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
    p.add_argument("--workload-dir", required=True)
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--generations", type=int, default=8, help="completions per prompt (G)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--micro", type=int, default=8, help="completions per forward/backward")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback

    torch.set_num_threads(args.threads)
    wdir = Path(args.workload_dir)
    tok = AutoTokenizer.from_pretrained(wdir / "tokenizer")
    prompts = [json.loads(line)["prompt"] for line in (wdir / "prompts.jsonl").read_text().splitlines()]
    steps = args.warmup + args.steps
    data = Dataset.from_dict({"prompt": (prompts[:args.prompts] * steps)})
    policy = AutoModelForCausalLM.from_pretrained(wdir / "policy", dtype=torch.float32)
    reward = AutoModelForSequenceClassification.from_pretrained(wdir / "reward", num_labels=1, dtype=torch.float32)
    completions = args.prompts * args.generations
    marks: list[tuple[float, float]] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t, self.c = time.perf_counter(), time.process_time()

        def on_step_end(self, *a, **k):
            marks.append((time.perf_counter() - self.t, time.process_time() - self.c))

    with tempfile.TemporaryDirectory(prefix="bench-trl-grpo-") as out:
        config = trl.GRPOConfig(
            output_dir=out, report_to=[], save_strategy="no", disable_tqdm=True, seed=0, use_cpu=True, bf16=False,
            per_device_train_batch_size=args.micro, gradient_accumulation_steps=completions // args.micro,
            num_generations=args.generations, max_completion_length=args.new_tokens, temperature=1.0, beta=0.04,
            max_steps=steps, learning_rate=1e-5, logging_steps=10**6, gradient_checkpointing=False,
            shuffle_dataset=False)
        trainer = trl.GRPOTrainer(model=policy, reward_funcs=reward, args=config, train_dataset=data,
                                  processing_class=tok, reward_processing_classes=tok, callbacks=[Clock()])
        trainer.train()
    assert len(marks) == steps, f"expected {steps} optimizer steps, timed {len(marks)}"
    wall, cpu = [m[0] for m in marks[args.warmup:]], [m[1] for m in marks[args.warmup:]]
    median = statistics.median(wall)
    print("BENCH_RESULT " + json.dumps({
        "framework": "trl", "layout": "trl", "precision": "fp32", "update_s": wall, "median_s": median,
        "median_cpu_s": statistics.median(cpu), "samples_per_s": completions / median,
        "peak_rss_gib": rlhf_workloads.peak_rss_gib(),
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
    }), flush=True)


if __name__ == "__main__":
    main()
