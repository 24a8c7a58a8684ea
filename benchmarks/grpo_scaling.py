"""GRPO rates against the machine's GEMM rate, and the cost-scaling sweep of rlhf_vs_trl.py --grpo.

Used by rlhf_vs_trl.py (which runs the workers); nothing here starts a worker itself.

- `measure_gemm`: flops.py in a fresh subprocess of this interpreter, the workers' thread count: the fp32
  and bf16 GFLOP/s of a 2048 x 2048 matmul, once per invocation, in the JSON beside the runs it rates.
- `grpo_table`: per run s/step, completions/s, mean completion length, peak RSS, the estimated useful and
  executed GFLOP/s (flops.py's `dense` and `executed` FLOPs per step / s per step) and the executed rate's
  fraction of the GEMM rate of the run's compute dtype (bf16 runs against the bf16 matmul, fp32 ones
  against fp32).
- `run_sweep`: s/step of TRL and ppoforge as G goes over --sweep-generations (at --grpo-new-tokens) and as
  the completion budget goes over --sweep-new-tokens (at --grpo-generations); one markdown table, one
  JSON and one PNG (log-log, both sweeps side by side) under --out. Beside each measured curve a dashed
  line is the cost that grows as the tokens each side has to run: (prompt + completion) x G for TRL
  (every completion its own prompt) and prompt + G x completion for ppoforge with shared_prefix (the
  prompt once per group), both scaled to meet their curve at its first point.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def measure_gemm(threads: int, seconds: float, env: dict) -> dict:
    cmd = [sys.executable, str(HERE / "flops.py"), "--threads", str(threads), "--seconds", str(seconds)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("BENCH_RESULT "):
            return json.loads(line[len("BENCH_RESULT "):])
    return {"error": (proc.stdout + proc.stderr).strip()[-500:]}


def _used(row: dict) -> list[dict]:
    """The rounds a row's median came from (rlhf_vs_trl.combine: the quiet ones, else all good ones)."""
    good = [r for r in row.get("rounds", []) if "error" not in r]
    return [r for r in good if r.get("other_load_cores", 0) <= 0.3] or good


def compute_dtype(row: dict) -> str:
    """bf16 for a bf16 run (TRL's autocast, ppoforge's bf16 or auto resolved to bf16), else fp32."""
    used = _used(row)
    resolved = used[0].get("resolved_precision") if used else None
    return "bf16" if (resolved or row["precision"]) == "bf16" else "fp32"


def rates(row: dict, gemm: dict) -> dict:
    """completions/s, mean completion length, GFLOP/s (dense and shared) and the fraction of the GEMM rate."""
    used = _used(row)
    if "error" in row or not used:
        return {}
    s = row["median_s"]
    med = lambda key: statistics.median(r[key] for r in used)
    dense, shared, executed = (statistics.median(r["flops_per_step"][k] for r in used)
                               for k in ("dense", "shared", "executed"))
    completions = used[0]["completions_per_s"] * used[0]["median_s"]
    dtype = compute_dtype(row)
    peak = gemm.get(f"{dtype}_gflops")
    return {"completions_per_s": completions / s, "mean_completion_len": med("mean_completion_len"),
            "gflops_dense": dense / s / 1e9, "gflops_shared": shared / s / 1e9, "gflops_executed": executed / s / 1e9,
            "compute_dtype": dtype, "gemm_fraction": executed / s / 1e9 / peak if peak else None}


def label(row: dict) -> str:
    if row["framework"] == "trl":
        trl = (row.get("versions") or {}).get("trl", "?")
        return f"TRL {trl} ({row['layout']}), {'bf16=True' if row['precision'] == 'bf16' else 'bf16=False'}"
    return f"ppoforge {row['layout']}, precision {row['precision']}"


def grpo_table(results: list[dict], gemm: dict) -> str:
    ref = next((r for r in results if r["framework"] == "trl" and "error" not in r), None)
    rows = [f"GEMM rate (2048² matmul, {gemm.get('threads')} threads): fp32 {gemm.get('fp32_gflops', 0):.0f}, "
            f"bf16 {gemm.get('bf16_gflops', 0):.0f} GFLOP/s\n",
            "| run | s/step | speed vs first TRL | completions/s | mean completion tokens | peak RSS GiB "
            "| useful GFLOP/s | executed GFLOP/s | of GEMM rate | other load |", "|---" * 10 + "|"]
    for r in results:
        if "error" in r:
            rows.append(f"| {label(r)} | failed: {r['error'].splitlines()[-1][:80]} | | | | | | | | |")
            continue
        m = rates(r, gemm)
        frac = f"{m['gemm_fraction']:.0%} ({m['compute_dtype']})" if m.get("gemm_fraction") else "n/a"
        speed = f"{ref['median_s'] / r['median_s']:.2f}×" if ref else "n/a"
        rows.append(f"| {label(r)} | {r['median_s']:.2f} | {speed} | {m['completions_per_s']:.2f} | "
                    f"{m['mean_completion_len']:.1f} | {r['peak_rss_gib']:.2f} | {m['gflops_dense']:.1f} | "
                    f"{m['gflops_executed']:.1f} | {frac} | "
                    f"{r['other_load_cores']:.2f}{' ⚠' if r['other_load_cores'] > 0.3 else ''} |")
    rows.append("\nFLOPs per step estimated by flops.py (2 x matmul parameters per token and forward; LoRA's "
                "backward as 1 forward, full fine-tuning's as 2; attention scores and padding left out). useful = "
                "every completion with its own prompt (the same for both sides); executed = the prompt copies "
                "this side runs (shared prefix: fewer); of GEMM rate = executed / the 2048² matmul rate of "
                "the run's compute dtype.")
    return "\n".join(rows)


# ---- the sweep ---------------------------------------------------------------------------------------

def sweep_points(generations: list[int], budgets: list[int], g0: int, t0: int) -> list[tuple[str, int, int]]:
    """(sweep, G, budget): the G sweep at budget t0, then the budget sweep at G = g0."""
    return [("G", g, t0) for g in generations] + [("budget", g0, t) for t in budgets]


def run_sweep(points, configs_for, measure, meta: dict, out: Path, name: str) -> Path:
    """`configs_for(G, budget)` -> [(row meta, cmd)], `measure(row meta, cmd)` -> a combined row; each distinct
    (G, budget) is measured once and shared by both sweeps. Writes grpo_sweep_<name>.{json,md,png}."""
    done: dict[tuple[int, int], list[dict]] = {}
    for _sweep, g, t in points:
        if (g, t) in done:
            continue
        done[(g, t)] = [measure({**m, "generations": g, "new_tokens": t}, cmd) for m, cmd in configs_for(g, t)]
    rows = [{"sweep": sweep, "generations": g, "new_tokens": t, "runs": done[(g, t)]} for sweep, g, t in points]
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"grpo_sweep_{name}"
    md = sweep_table(rows, meta)
    stem.with_suffix(".md").write_text(md + "\n")
    stem.with_suffix(".json").write_text(json.dumps({**meta, "points": rows}, indent=1))
    plot(rows, stem.with_suffix(".png"))
    print(md, flush=True)
    return stem


def _tokens(run: dict, g: int) -> tuple[float, float] | None:
    """(dense, shared) tokens per step of a run: G x (P + L) and P + G x L summed over its prompts."""
    used = _used(run)
    if "error" in run or not used:
        return None
    prompts = sum(used[0]["prompt_tokens"])
    n_prompts = len(used[0]["prompt_tokens"])
    completion = statistics.median(r["mean_completion_len"] for r in used) * g * n_prompts
    return g * prompts + completion, prompts + completion


def run_name(run: dict) -> str:
    if run["framework"] == "trl":
        return f"TRL {(run.get('versions') or {}).get('trl', '?')} {run['precision']}"
    return f"ppoforge {run['layout']} {run['precision']}"


def sweep_table(rows: list[dict], meta: dict) -> str:
    names = [run_name(r) for r in rows[0]["runs"]]
    head = "| sweep | G | budget | " + " | ".join(f"{n} s/step (mean len)" for n in names)
    head += " | tokens G·(P+L) | tokens P+G·L |"
    lines = [f"### GRPO cost scaling, {meta.get('workload')}: {meta.get('prompts')} prompt(s)/step, "
             f"median of {meta.get('updates')} step(s) after {meta.get('warmup')} warm-up, "
             f"EOS {'on' if meta.get('eos') else 'suppressed (completions run to the budget)'}\n",
             head, "|---" * (5 + len(names)) + "|"]
    for row in rows:
        cells = []
        for run in row["runs"]:
            if "error" in run:
                cells.append("failed")
                continue
            mean_len = statistics.median(r["mean_completion_len"] for r in _used(run))
            loaded = " ⚠" if run.get("other_load_cores", 0) > 0.3 else ""
            cells.append(f"{run['median_s']:.2f} ({mean_len:.0f}){loaded}")
        toks = next((t for t in (_tokens(r, row["generations"]) for r in row["runs"]) if t), None)
        dense, shared = (f"{toks[0]:.0f}", f"{toks[1]:.0f}") if toks else ("", "")
        lines.append(f"| {row['sweep']} | {row['generations']} | {row['new_tokens']} | " + " | ".join(cells)
                     + f" | {dense} | {shared} |")
    lines.append("\nP = prompt tokens, L = mean completion tokens (EOS included), per prompt; TRL runs "
                 "G·(P+L) tokens per pass, ppoforge with shared_prefix at best P+G·L. ⚠: other jobs used more "
                 "than 0.3 cores during that run (its time is stretched; hollow in the PNG).")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, sweep, key, xlabel in ((axes[0], "G", "generations", "completions per prompt G"),
                                   (axes[1], "budget", "new_tokens", "completion budget (max new tokens)")):
        pts = [r for r in rows if r["sweep"] == sweep]
        if not pts:
            ax.set_visible(False)
            continue
        for i, name in enumerate(run_name(r) for r in pts[0]["runs"]):
            xs, ys, ideal, loaded = [], [], [], []
            for p in pts:
                run = p["runs"][i]
                toks = _tokens(run, p["generations"])
                if toks is None:
                    continue
                xs.append(p[key])
                ys.append(run["median_s"])
                shared = run["framework"] == "ppoforge" and "shared_prefix off" not in run["layout"]
                ideal.append(toks[1] if shared else toks[0])
                loaded.append(run.get("other_load_cores", 0) > 0.3)
            if not xs:
                continue
            line, = ax.plot(xs, ys, "-", label=name)
            for x, y, hollow in zip(xs, ys, loaded, strict=True):
                ax.plot([x], [y], "o", color=line.get_color(), mfc="white" if hollow else line.get_color())
            ax.plot(xs, [ys[0] * v / ideal[0] for v in ideal], "--", color=line.get_color(), alpha=0.5, lw=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("s / step")
        ax.grid(True, which="both", alpha=0.3)
        ax.set_xticks([p[key] for p in pts], [str(p[key]) for p in pts])
    axes[0].legend(fontsize=8)
    fig.suptitle("GRPO step time; dashed: ∝ tokens run (TRL G·(P+L), ppoforge shared prefix P+G·L)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
