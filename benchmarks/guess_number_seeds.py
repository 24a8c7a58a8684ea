"""`--preset guess_number` over several seeds: held-out games solved within the turn budget, per evaluation.

    .venv/bin/python benchmarks/guess_number_seeds.py --seeds 1,2,3 --parallel 2 --threads 1
    .venv/bin/python benchmarks/guess_number_seeds.py --report /tmp/gn/B1,/tmp/gn/B2      # runs already made
    .venv/bin/python benchmarks/guess_number_seeds.py --seeds 1 --out /tmp/gn16 -- \
        --env "guess_number?hi=16&invalid=-0.1&feedback=range&progress=1.0"                 # a harder variant

Each seed is `ppoforge train rlhf --preset guess_number --seed S --torch-threads T --run-dir OUT/seed_S`
(`--parallel` of them at once: with `--threads 1` two seeds share the two cores, one each; arguments after
`--` go to every run, e.g. another `--env` or `--max-turns`). A held-out game
counts as solved when its return shows the right guess: with the preset's environment (`progress` c,
`invalid` p per reply without a number) an unsolved game returns at most c, a solved one at least
1 + c + p * (max_turns - 1), and the report refuses settings where the two could meet. Output under
--out: guess_number_seeds.json (per seed and evaluation: solved / games, Wilson's 95 % interval, the
run's wall time), guess_number_seeds.png (solved fraction against updates, one line per seed, error
bars, with the yardsticks of the run's range and turn budget: random distinct guesses, random guesses
among the numbers the feedback allows, binary search) and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--parallel", type=int, default=1, help="seeds run at once")
    p.add_argument("--threads", type=int, default=2, help="torch threads per seed")
    p.add_argument("--preset", default="guess_number")
    p.add_argument("--report", default=None, help="comma list of finished run dirs: report them, run nothing")
    p.add_argument("--out", default=str(HERE / "results"))
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:cut])
    args.extra = argv[cut + 1:]
    return args


def yardsticks(hi: int, turns: int) -> dict[str, float]:
    """Chance of solving a game of secrets 1..hi in `turns` guesses: guessing distinct numbers at random,
    guessing at random among the numbers the feedback ("Higher." / "Lower.") still allows, binary search."""
    allowed = [[0.0] * (turns + 1) for _ in range(hi + 1)]  # allowed[n][t]: n candidates, t guesses left
    for t in range(1, turns + 1):
        for n in range(1, hi + 1):  # secret and guess uniform over the n candidates, independent
            rest = sum((i - 1) * allowed[i - 1][t - 1] + (n - i) * allowed[n - i][t - 1] for i in range(1, n + 1))
            allowed[n][t] = 1 / n + rest / n ** 2
    return {"random distinct guesses": min(turns, hi) / hi, "random guesses the feedback allows": allowed[hi][turns],
            "binary search": min(hi, 2 ** turns - 1) / hi}


def solved_threshold(cfg: dict, options: dict) -> float:
    """The return above which a game was solved (see the module docstring); `options`: the env spec's."""
    c, p = float(options.get("progress", 0.0)), float(options.get("invalid", 0.0))
    solved_min = 1.0 + c + min(p, 0.0) * (cfg["max_turns"] - 1)
    if solved_min <= c:
        raise SystemExit(f"{cfg['env']}: a solved game can return as little as an unsolved one; cannot count")
    return (solved_min + c) / 2


def report_run(run_dir: Path) -> dict:
    from ppoforge.config import parse_query
    from ppoforge.core.stats import binomial_interval

    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    _, options = parse_query(cfg["env"], cfg["env"], "environment")
    threshold, top = solved_threshold(cfg, options), int(options.get("hi", 16))  # 16: the env's default range

    games = collections.defaultdict(list)
    for line in (run_dir / "completions.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["split"] == "heldout":
            games[row["step"]].append(row["score"] > threshold)
    points = []
    for step, solved in sorted(games.items()):
        lo, hi = binomial_interval(sum(solved), len(solved))
        points.append({"update": step, "solved": sum(solved), "games": len(solved), "rate": sum(solved) / len(solved),
                       "lo": lo, "hi": hi})
    timing = json.loads((run_dir / "timing.json").read_text()) if (run_dir / "timing.json").exists() else {}
    return {"run_dir": str(run_dir), "seed": cfg["seed"], "env": cfg["env"], "threshold": threshold,
            "hi": top, "max_turns": cfg["max_turns"], "yardsticks": yardsticks(top, cfg["max_turns"]),
            "points": points, **timing}


def run_seeds(args: argparse.Namespace, out: Path) -> list[Path]:
    pending, running, dirs = args.seeds.split(","), [], []
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    while pending or running:
        while pending and len(running) < args.parallel:
            seed = pending.pop(0)
            run_dir = out / f"seed_{seed}"
            cmd = [str(ROOT / ".venv" / "bin" / "ppoforge"), "train", "rlhf", "--preset", args.preset, "--seed", seed,
                   "--torch-threads", str(args.threads), "--run-dir", str(run_dir), "--progress", "false", *args.extra]
            log = open(out / f"seed_{seed}.log", "w")  # noqa: SIM115 (the child writes it until it exits)
            running.append((run_dir, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env),
                            time.perf_counter()))
            dirs.append(run_dir)
        time.sleep(5)
        for item in list(running):
            run_dir, proc, start = item
            if proc.poll() is not None:
                running.remove(item)
                if proc.returncode:
                    raise SystemExit(f"{run_dir}: exit {proc.returncode} (log {run_dir}.log)")
                (run_dir / "timing.json").write_text(json.dumps({"wall_s": time.perf_counter() - start,
                                                                 "threads": args.threads, "parallel": args.parallel}))
    return dirs


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for run in runs:
        pts = run["points"]
        ax.errorbar([p["update"] for p in pts], [100 * p["rate"] for p in pts], capsize=3, marker="o",
                    yerr=[[100 * (p["rate"] - p["lo"]) for p in pts], [100 * (p["hi"] - p["rate"]) for p in pts]],
                    label=f"seed {run['seed']}")
    for (name, rate), style in zip(runs[0]["yardsticks"].items(), (":", "--", "-."), strict=True):
        if rate < 1:
            ax.axhline(100 * rate, color="grey", ls=style, label=f"{name} ({rate:.1%})")
    ax.set_xlabel("GRPO update")
    ax.set_ylabel(f"held-out games solved in {runs[0]['max_turns']} guesses (%)")
    ax.set_title(runs[0]["env"], fontsize=9)
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dirs = [Path(d) for d in args.report.split(",")] if args.report else run_seeds(args, out / "guess_number_runs")
    runs = [report_run(d) for d in dirs]
    lines = ["| seed | " + " | ".join(f"update {p['update']}" for p in runs[0]["points"]) + " | wall |",
             "|---|" + "---|" * (len(runs[0]["points"]) + 1)]
    for run in runs:
        cells = [f"{p['rate']:.0%} [{p['lo']:.0%}, {p['hi']:.0%}]" for p in run["points"]]
        wall = f"{run['wall_s'] / 60:.1f} min" if "wall_s" in run else "?"
        lines.append(f"| {run['seed']} | " + " | ".join(cells) + f" | {wall} |")
    final = [run["points"][-1] for run in runs]
    solved, games = sum(p["solved"] for p in final), sum(p["games"] for p in final)
    from ppoforge.core.stats import binomial_interval

    lo, hi = binomial_interval(solved, games)
    lines.append(f"\nafter the last update, {len(runs)} seeds: {solved}/{games} = {solved / games:.1%} "
                 f"[{lo:.1%}, {hi:.1%}] of held-out games solved")
    lines.append("yardsticks: " + ", ".join(f"{k} {v:.1%}" for k, v in runs[0]["yardsticks"].items()))
    print("\n".join(lines))
    plot(runs, out / "guess_number_seeds.png")
    (out / "guess_number_seeds.json").write_text(json.dumps({"runs": runs, "table": lines}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
