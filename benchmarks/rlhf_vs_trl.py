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

GRPO against two TRLs and the `reasoning` workload (the real SmolLM2-135M-Instruct on reasoning-gym problems,
reasoning_workload.py): `--trl-venvs trl,trl-current` times TRL 1.12 (.bench-venvs/trl) and the newest TRL
(.bench-venvs/trl-current: torch==2.13.0 CPU, then trl==1.16.*, which brings its own transformers), both made
on first use; `--trl-precisions fp32,bf16` each with bf16=False and bf16=True (GRPOConfig's default: CPU
autocast). A GRPO invocation also measures the GEMM rate (flops.py) and prints a second table: completions/s,
mean completion length, estimated GFLOP/s and its fraction of that rate (grpo_scaling.py). The cost sweep
(`--sweep-generations 2,4,8,16 --sweep-new-tokens 32,128,512`) replaces the comparison with s/step as G and as
the completion budget grow (grpo_scaling.py: a table, a JSON and a PNG in --out):

    python benchmarks/rlhf_vs_trl.py --grpo --workloads reasoning --trl-venvs trl,trl-current \
        --trl-precisions fp32,bf16 --layouts lora --precisions fp32,auto --grpo-prompts 2 --updates 3
    python benchmarks/rlhf_vs_trl.py --grpo --workloads reasoning --trl-venvs trl-current --trl-precisions bf16 \
        --layouts lora --precisions auto --shared-prefix auto,off --grpo-prompts 1 --updates 2 \
        --sweep-generations 2,4,8,16 --sweep-new-tokens 32,128,512

On a GPU: `--device cuda` runs every worker there (TRL's then needs a TRL venv whose torch has CUDA);
`--skip-trl` times ppoforge alone and needs no TRL venv (benchmarks/gpu_check.sh uses both).
"""

from __future__ import annotations

import argparse
import importlib.metadata
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
sys.path.insert(0, str(HERE))
import grpo_scaling  # noqa: E402
import rlhf_workloads  # noqa: E402

TRL_REQS = ["trl==1.12.*", "transformers==5.17.*"]
# --trl-venvs names: folder under .bench-venvs -> (pip requirements after torch, the TRL version it must have);
# trl-current = the newest TRL that installs beside torch 2.13 (1.16.0), with the transformers it picks
TRL_VENVS = {"trl": (TRL_REQS, "1.12."), "trl-current": (["trl==1.16.*"], "1.16.")}
BUSY = 0.3  # cores of other load above which a run is flagged as unreliable


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="tiny",
                   help="comma list of workloads: tiny, small, smollm2, arith, qwen05b (a GPU one)")
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
    p.add_argument("--skip-trl", action="store_true",
                   help="time ppoforge only (no TRL venv needed: the workload is built with this interpreter)")
    p.add_argument("--device", default="cpu", help="every worker's device: cpu (the default), cuda or cuda:N")
    p.add_argument("--grpo", action="store_true",
                   help="GRPO instead of PPO: TRL's GRPOTrainer (trl_grpo_worker.py) vs ppoforge's advantage grpo, "
                        "--grpo-prompts x --grpo-generations completions of --grpo-new-tokens, micro --grpo-micro")
    p.add_argument("--grpo-prompts", type=int, default=4)
    p.add_argument("--grpo-generations", type=int, default=8)
    p.add_argument("--grpo-new-tokens", type=int, default=32)
    p.add_argument("--grpo-micro", type=int, default=8)
    p.add_argument("--shared-prefix", default="auto",
                   help="ppoforge shared_prefix settings to time (comma list: auto,off side by side)")
    p.add_argument("--engines", default="auto",
                   help="ppoforge rollout engines to time (comma list of auto, lean, hf, vllm)")
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"),
                   help="the python that runs ppoforge's vllm workers (make venv-vllm)")
    p.add_argument("--attn", default="auto",
                   help="ppoforge attn_implementation settings to time (comma list: auto,eager,sdpa side by side)")
    p.add_argument("--trl-venv", default=str(ROOT / ".bench-venvs" / "trl"), help="venv holding TRL 1.12")
    p.add_argument("--trl-venvs", default="trl",
                   help="TRL venvs to time, comma list: trl (TRL 1.12, at --trl-venv), trl-current (the newest TRL, "
                        ".bench-venvs/trl-current), or paths of venvs that have TRL (used as they are)")
    p.add_argument("--no-eos", action="store_true",
                   help="reasoning: EOS does not stop completions (each runs to --grpo-new-tokens)")
    p.add_argument("--gemm-seconds", type=float, default=2.0, help="--grpo: seconds per dtype of the GEMM rate")
    p.add_argument("--sweep-generations", default="", help="--grpo: the cost sweep's G values (comma list)")
    p.add_argument("--sweep-new-tokens", default="", help="--grpo: the cost sweep's completion budgets (comma list)")
    p.add_argument("--sweep-eos", action="store_true",
                   help="sweep with EOS on (default: suppressed, so every completion runs to the budget)")
    p.add_argument("--timeout", type=int, default=3600, help="seconds allowed per measurement")
    p.add_argument("--quiet-wait", type=float, default=60.0,
                   help="before each run, wait up to this many seconds for other jobs to leave the CPUs")
    p.add_argument("--out", default=str(HERE / "results"), help="folder for the JSON dump")
    return p.parse_args()


def ensure_trl_venv(venv: Path, reqs: list[str] = TRL_REQS, version: str = "1.12.") -> Path:
    """Create the TRL venv if it lacks TRL `version`; returns its python."""
    py = venv / "bin" / "python"
    check = [str(py), "-c", f"import trl, sys; sys.exit(not trl.__version__.startswith({version!r}))"]
    if py.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return py
    print(f"[setup] creating {venv} (TRL {version}*, one-time, a few minutes)", flush=True)
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(py), "-m", "pip", "install", "-q"]
    subprocess.run(pip + [os.environ.get("TORCH_SPEC", "torch==2.13.0")], check=True)
    subprocess.run(pip + reqs, check=True)
    subprocess.run(check, check=True)
    return py


def trl_venvs(args: argparse.Namespace) -> list[tuple[str, Path]]:
    """(name, python) of each --trl-venvs entry, made or completed as needed: GRPOTrainer imports requests;
    a task workload's reward needs reasoning-gym (the version of this interpreter's)."""
    out = []
    for name in args.trl_venvs.split(","):
        if name in TRL_VENVS:
            venv = Path(args.trl_venv) if name == "trl" else ROOT / ".bench-venvs" / name
            py = ensure_trl_venv(venv, *TRL_VENVS[name])
        else:
            py = Path(name) / "bin" / "python"
        extra = ["requests"] if args.grpo else []
        if any(rlhf_workloads.WORKLOADS[w].task for w in args.workloads.split(",")):
            extra.append(f"reasoning-gym=={importlib.metadata.version('reasoning_gym')}")
        for req in extra:
            module = req.partition("=")[0].replace("-", "_")
            if subprocess.run([str(py), "-c", f"import {module}"], capture_output=True).returncode:
                subprocess.run([str(py), "-m", "pip", "install", "-q", req], check=True)
        out.append((Path(name).name, py))
    return out


def label(layout: str, shared_prefix: str, attn: str, engine: str = "auto") -> str:
    """A ppoforge run's name in the tables: its layout and the settings that are not the defaults."""
    return ", ".join([layout] + [f"{k} {v}" for k, v in (("shared_prefix", shared_prefix), ("attn", attn),
                                                         ("engine", engine)) if v != "auto"])


def grpo_configs(wdir: str, args: argparse.Namespace, trls: list[tuple[str, Path]], generations: int,
                 new_tokens: int) -> list[tuple[str, str, str, list[str]]]:
    """(framework, layout, precision, command) of every GRPO run at G = generations: each TRL venv at each
    --trl-precisions, then ppoforge's layouts x precisions x shared_prefix settings."""
    completions = args.grpo_prompts * generations
    micro = min(args.grpo_micro, completions)
    if completions % micro:
        raise SystemExit(f"--grpo-micro {micro} does not divide {completions} completions per step")
    shape = ["--prompts", str(args.grpo_prompts), "--generations", str(generations), "--new-tokens",
             str(new_tokens), "--micro", str(micro)]
    timing = ["--workload-dir", wdir, "--warmup", str(args.warmup), "--threads", str(args.threads),
              "--device", args.device]
    configs = [("trl", name, p, [str(py), str(HERE / "trl_grpo_worker.py"), *timing, "--steps", str(args.updates),
                                 "--precision", p, *shape, *(["--use-vllm"] if name.endswith("-vllm") else [])])
               for name, py in trls for p in args.trl_precisions.split(",")]  # a venv named *-vllm: use_vllm
    if not args.skip_ppoforge:
        configs += [("ppoforge", label(lay, sp, attn, eng), p,
                     [args.vllm_python if eng == "vllm" else sys.executable, str(HERE / "ppoforge_rlhf_worker.py"),
                      *timing, "--updates", str(args.updates), "--grpo", *shape, "--layout", lay, "--precision", p,
                      "--shared-prefix", sp, "--attn", attn, "--rollout-engine", eng])
                    for lay in args.layouts.split(",") for p in args.precisions.split(",")
                    for sp in args.shared_prefix.split(",") for attn in args.attn.split(",")
                    for eng in args.engines.split(",")]
    return configs


def build_workload(name: str, wdir: str, python: Path, eos: bool = True) -> None:
    """rlhf_workloads.py NAME WDIR with `python` (a task workload: this interpreter, which has ppoforge)."""
    python = sys.executable if rlhf_workloads.WORKLOADS[name].task else python
    cmd = [str(python), str(HERE / "rlhf_workloads.py"), name, wdir] + ([] if eos else ["--no-eos"])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"building workload {name} failed:\n{proc.stderr[-3000:]}")


def worker_env(args: argparse.Namespace) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
            "TRL_EXPERIMENTAL_SILENCE": "1", "TOKENIZERS_PARALLELISM": "false"}


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
    env = worker_env(args)
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
            "peak_cuda_gib": max((r.get("peak_cuda_gib") or 0.0 for r in good), default=0.0) or None,
            "failed_rounds": len(runs) - len(good), "rounds": runs}


def measure_workload(name: str, args: argparse.Namespace, trl_py: Path | None,
                     trls: list[tuple[str, Path]] = ()) -> list[dict]:
    """Every configuration once per round, in a fresh process each; odd rounds run in reverse order.
    `trl_py` None (--skip-trl): ppoforge's configurations alone. GRPO times every venv of `trls`."""
    with tempfile.TemporaryDirectory(prefix=f"bench-rlhf-{name}-") as wdir:
        build_workload(name, wdir, trl_py or sys.executable, eos=not args.no_eos)
        common = ["--workload-dir", wdir, "--updates", str(args.updates), "--warmup", str(args.warmup),
                  "--threads", str(args.threads), "--device", args.device]
        trl_precisions = args.trl_precisions.split(",") if trl_py else []
        if args.grpo:
            configs = grpo_configs(wdir, args, list(trls), args.grpo_generations, args.grpo_new_tokens)
        else:
            configs = [("trl", "trl-4-model", p, [str(trl_py), str(HERE / "trl_ppo_worker.py"), *common,
                                                    "--precision", p]) for p in trl_precisions]
        if not args.skip_ppoforge and not args.grpo:
            configs += [("ppoforge", label(lay, sp, attn), p,
                         [sys.executable, str(HERE / "ppoforge_rlhf_worker.py"), *common, "--layout", lay,
                          "--precision", p, "--shared-prefix", sp, "--attn", attn])
                        for lay in args.layouts.split(",") for p in args.precisions.split(",")
                        for sp in args.shared_prefix.split(",") for attn in args.attn.split(",")]
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
    ratio = lambda num, den: f"{num / den:.2f}×"
    rows = ["| run | layout | precision | s/update | samples/s | speed vs TRL | CPU s/update "
            "| CPU speed vs TRL | peak RSS GiB | memory vs TRL | other load |", "|---" * 11 + "|"]
    for r in results:
        head = f"| {r['framework']} | {r['layout']} | {r['precision']} |"
        if "error" in r:
            rows.append(f"{head} failed: {r['error'].splitlines()[-1][:80]} | | | | | | | |")
            continue
        speed, cpu_speed, memory = ("n/a",) * 3 if ref is None else (  # --skip-trl: no TRL row
            ratio(ref["median_s"], r["median_s"]), ratio(ref["median_cpu_s"], r["median_cpu_s"]),
            ratio(r["peak_rss_gib"], ref["peak_rss_gib"]))
        rows.append(f"{head} {r['median_s']:.3f} | {r['samples_per_s']:.2f} | {speed} | {r['median_cpu_s']:.2f} | "
                    f"{cpu_speed} | {r['peak_rss_gib']:.2f} | {memory} | {r['other_load_cores']:.2f}"
                    f"{' ⚠' if r['other_load_cores'] > BUSY else ''} |")
    if any(r.get("other_load_cores", 0) > BUSY for r in results):
        rows.append(f"\n⚠ other jobs used more than {BUSY} cores during every round of this row: its time "
                    "is stretched (code made of many small multi-threaded ops the most); do not trust it.")
    return "\n".join(rows)


def main() -> None:
    args = parse_args()
    trls = [] if args.skip_trl else trl_venvs(args)
    trl_py = trls[0][1] if trls else None
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    gemm = None
    if args.grpo:  # the machine's GEMM rate, measured in this invocation (flops.py)
        wait_for_quiet(args.quiet_wait)
        gemm = grpo_scaling.measure_gemm(args.threads, args.gemm_seconds, worker_env(args))
        print(f"GEMM rate: {gemm}", flush=True)
    if args.sweep_generations or args.sweep_new_tokens:
        return sweep(args, trls, gemm, started)
    all_results = {}
    for name in args.workloads.split(","):
        all_results[name] = measure_workload(name, args, trl_py, trls)
        print(f"\n### {name}: median of {args.updates} updates after {args.warmup} warm-up, "
              f"{args.threads} threads, {args.rounds} round(s)\n\n{table(all_results[name])}\n", flush=True)
        if args.grpo:
            print(grpo_scaling.grpo_table(all_results[name], gemm) + "\n", flush=True)
    sides = {json.dumps(r["versions"]) for rs in all_results.values() for r in rs
             if r["framework"] == "trl" and r.get("versions")}
    for versions in map(json.loads, sorted(sides)):
        print("TRL side:", ", ".join(f"{k} {v}" for k, v in versions.items()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    on = "" if args.device == "cpu" else "_" + args.device.replace(":", "")  # GPU runs keep the CPU files
    dump = out / f"{'grpo' if args.grpo else 'rlhf'}_vs_trl_{'_'.join(args.workloads.split(','))}{on}.json"
    dump.write_text(json.dumps({"started": started, "argv": sys.argv[1:], "gemm": gemm,
                                "results": {k: [{**r, **grpo_scaling.rates(r, gemm)} if gemm else r for r in rs]
                                            for k, rs in all_results.items()}}, indent=1))
    print(f"wrote {dump.relative_to(ROOT) if dump.is_relative_to(ROOT) else dump}")


def sweep(args: argparse.Namespace, trls: list[tuple[str, Path]], gemm: dict | None, started: str) -> None:
    """The cost sweep (grpo_scaling.py) on the first of --workloads: the first TRL venv at the first
    --trl-precisions, ppoforge's first layout and precision with every --shared-prefix setting."""
    if not args.grpo:
        raise SystemExit("--sweep-generations / --sweep-new-tokens need --grpo")
    name = args.workloads.split(",")[0]
    ints = lambda text: [int(x) for x in text.split(",") if x]
    points = grpo_scaling.sweep_points(ints(args.sweep_generations), ints(args.sweep_new_tokens),
                                       args.grpo_generations, args.grpo_new_tokens)
    picked = argparse.Namespace(**{**vars(args), "trl_precisions": args.trl_precisions.split(",")[0],
                                   "layouts": args.layouts.split(",")[0], "precisions": args.precisions.split(",")[0]})
    eos = args.sweep_eos or not rlhf_workloads.WORKLOADS[name].task
    with tempfile.TemporaryDirectory(prefix=f"bench-sweep-{name}-") as wdir:
        build_workload(name, wdir, trls[0][1] if trls else sys.executable, eos=eos)

        def configs_for(g: int, t: int):
            return [({"framework": f, "layout": lay, "precision": p, "workload": name}, cmd)
                    for f, lay, p, cmd in grpo_configs(wdir, picked, trls[:1], g, t)]

        def measure(meta: dict, cmd: list[str]) -> dict:
            print(f"[sweep G={meta['generations']} budget={meta['new_tokens']}] {meta['framework']} {meta['layout']} "
                  f"{meta['precision']} ...", end=" ", flush=True)
            runs = [run_worker(cmd, args) for _ in range(args.rounds)]
            print(runs[-1].get("error", "").splitlines()[-1:] or f"{runs[-1]['median_s']:.2f} s/step", flush=True)
            row = combine(meta, runs)
            return {**row, **grpo_scaling.rates(row, gemm or {})}

        meta = {"started": started, "argv": sys.argv[1:], "workload": name, "prompts": args.grpo_prompts,
                "updates": args.updates, "warmup": args.warmup, "threads": args.threads, "eos": eos, "gemm": gemm}
        stem = grpo_scaling.run_sweep(points, configs_for, measure, meta, Path(args.out), name)
    print(f"wrote {stem}.{{md,json,png}}")


if __name__ == "__main__":
    main()
