"""ppoforge's LM PPO vs TRL 1.12's PPOTrainer, side by side in one invocation (shared/BENCHMARKS.md).

For each workload: build the random-init models, tokenizer and prompts once (rlhf_workloads.py), then
time TRL (trl_ppo_worker.py, in its own venv) and ppoforge (ppoforge_rlhf_worker.py, in this
interpreter) in a fresh subprocess per measurement, so each peak RSS belongs to one run. Both sides
use the same thread count, the same warm-up and the same median-of-N timing of whole PPO updates
(rollout + scoring + GAE + update). Machines are shared and noisy: read the ratios, which are measured
back to back, not the absolute seconds. Load does not stretch both sides alike, though: on 2 cores a
foreign job preempts one of the 2 OpenMP threads and every parallel op then waits for it, so code made
of many small ops (TRL's HF generate loop) slows far more than ppoforge's (seen: TRL tiny 0.5 s quiet,
10+ s under ~1.3 cores of other load). So each run waits for a quiet machine (--quiet-wait), records
the other jobs' CPU use during it, prefers quiet rounds, and flags rows that had none.

TRL lives in .bench-venvs/trl (git-ignored), created here on first use: TORCH_SPEC (default
torch==2.13.0, the CPU wheel; a bare `torch` would pull a multi-GB CUDA build), then trl==1.12.* (the
last release with PPO) and transformers==5.17.* (the version BENCHMARKS.md names; TRL 1.12 accepts it).

    python benchmarks/rlhf_vs_trl.py --workloads tiny,smollm2 --updates 5
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TRL_REQS = ["trl==1.12.*", "transformers==5.17.*"]
BUSY = 0.3  # cores of other load above which a run is flagged as unreliable


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="tiny", help="comma list of workloads: tiny, small, smollm2, arith")
    p.add_argument("--updates", type=int, default=5, help="timed PPO updates per run (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed PPO updates first, per run")
    p.add_argument("--rounds", type=int, default=1,
                   help="runs per configuration, alternating the order; the median is reported")
    p.add_argument("--threads", type=int, default=2, help="torch threads, the same on both sides")
    p.add_argument("--layouts", default="full,lora", help="ppoforge layouts to time (comma list)")
    p.add_argument("--precisions", default="fp32,bf16", help="ppoforge precisions to time (comma list)")
    p.add_argument("--trl-precisions", default="fp32",
                   help="TRL precisions (fp32 = its effective default; bf16 = accelerate autocast)")
    p.add_argument("--skip-ppoforge", action="store_true", help="time TRL only")
    p.add_argument("--grpo", action="store_true",
                   help="GRPO instead of PPO: TRL's GRPOTrainer (trl_grpo_worker.py) vs ppoforge's advantage grpo, "
                        "--grpo-prompts x --grpo-generations completions of --grpo-new-tokens, micro --grpo-micro")
    p.add_argument("--grpo-prompts", type=int, default=4)
    p.add_argument("--grpo-generations", type=int, default=8)
    p.add_argument("--grpo-new-tokens", type=int, default=32)
    p.add_argument("--grpo-micro", type=int, default=8)
    p.add_argument("--shared-prefix", default="auto",
                   help="ppoforge shared_prefix settings to time (comma list: auto,off side by side)")
    p.add_argument("--trl-venv", default=str(ROOT / ".bench-venvs" / "trl"), help="venv holding TRL 1.12")
    p.add_argument("--timeout", type=int, default=3600, help="seconds allowed per measurement")
    p.add_argument("--quiet-wait", type=float, default=60.0,
                   help="before each run, wait up to this many seconds for other jobs to leave the CPUs")
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


def busy_seconds() -> tuple[float, float]:
    """(CPU-busy seconds summed over all cores since boot, from /proc/stat; a monotonic clock)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / tick, time.monotonic()


def wait_for_quiet(max_wait: float, threshold: float = BUSY) -> float:
    """Wait (up to max_wait s) until other processes use < threshold cores; returns the seconds waited."""
    start = time.monotonic()
    while True:
        b0, t0 = busy_seconds()
        time.sleep(2.0)
        b1, t1 = busy_seconds()
        if (b1 - b0) / (t1 - t0) < threshold or time.monotonic() - start >= max_wait:
            return time.monotonic() - start


def children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_worker(cmd: list[str], args: argparse.Namespace) -> dict:
    """Run one measurement in a fresh process; returns its BENCH_RESULT dict or {'error': ...}.

    Also measures the machine's other load during the run: all cores' busy time minus the worker's own
    CPU time, per wall second ("other_load_cores"). Other engineers' jobs on a 2-core machine preempt
    the worker's OpenMP threads, which stretches runs with many small parallel ops far more than their
    share of the CPU suggests, so a run with other load is flagged in the table.
    """
    waited = wait_for_quiet(args.quiet_wait)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
           "TRL_EXPERIMENTAL_SILENCE": "1", "TOKENIZERS_PARALLELISM": "false"}
    (b0, t0), c0 = busy_seconds(), children_cpu()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s"}
    (b1, t1), c1 = busy_seconds(), children_cpu()
    load = {"other_load_cores": max(0.0, (b1 - b0) - (c1 - c0)) / (t1 - t0), "quiet_wait_s": waited}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("BENCH_RESULT "):
            return {**json.loads(line[len("BENCH_RESULT "):]), **load}
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    return {"error": f"exit {proc.returncode}: " + "\n".join(tail), **load}


def combine(meta: dict, runs: list[dict]) -> dict:
    """One row from a configuration's rounds: the median of the per-round medians over the quiet rounds
    (other load <= BUSY) when there are any, else over all rounds; the highest peak RSS."""
    good = [r for r in runs if "error" not in r]
    if not good:
        return {**meta, "error": runs[-1]["error"], "rounds": runs}
    used = [r for r in good if r["other_load_cores"] <= BUSY] or good
    median = statistics.median(r["median_s"] for r in used)
    samples = good[0]["samples_per_s"] * good[0]["median_s"]  # prompts per update
    return {**meta, "median_s": median, "samples_per_s": samples / median,
            "median_cpu_s": statistics.median(r["median_cpu_s"] for r in used),
            "other_load_cores": max(r["other_load_cores"] for r in used), "rounds_used": len(used),
            "peak_rss_gib": max(r["peak_rss_gib"] for r in good), "versions": good[0].get("versions"),
            "failed_rounds": len(runs) - len(good), "rounds": runs}


def measure_workload(name: str, args: argparse.Namespace, trl_py: Path) -> list[dict]:
    """Every configuration once per round, in a fresh process each; odd rounds run in reverse order."""
    with tempfile.TemporaryDirectory(prefix=f"bench-rlhf-{name}-") as wdir:
        subprocess.run([str(trl_py), str(HERE / "rlhf_workloads.py"), name, wdir], check=True,
                       capture_output=True)
        common = ["--workload-dir", wdir, "--updates", str(args.updates), "--warmup", str(args.warmup),
                  "--threads", str(args.threads)]
        if args.grpo:
            shape = ["--prompts", str(args.grpo_prompts), "--generations", str(args.grpo_generations),
                     "--new-tokens", str(args.grpo_new_tokens), "--micro", str(args.grpo_micro)]
            configs = [("trl", "trl-grpo", "fp32", [str(trl_py), str(HERE / "trl_grpo_worker.py"), "--workload-dir",
                                                    wdir, "--steps", str(args.updates), "--warmup", str(args.warmup),
                                                    "--threads", str(args.threads), *shape])]
            common += ["--grpo", *shape]
        else:
            configs = [("trl", "trl-4-model", p, [str(trl_py), str(HERE / "trl_ppo_worker.py"), *common,
                                                    "--precision", p]) for p in args.trl_precisions.split(",")]
        if not args.skip_ppoforge:
            configs += [("ppoforge", lay if sp == "auto" else f"{lay}, shared_prefix {sp}", p,
                         [sys.executable, str(HERE / "ppoforge_rlhf_worker.py"), *common, "--layout", lay,
                          "--precision", p, "--shared-prefix", sp])
                        for lay in args.layouts.split(",") for p in args.precisions.split(",")
                        for sp in args.shared_prefix.split(",")]
        runs: list[list[dict]] = [[] for _ in configs]
        for rnd in range(args.rounds):
            order = list(enumerate(configs))
            for i, (framework, layout, precision, cmd) in order if rnd % 2 == 0 else order[::-1]:
                print(f"[{name} r{rnd}] {framework} {layout} {precision} ...", end=" ", flush=True)
                res = run_worker(cmd, args)
                print(res.get("error", "").splitlines()[-1:] or f"{res['median_s']:.3f} s/update", flush=True)
                runs[i].append(res)
        return [combine({"framework": f, "layout": lay, "precision": p, "workload": name}, rs)
                for (f, lay, p, _), rs in zip(configs, runs, strict=True)]


def table(results: list[dict]) -> str:
    """Markdown table; ratios against the first good TRL run: speed = TRL s / run s, memory = run / TRL."""
    ref = next((r for r in results if r["framework"] == "trl" and "error" not in r), None)
    ratio = lambda num, den: f"{num / den:.2f}×" if ref else "n/a"
    rows = ["| run | layout | precision | s/update | samples/s | speed vs TRL | CPU s/update "
            "| CPU speed vs TRL | peak RSS GiB | memory vs TRL | other load |", "|---" * 11 + "|"]
    for r in results:
        head = f"| {r['framework']} | {r['layout']} | {r['precision']} |"
        if "error" in r:
            rows.append(f"{head} failed: {r['error'].splitlines()[-1][:80]} | | | | | | | |")
            continue
        rows.append(f"{head} {r['median_s']:.3f} | {r['samples_per_s']:.2f} | "
                    f"{ratio(ref['median_s'], r['median_s'])} | {r['median_cpu_s']:.2f} | "
                    f"{ratio(ref['median_cpu_s'], r['median_cpu_s'])} | {r['peak_rss_gib']:.2f} | "
                    f"{ratio(r['peak_rss_gib'], ref['peak_rss_gib'])} | {r['other_load_cores']:.2f}"
                    f"{' ⚠' if r['other_load_cores'] > BUSY else ''} |")
    if any(r.get("other_load_cores", 0) > BUSY for r in results):
        rows.append(f"\n⚠ other jobs used more than {BUSY} cores during every round of this row: its time "
                    "is stretched (code made of many small multi-threaded ops the most); do not trust it.")
    return "\n".join(rows)


def main() -> None:
    args = parse_args()
    trl_py = ensure_trl_venv(Path(args.trl_venv))
    if args.grpo and subprocess.run([str(trl_py), "-c", "import requests"], capture_output=True).returncode:
        subprocess.run([str(trl_py), "-m", "pip", "install", "-q", "requests"], check=True)  # GRPOTrainer imports it
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    all_results = {}
    for name in args.workloads.split(","):
        all_results[name] = measure_workload(name, args, trl_py)
        print(f"\n### {name}: median of {args.updates} updates after {args.warmup} warm-up, "
              f"{args.threads} threads, {args.rounds} round(s)\n\n{table(all_results[name])}\n", flush=True)
    versions = next((r["versions"] for rs in all_results.values() for r in rs
                     if r["framework"] == "trl" and "versions" in r), {})
    print("TRL side:", ", ".join(f"{k} {v}" for k, v in versions.items()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dump = out / f"{'grpo' if args.grpo else 'rlhf'}_vs_trl_{'_'.join(args.workloads.split(','))}.json"
    dump.write_text(json.dumps({"started": started, "argv": sys.argv[1:], "results": all_results}, indent=1))
    print(f"wrote {dump.relative_to(ROOT) if dump.is_relative_to(ROOT) else dump}")


if __name__ == "__main__":
    main()
