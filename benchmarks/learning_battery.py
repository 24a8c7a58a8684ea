"""Held-out accuracy per update, ppoforge's GRPO against TRL's GRPOTrainer, on a battery of reasoning-gym tasks
that neither side was tuned on.

    .venv/bin/python benchmarks/learning_battery.py probe                 # untrained accuracy of every task
    .venv/bin/python benchmarks/learning_battery.py run --seeds 1,2       # the battery (both sides, per update)
    .venv/bin/python benchmarks/learning_battery.py run --tasks products,gcd --seeds 1 --max-updates 8
    .venv/bin/python benchmarks/learning_battery.py report --inputs A/learning_battery.json B/learning_battery.json
    .venv/bin/python benchmarks/learning_battery.py run --tasks products --work /tmp/battery-products-XXXX  # continue

Each task (TASKS: six kinds — arithmetic other than chain_sum, counting, ordering, string manipulation, a
date task, a short word problem) is built by `learning_task.build_task`: its own few-shot header (two solved
problems of its generator), a held-out set of another generator seed left out of training, the prompt budget
set from the longest prompt (nothing cut), its own answer budget. Both sides then train with the
`arithmetic_demo` preset's settings (G 8, 4 prompts per update, LoRA r 16 / alpha 32 on all linear layers,
lr 5e-4 constant, beta 0, temperature 0.7, one optimizer step per rollout), both in fp32, through
learning_vs_trl.py's two workers, and its one evaluator scores the untrained model and every snapshot (HF
`generate` in fp32 at the training temperature, `--samples` per held-out problem, one seed for all).

Output under --out: learning_battery.json (every point, per task and seed), learning_battery.md (the table:
per task and side the mean accuracy at each snapshot with the seeds' range, and "ppoforge - TRL" at the last
snapshot against the seeds' spread) and learning_battery.png (one panel per task).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import learning_task  # noqa: E402
import learning_vs_trl  # noqa: E402

# name -> (reasoning-gym config, answer budget in tokens: "<answer>" 3 + "</answer>" 4 + "\n" 1 + the answer)
TASKS = {
    "products": ({"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}, 12),           # arithmetic
    "letter_counting": ({"min_words": 3, "max_words": 5}, 12),                                     # counting
    "word_sequence_reversal": ({"min_words": 2, "max_words": 2}, 16),                              # ordering
    "isomorphic_strings": ({"min_string_length": 2, "max_string_length": 4}, 12),                  # strings
    "calendar_arithmetic": ({"tasks": ["weekday_offset"]}, 12),                                    # dates
    "leg_counting": ({"min_animals": 1, "max_animals": 1, "max_instances": 3}, 12),                # word problem
}
CANDIDATES = {  # probed, not in the battery: other kinds to swap in
    "number_sorting": ({"min_numbers": 2, "max_numbers": 2, "min_decimals": 0, "max_decimals": 0, "min_value": 0,
                        "max_value": 99}, 20),
    "gcd": ({"min_numbers": 2, "max_numbers": 2, "max_value": 50}, 12),
    "count_bits": ({"max_n": 63}, 12),
    "syllogism": ({}, 12),
    "spell_backward": ({"min_word_len": 3, "max_word_len": 3}, 14),  # untrained 1.6 %: too hard for the model
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["probe", "run", "report"])
    p.add_argument("--inputs", nargs="+", default=[], help="report: learning_battery.json files to merge (tasks "
                   "run in separate processes) into one table and figure")
    p.add_argument("--tasks", default=",".join(TASKS), help="comma list of TASKS' names")
    p.add_argument("--seeds", default="1,2")
    p.add_argument("--max-updates", type=int, default=12)
    p.add_argument("--every-updates", type=int, default=4)
    p.add_argument("--heldout", type=int, default=32, help="held-out problems per task")
    p.add_argument("--samples", type=int, default=4, help="completions scored per held-out problem")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--trl-venv", default=str(HERE.parent / ".bench-venvs" / "trl-current"))
    p.add_argument("--sides", default="ppoforge,trl")
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--work", default=None, help="run: one task's work dir to continue (a run cut short): its task "
                   "files kept, each seed and side whose run reached --max-updates reused, the rest run")
    p.add_argument("--timeout", type=float, default=3600.0, help="per worker")
    p.add_argument("--quiet-wait", type=float, default=0.0, help="learning is not timed: no wait by default")
    return p.parse_args()


def worker_args(args: argparse.Namespace) -> argparse.Namespace:
    """learning_vs_trl.train_side's arguments: per update, fp32 on both sides, no wall-clock budget."""
    return argparse.Namespace(budget_s=1e9, every_s=1e9, max_updates=args.max_updates, every_updates=args.every_updates,
                              threads=args.threads, ppoforge_precision="fp32", ppoforge_batch=None,
                              ppoforge_lm_head_fp32=False, ppoforge_emulate_bf16=False, trl_precision="fp32",
                              trl_venv=args.trl_venv, timeout=args.timeout, quiet_wait=args.quiet_wait)


def evaluator(model_dir: Path, work: Path, samples: int) -> learning_vs_trl.Evaluator:
    task = json.loads((work / "task.json").read_text())
    return learning_vs_trl.Evaluator(model_dir, learning_task.read_rows(work / "heldout.jsonl"), samples, seed=1234,
                                     new_tokens=task["settings"]["max_new_tokens"])


def probe(args: argparse.Namespace, model_dir: Path) -> None:
    """The untrained model's held-out accuracy on every task (the battery keeps tasks at 5-60 %)."""
    import torch

    torch.set_num_threads(args.threads)
    for name in args.tasks.split(","):
        work = Path(tempfile.mkdtemp(prefix=f"battery-{name}-"))
        info = learning_task.build_task(work, name, *(TASKS | CANDIDATES)[name], heldout=args.heldout)
        point = evaluator(model_dir, work, args.samples).score(None)
        print(f"{name}: untrained {point['accuracy']:.1%} ({point['exact']}/{point['n']}), tagged "
              f"{point['tagged']:.0%}, prompts <= {info['prompt_tokens']} tokens, {info['train_rows']} training rows; "
              f"e.g. {point['example']!r}", flush=True)


def run_task(args: argparse.Namespace, name: str, model_dir: Path) -> dict:
    """One task: both sides for every seed, then every snapshot scored."""
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix=f"battery-{name}-"))
    kept = work / "task" / "task.json"
    info = (json.loads(kept.read_text()) if kept.is_file()
            else learning_task.build_task(work / "task", name, *TASKS[name], heldout=args.heldout))
    print(f"[task] {name}: {info['train_rows']} training rows, {info['heldout_rows']} held out, prompts <= "
          f"{info['prompt_tokens']} tokens; work dir {work}", flush=True)
    wargs, runs = worker_args(args), {}
    for seed in [int(s) for s in args.seeds.split(",")]:
        for side in args.sides.split(","):
            runs.setdefault(str(seed), {})[side] = (_finished(side, work / f"seed{seed}" / side, args.max_updates)
                                                   or learning_vs_trl.train_side(side, wargs, work, model_dir, seed))
    ev = evaluator(model_dir, work / "task", args.samples)
    score = scorer(ev, work / f"scores_{args.samples}.json")
    start = {"updates": 0, "train_s": 0.0, **score(None)}
    for sides in runs.values():
        for side in sides.values():
            side["points"] = [start] + [{"updates": s["updates"], "train_s": s["train_s"], "train_score": s["score"],
                                         **score(Path(side["dir"]) / f"snap_{s['snapshot']}.safetensors")}
                                        for s in side["snapshots"]]
    return {"task": info, "runs": runs, "curves": learning_vs_trl.mean_curves(runs, "updates")}


def scorer(ev: learning_vs_trl.Evaluator, cache: Path):
    """`ev.score`, remembered in `cache` by the snapshot's sha256 (None: the untrained model): a run continued
    with --work scores only its new snapshots (the evaluator is seeded, so a score is the same each time)."""
    known = json.loads(cache.read_text()) if cache.is_file() else {}

    def score(snapshot: Path | None) -> dict:
        key = hashlib.sha256(snapshot.read_bytes()).hexdigest() if snapshot else "untrained"
        if key not in known:
            known[key] = ev.score(snapshot)
            cache.write_text(json.dumps(known, indent=1))
        return known[key]
    return score


def _finished(side: str, out: Path, updates: int) -> dict | None:
    """A side's run in `out` that reached `updates` (kept by --work), else None."""
    snapshots = out / "snapshots.jsonl"
    if not (out / "run.json").is_file() or not snapshots.is_file():
        return None
    if max((r["updates"] for r in learning_task.read_rows(snapshots)), default=0) < updates:
        return None
    print(f"[run] {side}: reusing {out}", flush=True)
    return learning_vs_trl.side_result(side, out, None)


def table(results: dict) -> list[str]:
    """Per task and side: mean held-out accuracy per snapshot (the seeds' lowest-highest), and at the last
    snapshot ppoforge - TRL against the larger of the two sides' spreads (highest - lowest)."""
    updates = _updates(results)
    lines = ["| task | side | " + " | ".join(f"update {u}" for u in updates) + " | last: ppoforge − TRL |",
             "|---" * (3 + len(updates)) + "|"]
    gaps = []
    for name, res in results.items():
        curves = res["curves"]
        for side, curve in curves.items():
            cells = [f"{m:.1%} [{lo:.0%}–{hi:.0%}]" for _, m, lo, hi in curve]
            gap = ""
            if side == "ppoforge" and "trl" in curves:
                (_, m_p, lo_p, hi_p), (_, m_t, lo_t, hi_t) = curves["ppoforge"][-1], curves["trl"][-1]
                spread = max(hi_p - lo_p, hi_t - lo_t)
                gaps.append((name, m_p - m_t, spread, m_p, m_t))
                verdict = "at parity or better" if m_p - m_t >= -spread else "BELOW"
                gap = f"{m_p - m_t:+.1%} (spread {spread:.1%}: {verdict})"
            lines.append(f"| {name} | {side} | " + " | ".join(cells) + f" | {gap} |")
    if gaps:
        mean_p, mean_t = (sum(g[i] for g in gaps) / len(gaps) for i in (3, 4))
        lines.append(f"\nMean over {len(gaps)} tasks at the last snapshot: ppoforge {mean_p:.1%}, TRL {mean_t:.1%} "
                     f"({mean_p - mean_t:+.1%}); tasks below TRL beyond the seeds' spread: "
                     f"{', '.join(g[0] for g in gaps if g[1] < -g[2]) or 'none'}.")
    return lines


def _updates(results: dict) -> list[int]:
    first = next(iter(results.values()))["curves"]
    return [int(c[0]) for c in next(iter(first.values()))]


def plot(results: dict, path: Path, title: str) -> None:
    """One panel per task: each side's mean over seeds per update, the seeds' range shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(results)
    cols = min(3, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False, sharey=True)
    for ax, (name, res) in zip(axes.flat, results.items(), strict=False):
        for side, colour in (("ppoforge", "tab:blue"), ("trl", "tab:orange")):
            curve = res["curves"].get(side)
            if not curve:
                continue
            xs = [c[0] for c in curve]
            ax.plot(xs, [100 * c[1] for c in curve], marker="o", color=colour, label="TRL" if side == "trl" else side)
            ax.fill_between(xs, [100 * c[2] for c in curve], [100 * c[3] for c in curve], color=colour, alpha=0.2)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("updates")
        ax.grid(alpha=0.3)
    for ax in axes.flat[n:]:
        ax.axis("off")
    axes[0][0].set_ylabel("held-out exact (%)")
    axes[0][0].legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    args = parse_args()
    from ppoforge.lm.models.smollm2 import ensure_cached

    model_dir = ensure_cached()
    if args.mode == "probe":
        probe(args, model_dir)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "learning_battery.json"
    results = {}
    if args.mode == "report":
        for f in args.inputs:
            results |= json.loads(Path(f).read_text())["results"]
    for name in args.tasks.split(",") if args.mode == "run" else []:
        results[name] = run_task(args, name, model_dir)
        path.write_text(json.dumps({"args": vars(args), "results": results}, indent=1))  # each task as it ends
        print("\n".join(table({name: results[name]})), flush=True)
    path.write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    lines = table(results)
    (out / "learning_battery.md").write_text("\n".join(lines) + "\n")
    cpu = learning_vs_trl.cpu_name()
    plot(results, out / "learning_battery.png",
         f"SmolLM2-135M-Instruct, GRPO G 8, LoRA r16, fp32 both; {args.heldout} held-out x {args.samples}; "
         f"seeds {args.seeds}; {cpu}")
    print("\n".join(lines))
    print(f"[out] {path}, {out / 'learning_battery.md'}, {out / 'learning_battery.png'}")


if __name__ == "__main__":
    main()
