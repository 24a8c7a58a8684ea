"""ppoforge's `train sft` / `train reward` vs TRL 1.12's SFTTrainer / RewardTrainer, side by side in one
invocation.

For each workload (rlhf_workloads.py: random-init Qwen2 models and a word-level tokenizer, built once)
the benchmark writes random-word data (prompts of 16-32 words, completions of 16-96, so batches pad),
then times both frameworks on the same model, tokenizer, data and shape: `--batch` examples per
optimizer step in micro-batches of `--micro`, AdamW, fp32, CPU, `--threads` threads, no evaluation, no
gradient checkpointing. Each measurement is a fresh process (its peak RSS is its own), the order
alternates between rounds, and each run waits for a quiet machine (as rlhf_vs_trl.py; see there why).
tokens/s = examples/s x the mean tokens per example as ppoforge tokenized them (prompt + completion +
EOS for SFT; chosen + rejected for a pair): the same data on both sides.

    python benchmarks/supervised_vs_trl.py --workloads tiny,small --layouts full,lora --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import rlhf_vs_trl  # noqa: E402
import rlhf_workloads  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="tiny,small", help="comma list: tiny, small, smollm2 (random init)")
    p.add_argument("--tasks", default="sft,reward", help="comma list: sft, reward")
    p.add_argument("--layouts", default="full,lora", help="comma list: full, lora (both frameworks)")
    p.add_argument("--steps", type=int, default=6, help="timed optimizer steps per run (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first, per run")
    p.add_argument("--batch", type=int, default=16, help="examples (pairs) per optimizer step")
    p.add_argument("--micro", type=int, default=8, help="examples per forward/backward")
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--variants", default="trl:fp32,ppoforge:fp32",
                   help="comma list of framework:precision[:option]; trl: fp32 or bf16 (its bf16 flag, TRL's "
                        "default, autocast on the CPU), :pf for its SFT's padding_free; ppoforge: fp32, bf16 or "
                        "auto, :off for its reward model's shared_prefix off (two padded rows a pair)")
    p.add_argument("--rounds", type=int, default=1, help="runs per configuration, order alternating")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--trl-venv", default=str(HERE.parent / ".bench-venvs" / "trl"))
    p.add_argument("--timeout", type=int, default=3600)
    p.add_argument("--quiet-wait", type=float, default=60.0)
    p.add_argument("--out", default=str(HERE / "results"))
    return p.parse_args()


def ensure_peft(trl_py: Path) -> None:
    """LoRA on the TRL side needs peft in its venv (same floor as ppoforge's)."""
    if subprocess.run([str(trl_py), "-c", "import peft"], capture_output=True).returncode:
        subprocess.run([str(trl_py), "-m", "pip", "install", "-q", "peft>=0.17"], check=True)


def combine(meta: dict, runs: list[dict]) -> dict:
    meta = {**meta, "framework": meta["variant"].split(":")[0]}
    good = [r for r in runs if "error" not in r]
    if not good:
        return {**meta, "error": runs[-1]["error"], "rounds": runs}
    used = [r for r in good if r["other_load_cores"] <= rlhf_vs_trl.BUSY] or good
    median = statistics.median(r["median_s"] for r in used)
    return {**meta, "median_s": median, "median_cpu_s": statistics.median(r["median_cpu_s"] for r in used),
            "peak_rss_gib": max(r["peak_rss_gib"] for r in good), "rounds_used": len(used),
            "other_load_cores": max(r["other_load_cores"] for r in used),
            "tokens_per_example": good[0].get("tokens_per_example"), "versions": good[0].get("versions"),
            "rounds": runs}


def measure(name: str, args: argparse.Namespace, trl_py: Path) -> list[dict]:
    w = rlhf_workloads.WORKLOADS[name]
    with tempfile.TemporaryDirectory(prefix=f"bench-sup-{name}-") as wdir:
        subprocess.run([str(trl_py), str(HERE / "rlhf_workloads.py"), name, wdir], check=True, capture_output=True)
        rlhf_workloads.write_supervised_data(w, wdir, rows=args.batch * (args.warmup + args.steps))
        configs = []
        for task in args.tasks.split(","):
            for layout in args.layouts.split(","):
                common = ["--workload-dir", wdir, "--task", task, "--layout", layout, "--steps", str(args.steps),
                          "--warmup", str(args.warmup), "--batch", str(args.batch), "--micro", str(args.micro),
                          "--max-length", str(args.max_length), "--threads", str(args.threads)]
                for variant in args.variants.split(","):
                    framework, precision, *extra = variant.split(":")
                    if extra and task != ("sft" if framework == "trl" else "reward"):
                        continue  # padding_free is TRL's SFTConfig's, shared_prefix ppoforge's reward model's
                    worker = [str(trl_py), str(HERE / "trl_supervised_worker.py")] if framework == "trl" else \
                        [sys.executable, str(HERE / "ppoforge_supervised_worker.py")]
                    option = {"trl": ["--padding-free"], "ppoforge": ["--shared-prefix", "off"]}[framework]
                    flags = ["--precision", precision, *(option if extra else [])]
                    configs.append((task, layout, variant, [*worker, *common, *flags]))
        runs: list[list[dict]] = [[] for _ in configs]
        for rnd in range(args.rounds):
            order = list(enumerate(configs))
            for i, (task, layout, variant, cmd) in order if rnd % 2 == 0 else order[::-1]:
                print(f"[{name} r{rnd}] {task} {layout} {variant} ...", end=" ", flush=True)
                res = rlhf_vs_trl.run_worker(cmd, args)
                print(res.get("error", "").splitlines()[-1:] or f"{res['median_s']:.3f} s/step", flush=True)
                runs[i].append(res)
        rows = [combine({"workload": name, "task": t, "layout": lay, "variant": v}, rs)
                for (t, lay, v, _), rs in zip(configs, runs, strict=True)]
    tokens = {(r["task"]): r["tokens_per_example"] for r in rows if r.get("tokens_per_example")}
    for r in rows:
        if "error" not in r and r["task"] in tokens:
            r["tokens_per_s"] = tokens[r["task"]] * args.batch / r["median_s"]
    return rows


def table(rows: list[dict]) -> str:
    out = ["| task | layout | variant | s/step | tokens/s | speed vs TRL's first | vs TRL's fastest | CPU s/step "
           "| peak RSS GiB | memory vs TRL's fastest | other load |", "|---" * 11 + "|"]
    for r in rows:
        head = f"| {r['task']} | {r['layout']} | {r['variant']} |"
        if "error" in r:
            out.append(f"{head} failed: {r['error'].splitlines()[-1][:80]} | | | | | | | |")
            continue
        trl = [t for t in rows if t["framework"] == "trl" and t["task"] == r["task"] and t["layout"] == r["layout"]
               and "error" not in t]
        first, fastest = (trl[0], min(trl, key=lambda t: t["median_s"])) if trl else (None, None)
        speed = f"{first['median_s'] / r['median_s']:.2f}×" if first else "n/a"
        best = f"{fastest['median_s'] / r['median_s']:.2f}×" if fastest else "n/a"
        mem = f"{r['peak_rss_gib'] / fastest['peak_rss_gib']:.2f}×" if fastest else "n/a"
        flag = " ⚠" if r["other_load_cores"] > rlhf_vs_trl.BUSY else ""
        out.append(f"{head} {r['median_s']:.3f} | {r.get('tokens_per_s', float('nan')):.0f} | {speed} | {best} | "
                   f"{r['median_cpu_s']:.2f} | {r['peak_rss_gib']:.2f} | {mem} | {r['other_load_cores']:.2f}{flag} |")
    return "\n".join(out)


def main() -> None:
    args = parse_args()
    trl_py = rlhf_vs_trl.ensure_trl_venv(Path(args.trl_venv))
    ensure_peft(trl_py)
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    results = {}
    for name in args.workloads.split(","):
        results[name] = measure(name, args, trl_py)
        print(f"\n### {name}: median of {args.steps} steps after {args.warmup}, batch {args.batch} in micro-batches "
              f"of {args.micro}, {args.threads} threads, {args.rounds} round(s)\n\n{table(results[name])}\n",
              flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"supervised_vs_trl-{started.replace(':', '')}.json"
    path.write_text(json.dumps({"started": started, "args": vars(args), "results": results}, indent=1))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
