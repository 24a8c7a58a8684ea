"""ppoforge's LM PPO vs TRL 1.12's PPOTrainer, side by side in one invocation (shared/BENCHMARKS.md).

For each workload: build the random-init models, tokenizer and prompts once (rlhf_workloads.py), then
time TRL (trl_ppo_worker.py, in its own venv) and ppoforge (ppoforge_rlhf_worker.py, in this
interpreter) in a fresh subprocess per measurement, so each peak RSS belongs to one run. Both sides
use the same thread count, the same warm-up and the same median-of-N timing of whole PPO updates
(rollout + scoring + GAE + update). Machines are shared and noisy: read the ratios, which are measured
back to back under the same load, not the absolute seconds.

TRL lives in .bench-venvs/trl (git-ignored), created here on first use: TORCH_SPEC (default
torch==2.13.0, the CPU wheel; a bare `torch` would pull a multi-GB CUDA build), then trl==1.12.* (the
last release with PPO) and transformers==5.17.* (the version BENCHMARKS.md names; TRL 1.12 accepts it).

    python benchmarks/rlhf_vs_trl.py --workloads tiny,smollm2 --updates 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TRL_REQS = ["trl==1.12.*", "transformers==5.17.*"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="tiny", help="comma list of workloads: tiny, small, smollm2")
    p.add_argument("--updates", type=int, default=5, help="timed PPO updates per run (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed PPO updates first, per run")
    p.add_argument("--threads", type=int, default=2, help="torch threads, the same on both sides")
    p.add_argument("--layouts", default="full,lora", help="ppoforge layouts to time (comma list)")
    p.add_argument("--precisions", default="fp32,bf16", help="ppoforge precisions to time (comma list)")
    p.add_argument("--trl-precisions", default="fp32",
                   help="TRL precisions (fp32 = its effective default; bf16 = accelerate autocast)")
    p.add_argument("--skip-ppoforge", action="store_true", help="time TRL only")
    p.add_argument("--trl-venv", default=str(ROOT / ".bench-venvs" / "trl"), help="venv holding TRL 1.12")
    p.add_argument("--timeout", type=int, default=3600, help="seconds allowed per measurement")
    p.add_argument("--out", default=str(HERE / "results"), help="folder for the JSON dump")
    return p.parse_args()


def ensure_trl_venv(venv: Path) -> Path:
    """Create the TRL venv if it lacks TRL 1.12; returns its python."""
    py = venv / "bin" / "python"
    check = [str(py), "-c", "import trl, sys; sys.exit(not trl.__version__.startswith('1.12.'))"]
    if py.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return py
    print(f"[setup] creating {venv} (TRL 1.12, one-time, a few minutes)", flush=True)
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(py), "-m", "pip", "install", "-q"]
    subprocess.run(pip + [os.environ.get("TORCH_SPEC", "torch==2.13.0")], check=True)
    subprocess.run(pip + TRL_REQS, check=True)
    subprocess.run(check, check=True)
    return py


def run_worker(cmd: list[str], threads: int, timeout: int) -> dict:
    """Run one measurement in a fresh process; returns its BENCH_RESULT dict or {'error': ...}."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "TRL_EXPERIMENTAL_SILENCE": "1", "TOKENIZERS_PARALLELISM": "false"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("BENCH_RESULT "):
            return json.loads(line[len("BENCH_RESULT "):])
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    return {"error": f"exit {proc.returncode}: " + "\n".join(tail)}


def measure_workload(name: str, args: argparse.Namespace, trl_py: Path) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix=f"bench-rlhf-{name}-") as wdir:
        subprocess.run([str(trl_py), str(HERE / "rlhf_workloads.py"), name, wdir], check=True,
                       capture_output=True)
        common = ["--workload-dir", wdir, "--updates", str(args.updates), "--warmup", str(args.warmup),
                  "--threads", str(args.threads)]
        runs = [("trl", "trl-4-model", p, [str(trl_py), str(HERE / "trl_ppo_worker.py"), *common,
                                             "--precision", p]) for p in args.trl_precisions.split(",")]
        if not args.skip_ppoforge:
            runs += [("ppoforge", lay, p, [sys.executable, str(HERE / "ppoforge_rlhf_worker.py"), *common,
                                           "--layout", lay, "--precision", p])
                     for lay in args.layouts.split(",") for p in args.precisions.split(",")]
        results = []
        for framework, layout, precision, cmd in runs:
            print(f"[{name}] {framework} {layout} {precision} ...", end=" ", flush=True)
            res = {"framework": framework, "layout": layout, "precision": precision, "workload": name,
                   **run_worker(cmd, args.threads, args.timeout)}
            print(res.get("error", "").splitlines()[-1:] or f"{res['median_s']:.3f} s/update", flush=True)
            results.append(res)
        return results


def table(results: list[dict]) -> str:
    """Markdown table; ratios against the first good TRL run: speed = TRL s / run s, memory = run / TRL."""
    ref = next((r for r in results if r["framework"] == "trl" and "error" not in r), None)
    rows = ["| run | layout | precision | s/update | samples/s | speed vs TRL | peak RSS GiB "
            "| memory vs TRL |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        head = f"| {r['framework']} | {r['layout']} | {r['precision']} |"
        if "error" in r:
            rows.append(f"{head} failed: {r['error'].splitlines()[-1][:80]} | | | | |")
            continue
        speed = f"{ref['median_s'] / r['median_s']:.2f}×" if ref else "n/a"
        mem = f"{r['peak_rss_gib'] / ref['peak_rss_gib']:.2f}×" if ref else "n/a"
        rows.append(f"{head} {r['median_s']:.3f} | {r['samples_per_s']:.1f} | {speed} | "
                    f"{r['peak_rss_gib']:.2f} | {mem} |")
    return "\n".join(rows)


def main() -> None:
    args = parse_args()
    trl_py = ensure_trl_venv(Path(args.trl_venv))
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    all_results = {}
    for name in args.workloads.split(","):
        all_results[name] = measure_workload(name, args, trl_py)
        print(f"\n### {name}: median of {args.updates} updates after {args.warmup} warm-up, "
              f"{args.threads} threads\n\n{table(all_results[name])}\n", flush=True)
    versions = next((r["versions"] for rs in all_results.values() for r in rs
                     if r["framework"] == "trl" and "versions" in r), {})
    print("TRL side:", ", ".join(f"{k} {v}" for k, v in versions.items()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dump = out / f"rlhf_vs_trl_{'_'.join(args.workloads.split(','))}.json"
    dump.write_text(json.dumps({"started": started, "argv": sys.argv[1:], "results": all_results}, indent=1))
    print(f"wrote {dump.relative_to(ROOT) if dump.is_relative_to(ROOT) else dump}")


if __name__ == "__main__":
    main()
