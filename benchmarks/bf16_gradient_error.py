"""How far bf16 moves a GRPO gradient: the same rollout and weights, the update's gradient in fp32 and in bf16.

The arithmetic preset (SmolLM2-135M-Instruct, LoRA, G = 8, 4 prompts) on its harder variant (two-digit
operands) trains in fp32 for `--updates` updates. At every update whose advantages are not all zero, before
the optimizer steps, the mini-batch's gradient (every LoRA tensor, accumulated as the trainer does) is
computed again several ways on the same rollout and weights, each against fp32:

- bf16: autocast, as `precision: bf16` trains (its matmuls by bf16_emulation.py: bf16 hardware's
  rounding at fp32 speed, so this runs on any CPU);
- bf16, fp32 head: `lm_head_fp32: true`;
- fp32 body, bf16 head: only the logits rounded (autocast around the LM head alone);
- bf16 but fp32 attention / fp32 MLP / fp32 LoRA adapters: one part of every layer kept in fp32;
- bf16, every advantage 1: the gradient of the completions' summed log-likelihood, where nothing cancels
  (a group's advantages sum to 0, so GRPO's gradient is a difference of near-equal terms).

Printed per update: |g - g_fp32| / |g_fp32| for each, and the bf16 gradient's norm over fp32's; one JSON
line at the end.

    .venv/bin/python benchmarks/bf16_gradient_error.py --updates 14 --seed 1
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import tempfile
from pathlib import Path

import torch

import bf16_emulation
from ppoforge.config import build_config, read_preset
from ppoforge.lm.models.parts import head_in_fp32
from ppoforge.lm.rl.config import RLHFConfig
from ppoforge.lm.rl.trainer import RLHFTrainer
from ppoforge.runtime.allocator import keep_freed_memory
from ppoforge.runtime.precision import Precision

PARTS = {"attention": lambda name, mod: type(mod).__name__.endswith("Attention"),
         "MLP": lambda name, mod: type(mod).__name__.endswith("MLP"),
         "LoRA": lambda name, mod: name.endswith((".lora_A.default", ".lora_B.default"))}


@contextlib.contextmanager
def fp32_inside(model: torch.nn.Module, part: str):
    """The modules of `part` compute in fp32 (autocast off, their floating inputs upcast) while inside."""
    changed = []
    for name, mod in model.named_modules():
        if PARTS[part](name, mod):
            def forward(*args, _inner=mod.forward, **kwargs):
                up = lambda v: v.float() if torch.is_tensor(v) and v.is_floating_point() else v  # noqa: E731
                with torch.autocast("cpu", enabled=False):
                    return _inner(*map(up, args), **{k: up(v) for k, v in kwargs.items()})
            mod.forward = forward
            changed.append(mod)
    try:
        yield
    finally:
        for mod in changed:
            del mod.forward


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--updates", type=int, default=14)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--digits", type=int, default=2, help="operand digits (min = max)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    keep_freed_memory()
    torch.set_num_threads(args.threads)
    preset = read_preset("arithmetic_demo", "rlhf")  # its task and few-shot header, at --digits operand digits
    one_digit = "min_digits=1&max_digits=1"
    assert one_digit in preset["prompts"], "the preset's task spec changed: update the digits rewrite"
    task = preset["prompts"].replace(one_digit, f"min_digits={args.digits}&max_digits={args.digits}")
    cfg = build_config(RLHFConfig, {
        **preset, "prompts": task, "heldout_prompts": None, "precision": "fp32",
        "total_updates": 10**6, "seed": args.seed, "torch_threads": args.threads, "checkpoint_every": 10**9,
        "tensorboard": False, "progress": False})
    trainer = RLHFTrainer(cfg, Path(tempfile.mkdtemp(prefix="bf16-gradient-")))
    model, params, ppo = trainer.layout.policy_model, trainer.ppo.params, trainer.ppo
    fp32, bf16 = Precision("fp32", torch.device("cpu")), Precision("bf16", torch.device("cpu"))

    def gradient(b, precision: Precision) -> torch.Tensor:
        ppo.precision = precision
        emulate = bf16_emulation.EmulatedBf16Matmuls() if precision is bf16 else contextlib.nullcontext()
        with emulate:
            ppo._mini_batch_gradients(b, torch.arange(cfg.rollout_size), trainer.optimizer, 0.0)
        ppo.precision = fp32
        return torch.cat([(q.grad if q.grad is not None else torch.zeros_like(q)).flatten() for q in params])

    def head_alone_in_bf16(hidden):
        with torch.autocast("cpu", dtype=torch.bfloat16), bf16_emulation.EmulatedBf16Matmuls():
            return trainer.layout.logits(hidden)

    rows, plain_update = [], trainer.ppo_update

    def measured_update(b):
        if b.adv.any():
            exact = gradient(b, fp32)
            rel = lambda g: ((g - exact).norm() / exact.norm()).item()  # noqa: E731
            g16 = gradient(b, bf16)
            row = {"update": trainer.update + 1, "bf16": rel(g16), "norm_ratio": (g16.norm() / exact.norm()).item()}
            ppo._logits, plain_logits = head_alone_in_bf16, ppo._logits
            row["fp32 body, bf16 head"] = rel(gradient(b, fp32))
            ppo._logits = plain_logits
            for part in PARTS:
                with fp32_inside(model, part):
                    row[f"bf16, fp32 {part}"] = rel(gradient(b, bf16))
            ones = dataclasses.replace(b, adv=torch.ones_like(b.adv))
            row["bf16, every advantage 1"] = ((gradient(ones, bf16) - (e1 := gradient(ones, fp32))).norm()
                                              / e1.norm()).item()
            head_in_fp32(model)
            row["bf16, fp32 head"] = rel(gradient(b, bf16))
            del model.get_output_embeddings().forward, model.get_output_embeddings().computes_in_fp32
            rows.append(row)
            print(" | ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
                  flush=True)
        return plain_update(b)

    trainer.ppo_update = measured_update
    for _ in range(args.updates):
        trainer.train_one_update()
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0] if k != "update"} if rows else {}
    print("mean over updates: " + " | ".join(f"{k} {v:.3f}" for k, v in mean.items()))
    print("BENCH_RESULT " + json.dumps({"seed": args.seed, "digits": args.digits, "torch": torch.__version__,
                                        "rows": rows, "mean": mean}), flush=True)


if __name__ == "__main__":
    main()
