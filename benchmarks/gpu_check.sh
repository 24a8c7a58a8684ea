#!/usr/bin/env bash
# The prepared GPU check (docs/benchmarks.md, "Prepared GPU check"): one run on a machine with one NVIDIA
# GPU, about 8 minutes on an H200, every step's figures in ONE JSON file. Never needed by tests or CI.
#
#   bash benchmarks/gpu_check.sh                        # on the GPU box (.venv from `make venv`)
#   GPU_CHECK_DEVICE=cpu bash benchmarks/gpu_check.sh   # dry run on CPU: every step with the smallest
#                                                       # settings, to check the script itself
#
# Steps, in this order (a step that fails does not stop the rest; each runs under `timeout`):
#   env                 nvidia-smi, `python -c 'import torch; print(torch.cuda.is_available(), torch.version.cuda)'`,
#                       versions, the git commit
#   doctor              ppoforge doctor --json (bf16 smoke runs on the GPU; its fp16 step, all-reduce, fsdp checks)
#   fp16_gradscaler     train rlhf --precision fp16 (GradScaler) on SmolLM2-135M, 3 updates; the scaler's scale
#   torchrun_rl         torchrun --nproc_per_node 1, each run twice in one worker: plain world 1, then
#   torchrun_supervised PPOFORGE_FORCE_COLLECTIVES=1 (the collective path: a one-process NCCL group); control PPO,
#                       LM PPO, GRPO, multi-turn GRPO (guess_number) with held-out prompts, SFT and reward models
#                       with held-out evaluation; collectives counted with their backend and tensor devices, and
#                       the metrics of the two runs compared
#   fsdp_world1         the full layout with fsdp: true under torchrun at world 1 (RLHF bf16, then a resume from
#                       the sharded checkpoint; SFT), against the plain full layout
#   demo_bf16           ppoforge demo --device cuda --precision bf16 (the held-out VADER score before -> after)
#   vllm                rollout_engine vllm colocated on the GPU (benchmarks/vllm_gpu_check.py): LoRA fp32 and full
#                       bf16, sleep mode on, 2 updates each: sync seconds, log-prob mismatch, peak memory, a greedy
#                       continuation against the training model's (GPU_CHECK_VLLM_PYTHON: a python with vLLM,
#                       default .venv-vllm/bin/python, else the main one; skipped when neither imports vllm)
#   grpo_vs_trl         benchmarks/rlhf_vs_trl.py --grpo on the Qwen2.5-0.5B-shaped workload (qwen05b), on the GPU
#   ppo_vs_trl          the same for PPO (TRL's 4 models against ppoforge full and lora)
# The TRL comparisons need .bench-venvs/trl with TRL 1.12 and a CUDA torch; without it (no internet to make
# it) ppoforge's side runs alone and TRL's is recorded as skipped, with the reason.
#
# Environment:
#   GPU_CHECK_DEVICE   cuda (default) or cpu (the dry run above: gloo for NCCL, bf16 for fp16, tiny workloads)
#   GPU_CHECK_STEPS    comma list of the steps to run (default: all), e.g. doctor,fsdp_world1 for a rerun
#   GPU_CHECK_BUDGET_S wall seconds from the start (default 480 on cuda); a step gets at most what is left, and is
#                      recorded as skipped when under 20 s are
#   GPU_CHECK_JSON     the JSON to write (default $OUT/gpu_check.json when $OUT is set, else
#                      benchmarks/results/gpu_check-<UTC time>.json); rewritten after every step
#   GPU_CHECK_PYTHON   the interpreter (default .venv/bin/python; `make venv` first when .venv is missing)
#   GPU_CHECK_TRL_VENV the TRL venv (default .bench-venvs/trl)
#   GPU_CHECK_WORK     scratch folder (default a new /tmp/gpu_check.*): run dirs, logs, the step JSONs
#   GPU_CHECK_DEMO_UPDATES  the demo's updates (default: the preset's 24 on cuda, 1 in the dry run)
set -u

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 1
DEVICE=${GPU_CHECK_DEVICE:-cuda}
case "$DEVICE" in
  cuda) DRY=0 ;;
  cpu) DRY=1 ;;
  *) echo "gpu_check: GPU_CHECK_DEVICE must be cuda or cpu, not '$DEVICE'" >&2; exit 2 ;;
esac
STEPS=${GPU_CHECK_STEPS:-all}
if [ "$DRY" = 1 ]; then BUDGET=${GPU_CHECK_BUDGET_S:-3600}; else BUDGET=${GPU_CHECK_BUDGET_S:-480}; fi
STAMP=$(date -u +%Y-%m-%dT%H%M%S)
if [ -n "${GPU_CHECK_JSON:-}" ]; then JSON=$GPU_CHECK_JSON
elif [ -n "${OUT:-}" ]; then JSON=$OUT/gpu_check.json
else JSON=$ROOT/benchmarks/results/gpu_check-$STAMP.json
fi
mkdir -p "$(dirname "$JSON")"
WORK=${GPU_CHECK_WORK:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
mkdir -p "$WORK/steps" "$WORK/logs" "$WORK/runs" "$WORK/bench"
TRL_VENV=${GPU_CHECK_TRL_VENV:-$ROOT/.bench-venvs/trl}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH=$ROOT/src${PYTHONPATH:+:$PYTHONPATH}
if [ "$DRY" = 1 ]; then export OMP_NUM_THREADS=1; THREADS=1; else export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}; THREADS=4; fi
STARTED=$(date -u +%Y-%m-%dT%H:%M:%SZ) START_EPOCH=$(date +%s)
echo "[gpu_check] device $DEVICE, budget ${BUDGET}s, work $WORK, json $JSON"

# ---- the interpreter: .venv (made here when missing), else GPU_CHECK_PYTHON --------------------------------
VENV_NOTE=""
PY=${GPU_CHECK_PYTHON:-}
if [ -z "$PY" ]; then
  if [ ! -x "$ROOT/.venv/bin/python" ]; then
    echo "[gpu_check] .venv is missing: make venv (needs the package index)"
    timeout 900 make venv >"$WORK/logs/make_venv.log" 2>&1
    VENV_NOTE="make venv exit $? ($(tail -n 3 "$WORK/logs/make_venv.log" | tr -c '[:alnum:] ._:/=()-' ' '))"
  fi
  PY=$ROOT/.venv/bin/python
fi
if ! "$PY" -c "import torch, ppoforge" >"$WORK/logs/python.log" 2>&1; then
  reason="no usable interpreter: $PY cannot import torch and ppoforge ($(tail -n 2 "$WORK/logs/python.log" | tr -c '[:alnum:] ._:/=()-' ' ')) $VENV_NOTE"
  printf '{"check": "benchmarks/gpu_check.sh", "device": "%s", "started": "%s", "error": "%s"}\n' \
    "$DEVICE" "$STARTED" "$reason" >"$JSON"
  echo "[gpu_check] $reason; wrote $JSON" >&2
  exit 1
fi

# ---- helpers in Python: recording a step, the figures of each kind, assembling the JSON ---------------------
LIB=$WORK/gpu_check_lib.py
cat >"$LIB" <<'PYEOF'
"""gpu_check.sh's helpers: `record` one step's JSON (with the figures of its kind), `assemble` all of them
into the one JSON, `data` (the SFT / reward files), `tiny` (the tiny LM)."""
import json
import math
import os
import sys
import time
from pathlib import Path


def tail(path, lines=25, chars=3000):
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])[-chars:]


def read_metrics(run_dir):
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


KEYS = ("objective/scores", "objective/kl", "loss/policy_avg", "loss/value_avg", "policy/approxkl_avg",
        "objective/response_length", "guard/skipped_steps", "guard/skipped_updates", "perf/update_s",
        "perf/samples_per_s", "perf/world_size", "env/turns", "env/template_mismatch", "loss", "train/loss",
        "eval/loss", "eval/scores", "eval/accuracy", "episode_return", "charts/episodic_return", "lr")


def pick(row):
    out = {k: row[k] for k in KEYS if k in row}
    out.update({k: v for k, v in row.items() if k.startswith("eval/") and len(out) < 40})
    return out


def run_summary(run_dir):
    rows, d = read_metrics(run_dir), Path(run_dir)
    train = [r for r in rows if not any(k.startswith("eval/") for k in r)] or rows
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    return {"run_dir": str(d), "metric_rows": len(rows), "steps": sorted({r.get("step") for r in rows
                                                                          if r.get("step") is not None}),
            "first": pick(train[0]) if train else None, "last": pick(train[-1]) if train else None,
            "eval_first": pick(evals[0]) if evals else None, "eval_last": pick(evals[-1]) if evals else None,
            "files": sorted(p.name for p in d.iterdir()) if d.is_dir() else [],
            "sharded_checkpoint": (d / "checkpoint" / ".metadata").is_file()}


def compare(a_dir, b_dir, tol=1e-6):
    """Max |difference| over the numeric metrics (timings left out: perf/, charts/SPS) of two runs, row by row;
    equal when every |a - b| <= tol * (1 + |a|) (float32 rounding of a value ~38 is 4e-6)."""
    a, b = read_metrics(a_dir), read_metrics(b_dir)
    worst, worst_rel, where, missing, equal = 0.0, 0.0, None, [], True
    n = min(len(a), len(b))  # a run resumed later in b's dir (fsdp_world1) has more rows: compare the shared ones
    if not n or [r.get("step") for r in a[:n]] != [r.get("step") for r in b[:n]]:
        return {"same_steps": False, "steps_a": [r.get("step") for r in a], "steps_b": [r.get("step") for r in b]}
    for ra, rb in zip(a[:n], b[:n], strict=True):
        for k, v in ra.items():
            if k.startswith(("perf/", "charts/SPS")) or not isinstance(v, (int, float)) or isinstance(v, bool):
                continue
            w = rb.get(k)
            if not isinstance(w, (int, float)):
                missing.append(k)
                continue
            if isinstance(v, float) and isinstance(w, float) and math.isnan(v) and math.isnan(w):
                continue
            diff = abs(float(v) - float(w))
            equal = equal and diff <= tol * (1 + abs(float(v)))
            if diff:
                worst_rel = max(worst_rel, diff / abs(float(v)) if v else math.inf)
            if not diff <= worst:
                worst, where = diff, f"step {ra.get('step')} {k}: {v} vs {w}"
    return {"same_steps": True, "rows": n, "max_abs_diff": worst, "max_rel_diff": worst_rel, "worst": where,
            "missing_keys": missing[:5], "tolerance": f"|a - b| <= {tol:g} (1 + |a|)", "equal": bool(equal and not missing)}


def figures_metrics(args):
    return {"runs": [run_summary(d) for d in args]}, []


def figures_fp16(args):
    run_dir = Path(args[0])
    out, problems = run_summary(run_dir), []
    ckpt = run_dir / "checkpoint.pt"
    if ckpt.is_file():
        import torch
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
        out["precision_state"] = {k: (float(v) if hasattr(v, "item") or isinstance(v, (int, float)) else str(v))
                                  for k, v in (state.get("precision") or {}).items()}
    last = out.get("last") or {}
    if last and not all(math.isfinite(v) for v in last.values() if isinstance(v, float)):
        problems.append("a non-finite metric in the last update")
    return out, problems


def figures_doctor(args):
    try:
        report = json.loads(Path(args[0]).read_text())
    except (OSError, ValueError) as e:
        return {"error": f"no doctor JSON: {e}"}, ["the doctor wrote no JSON"]
    keep = ("gpu_visibility", "gpu0", "bf16_step", "fp16_step", "dist_backends", "allreduce", "fsdp",
            "lm_smoke", "control_smoke", "python_torch", "torch_wheel")
    checks = report.get("checks", [])
    return {"exit_code": report.get("exit_code"), "seconds": report.get("seconds"), "device": report.get("device"),
            "precision": report.get("precision"), "required": report.get("required"),
            "statuses": {c["name"]: c["status"] for c in checks},
            "evidence": {c["name"]: c["evidence"][:400] for c in checks if c["name"] in keep},
            "not_ok": {c["name"]: f"{c['status']}: {c['evidence'][:200]} | fix: {c.get('fix', '')[:200]}"
                       for c in checks if c["status"] in ("warn", "fail")},
            "verdicts": {v["key"]: {"holds": v["holds"], "required": v["required"], "reason": v["reason"][:200]}
                         for v in report.get("verdicts", [])}}, []


def figures_collective(args):
    """The wrapper's result file: per run its collectives, backend and tensor devices; each forced run's
    metrics against the plain run just before it (same trainer)."""
    try:
        res = json.loads(Path(args[0]).read_text())
    except (OSError, ValueError) as e:
        return {"error": f"no wrapper result: {e}"}, ["the torchrun worker wrote no result"]
    problems, runs, plain = [], [], {}
    for r in res.get("runs", []):
        row = {k: r.get(k) for k in ("label", "forced", "rc", "seconds", "collectives", "backends", "tensor_devices",
                                     "world", "error")}
        row["metrics"] = run_summary(r["run_dir"]) if r.get("run_dir") else None
        if row["metrics"]:
            row["metrics"].pop("files", None)
        trainer = r["label"].rsplit(":", 1)[0]
        if r.get("rc") != 0:
            problems.append(f"{r['label']}: exit {r.get('rc')}")
        if not r.get("forced"):
            plain[trainer] = r
            if r.get("collectives"):
                problems.append(f"{r['label']}: the plain world-1 run took collectives {r['collectives']}")
        else:
            if r.get("rc") == 0 and not r.get("collectives"):
                problems.append(f"{r['label']}: forced, but no collective ran")
            if trainer in plain and r.get("compare", True):
                row["vs_plain"] = compare(plain[trainer]["run_dir"], r["run_dir"])
                if r.get("rc") == 0 and not row["vs_plain"].get("equal"):
                    problems.append(f"{r['label']}: metrics differ from the plain run ({row['vs_plain']})"[:300])
        runs.append(row)
    expected = res.get("expected_runs")
    if expected is not None and len(runs) < expected:
        problems.append(f"{len(runs)} of {expected} runs recorded (the worker stopped early)")
    return {"runs": runs}, problems


def figures_demo(args):
    run_dir, log = Path(args[0]), args[1]
    out = run_summary(run_dir)
    out.pop("files", None)
    lines = [x for x in tail(log, 200, 100000).splitlines() if "held-out" in x or x.startswith(("last ", "done"))]
    out["summary_lines"] = lines[-3:]
    evals = [r for r in read_metrics(run_dir) if "eval/scores" in r]
    if len(evals) >= 2:
        out["heldout_vader"] = {"before": evals[0]["eval/scores"], "after": evals[-1]["eval/scores"]}
    times = [r["perf/update_s"] for r in read_metrics(run_dir) if "perf/update_s" in r]
    if times:
        out["update_s"] = {"first": times[0], "median": sorted(times)[len(times) // 2], "n": len(times)}
    return out, ([] if len(evals) >= 2 else ["no held-out score before and after"])


def figures_bench(args):
    folder = Path(args[0])  # the benchmark's --out; TRL_SKIP in it: why TRL's side did not run
    trl_skip = (folder / "TRL_SKIP").read_text().strip() if (folder / "TRL_SKIP").is_file() else ""
    dumps = sorted(folder.glob("*.json"))
    if not dumps:
        return {"trl": {"skipped": trl_skip} if trl_skip else None}, ["the benchmark wrote no JSON"]
    dump = json.loads(dumps[-1].read_text())
    rows, problems = [], []
    for workload, results in dump["results"].items():
        ref = next((r for r in results if r["framework"] == "trl" and "error" not in r), None)
        for r in results:
            row = {k: r.get(k) for k in ("framework", "layout", "precision", "median_s", "samples_per_s",
                                         "peak_rss_gib", "peak_cuda_gib", "failed_rounds")}
            row["workload"] = workload
            rnd = (r.get("rounds") or [{}])[0]
            row.update({k: rnd.get(k) for k in ("device", "update_s", "setup_s") if k in rnd})
            if "error" in r:
                row["error"] = r["error"][-600:]
                problems.append(f"{workload} {r['framework']} {r['layout']} {r['precision']}: "
                                f"{r['error'].splitlines()[-1][:160]}")
            elif ref is not None:
                row["speed_vs_trl"] = ref["median_s"] / r["median_s"]
                if ref.get("peak_cuda_gib") and r.get("peak_cuda_gib"):
                    row["cuda_memory_vs_trl"] = r["peak_cuda_gib"] / ref["peak_cuda_gib"]
            rows.append(row)
    return {"file": dumps[-1].name, "argv": dump.get("argv"), "rows": rows,
            "trl": {"skipped": trl_skip} if trl_skip else {"ran": True}}, problems


def figures_env(args):
    out = {}
    for name in args:
        key, _, path = name.partition("=")
        out[key] = Path(path).read_text(errors="replace").strip()[-4000:] if Path(path).is_file() else None
    text = out.pop("torch_json", None) or "{}"
    out["torch"] = json.loads(text) if text.startswith("{") else text
    return out, []


def figures_json(args):
    """A step that writes its own figures: {"...": ..., "problems": [...]} in args[0]."""
    try:
        res = json.loads(Path(args[0]).read_text())
    except (OSError, ValueError) as e:
        return {"error": f"no result file: {e}"}, ["the step wrote no result"]
    return res, list(res.get("problems", []))


FIGURES = {"json": figures_json, "metrics": figures_metrics, "fp16": figures_fp16, "doctor": figures_doctor, "collective": figures_collective,
           "demo": figures_demo, "bench": figures_bench, "env": figures_env, "none": lambda a: ({}, [])}


def record(argv):
    """record STEP_JSON NAME RC WALL LIMIT LOG COMMAND NOTE KIND [ARGS...]"""
    out, name, rc, wall_ms, limit, log, command, note, kind, *args = argv
    rc, wall = int(rc), int(wall_ms) / 1000
    try:
        figures, problems = FIGURES[kind](args)
    except Exception as e:  # noqa: BLE001 - a parser that breaks is recorded, not fatal
        figures, problems = {"error": f"figures ({kind}) failed: {type(e).__name__}: {e}"}, []
    status = "ok" if rc == 0 and not problems else "timeout" if rc in (124, 137) else "failed"
    step = {"name": name, "status": status, "rc": rc, "wall_s": round(wall, 2), "limit_s": int(limit),
            "command": command, "note": note or None, "problems": problems, "figures": figures,
            "output_tail": tail(log) if status != "ok" or kind in ("none", "env") else tail(log, 6, 800)}
    Path(out).write_text(json.dumps(step, indent=1, default=str))
    print(f"[gpu_check] {name}: {status} (exit {rc}, {wall:.1f} s)" + (f"; {problems[0][:200]}" if problems
                                                                         else ""), flush=True)


def skip(argv):
    out, name, reason = argv
    Path(out).write_text(json.dumps({"name": name, "status": "skipped", "reason": reason}, indent=1))
    print(f"[gpu_check] {name}: skipped ({reason})", flush=True)


def assemble(argv):
    """assemble STEPS_DIR OUT_JSON META_JSON_FILE FINISHED(0/1)"""
    steps_dir, out, meta_file, finished = argv
    meta = json.loads(Path(meta_file).read_text())
    steps = [json.loads(p.read_text()) for p in sorted(Path(steps_dir).glob("*.json"))]
    by = {}
    for s in steps:
        by.setdefault(s["status"], []).append(s["name"])
    meta.update({"updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "finished": finished == "1",
                 "total_wall_s": round(time.time() - meta["started_epoch"], 1),
                 "summary": {**{k: by.get(k, []) for k in ("ok", "failed", "timeout", "skipped")},
                             "trl_side_skipped": {s["name"]: s["figures"]["trl"]["skipped"] for s in steps
                                                  if ((s.get("figures") or {}).get("trl") or {}).get("skipped")}},
                 "steps": steps})
    tmp = Path(out).with_suffix(".tmp")
    tmp.write_text(json.dumps(meta, indent=1, default=str))
    os.replace(tmp, out)


def data(argv):
    """data FOLDER: sft.jsonl (prompt, completion) and pairs.jsonl (prompt, chosen, rejected), 24 rows each."""
    folder = Path(argv[0])
    topics = ["the rain", "coffee", "the city", "a movie", "my friend", "the weather", "the sun", "the morning"]
    good, bad = ["great", "wonderful", "happy"], ["terrible", "boring", "sad"]
    with open(folder / "sft.jsonl", "w") as sft, open(folder / "pairs.jsonl", "w") as pairs:
        for t in topics:
            for g, b in zip(good, bad, strict=True):
                sft.write(json.dumps({"prompt": f"tell me about {t}", "completion": f"{t} is {g} and {t} is {g}"})
                          + "\n")
                pairs.write(json.dumps({"prompt": f"tell me about {t}", "chosen": f"it is {g}",
                                        "rejected": f"it is {b}"}) + "\n")


def tiny(argv):
    from ppoforge.lm.models.tiny import save_tiny_lm
    save_tiny_lm(Path(argv[0]), hidden=64, layers=2)


if __name__ == "__main__":
    {"record": record, "skip": skip, "assemble": assemble, "data": data, "tiny": tiny}[sys.argv[1]](sys.argv[2:])
PYEOF

# The torchrun worker: runs `ppoforge` command lines one after another in this process, each `LABEL FORCE ARGV...`
# group separated by `::`; FORCE 1 sets PPOFORGE_FORCE_COLLECTIVES=1 for that run (the one-process group: NCCL on
# CUDA, gloo on CPU). Every collective is counted (runtime/distributed.py's `_collective`, the one place they
# run), with the backend and the devices of its tensors. Writes RESULT after every run.
WRAP=$WORK/collective_run.py
cat >"$WRAP" <<'PYEOF'
import collections
import json
import os
import sys
import time
import traceback

out, groups, header = sys.argv[1], [], False
for a in sys.argv[2:]:
    if a == "::":
        header = True
    elif header:
        label, _, force = a.rpartition("=")
        groups.append({"label": label, "force": force == "1", "argv": []})
        header = False
    else:
        groups[-1]["argv"].append(a)

import torch  # noqa: E402

from ppoforge import cli  # noqa: E402
from ppoforge.runtime import distributed as d  # noqa: E402

state = {"ops": collections.Counter(), "devices": collections.Counter(), "backends": set()}
real = d._collective


def tensors(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if isinstance(t, torch.Tensor))


def counting(op, *args):
    state["ops"][op.__name__] += 1
    for t in tensors(args):
        state["devices"][str(t.device)] += 1
    if torch.distributed.is_initialized():
        state["backends"].add(str(torch.distributed.get_backend()))
    return real(op, *args)


d._collective = counting
results = {"expected_runs": len(groups), "runs": []}
for g in groups:
    state["ops"].clear(), state["devices"].clear(), state["backends"].clear()
    if g["force"]:
        os.environ[d.FORCE_ENV] = "1"
    else:
        os.environ.pop(d.FORCE_ENV, None)
    run_dir = next((g["argv"][i + 1] for i, a in enumerate(g["argv"]) if a in ("--run-dir", "--resume")), None)
    start, error = time.perf_counter(), None
    try:
        rc = cli.main(g["argv"])
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - recorded; the next run still runs
        rc, error = 1, traceback.format_exc()[-2000:]
    results["runs"].append({"label": g["label"], "forced": g["force"], "argv": g["argv"], "run_dir": run_dir, "rc": rc,
                            "seconds": round(time.perf_counter() - start, 2), "collectives": dict(state["ops"]),
                            "backends": sorted(state["backends"]), "tensor_devices": dict(state["devices"]),
                            "world": str(d.world()), "error": error,
                            "group_left": not torch.distributed.is_initialized()})
    with open(out + ".tmp", "w") as f:
        json.dump(results, f, indent=1)
    os.replace(out + ".tmp", out)
    print(f"[collective_run] {g['label']} forced={int(g['force'])}: exit {rc}, {results['runs'][-1]['seconds']} s, "
          f"collectives {dict(state['ops'])}, backends {sorted(state['backends'])}", flush=True)
os.environ.pop(d.FORCE_ENV, None)
sys.exit(0 if all(r["rc"] == 0 for r in results["runs"]) else 1)
PYEOF

T0=0  # the budget counts from the script's start (bash's SECONDS)
META=$WORK/meta.json
"$PY" - "$META" "$DEVICE" "$DRY" "$STARTED" "$START_EPOCH" "$BUDGET" "$WORK" "$STEPS" "$VENV_NOTE" <<'PYEOF'
import json, os, shlex, subprocess, sys
out, device, dry, started, epoch, budget, work, steps, venv_note = sys.argv[1:]
git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True).stdout.strip()
env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items()) if k.startswith("GPU_CHECK_"))
json.dump({"check": "benchmarks/gpu_check.sh", "command": f"{env + ' ' if env else ''}bash benchmarks/gpu_check.sh",
           "device": device, "dry_run_on_cpu": dry == "1", "started": started, "started_epoch": int(epoch),
           "budget_s": int(budget), "steps_selected": steps, "work_dir": work, "venv_note": venv_note or None,
           "git": {"commit": git("rev-parse", "HEAD"), "changed_files": len(git("status", "--porcelain").splitlines())}},
          open(out, "w"), indent=1)
PYEOF

N=0
want() { [ "$STEPS" = all ] || [[ ",$STEPS," == *",$1,"* ]]; }
assemble() { "$PY" "$LIB" assemble "$WORK/steps" "$JSON" "$META" "${1:-0}" || echo "[gpu_check] assemble failed" >&2; }
skip_step() {  # skip_step NAME REASON
  N=$((N + 1))
  "$PY" "$LIB" skip "$WORK/steps/$(printf %02d $N)-$1.json" "$1" "$2"
  assemble
}
# run_step NAME LIMIT_S NOTE KIND "FIGURE ARGS" -- COMMAND...: the command under `timeout` (stdout in
# logs/NAME.out, stderr in logs/NAME.err, both in logs/NAME.log), then the step's JSON and the assembled file
run_step() {
  local name=$1 limit=$2 note=$3 kind=$4 fargs=$5
  shift 6
  want "$name" || return 0
  local left=$((BUDGET - (SECONDS - T0)))
  if [ "$left" -lt 20 ]; then skip_step "$name" "time budget of ${BUDGET}s spent"; return 0; fi
  [ "$limit" -gt "$left" ] && limit=$left
  N=$((N + 1))
  local log=$WORK/logs/$name.log cmd
  cmd=$(printf '%q ' "$@")
  echo "[gpu_check] $name (limit ${limit}s): ${cmd:0:300}"
  local t0 rc
  t0=$(date +%s%N)
  timeout --kill-after=15 "$limit" "$@" >"$WORK/logs/$name.out" 2>"$WORK/logs/$name.err"
  rc=$?
  cat "$WORK/logs/$name.out" "$WORK/logs/$name.err" >"$log"
  # shellcheck disable=SC2086  # fargs is a list of words on purpose
  "$PY" "$LIB" record "$WORK/steps/$(printf %02d $N)-$name.json" "$name" "$rc" "$((($(date +%s%N) - t0) / 1000000))" \
    "$limit" "$log" "${cmd% }" "$note" "$kind" $fargs
  assemble
}

# ---- shared settings ------------------------------------------------------------------------------------------
TINY=$WORK/tiny_lm
"$PY" "$LIB" tiny "$TINY" >"$WORK/logs/tiny_lm.log" 2>&1 || echo "[gpu_check] the tiny LM was not built" >&2
"$PY" "$LIB" data "$WORK" || echo "[gpu_check] the SFT / reward data were not written" >&2
R=$WORK/runs
TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc_per_node 1)
QUIET=(--progress false --tensorboard false)
DEV=(--device "$DEVICE" --torch-threads "$THREADS")
LM=(--model "$TINY" "${DEV[@]}" "${QUIET[@]}" --precision fp32 --dist-timeout 120 --seed 0)
if [ "$DRY" = 1 ]; then
  DOCTOR_DEV=auto  # --device cpu skips gpu_visibility, which the rlhf verdict needs: it would read NO here
  PREC16=bf16 FP16_MODEL=$TINY FP16_NOTE="dry run: bf16 in place of fp16 (fp16 + GradScaler needs CUDA), tiny LM"
  FSDP_PREC=bf16 DEMO_UPDATES=${GPU_CHECK_DEMO_UPDATES:-1}
  DEMO_EXTRA=(--precision auto --batch-size 4 --mini-batch-size 4 --micro-batch-size 4 --ppo-epochs 1
              --heldout-samples 1 --max-new-tokens 8)
  BENCH_WORKLOAD=tiny BENCH_PREC=fp32 BENCH_TRL_PPO=fp32 BENCH_TRL_GRPO=fp32 BENCH_UPDATES=1
  NOTE_COLL="dry run: gloo in place of NCCL"
else
  DOCTOR_DEV=cuda
  PREC16=fp16 FP16_MODEL=smollm2-135m-instruct FP16_NOTE=""
  FSDP_PREC=bf16 DEMO_UPDATES=${GPU_CHECK_DEMO_UPDATES:-}
  DEMO_EXTRA=(--precision bf16)
  BENCH_WORKLOAD=qwen05b BENCH_PREC=bf16 BENCH_TRL_PPO=fp32 BENCH_TRL_GRPO=bf16 BENCH_UPDATES=2
  NOTE_COLL=""
fi
[ -n "$DEMO_UPDATES" ] && DEMO_EXTRA+=(--total-updates "$DEMO_UPDATES")

# ---- env ------------------------------------------------------------------------------------------------------
if want env; then
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap,pci.bus_id --format=csv,noheader \
      >"$WORK/logs/nvsmi_query.txt" 2>&1
    nvidia-smi >"$WORK/logs/nvsmi.txt" 2>&1
  else
    echo "nvidia-smi: not on PATH" | tee "$WORK/logs/nvsmi_query.txt" >"$WORK/logs/nvsmi.txt"
  fi
  "$PY" -c 'import torch; print(torch.cuda.is_available(), torch.version.cuda)' >"$WORK/logs/torch_cuda.txt" 2>&1
fi
ENV_PY='import json, torch, transformers, ppoforge, platform, os
c = torch.cuda.is_available()
d = {"torch": torch.__version__, "cuda_available": c, "torch_cuda": torch.version.cuda,
     "cudnn": torch.backends.cudnn.version() if c else None, "devices": torch.cuda.device_count(),
     "transformers": transformers.__version__, "ppoforge": ppoforge.__version__, "python": platform.python_version(),
     "cpus": os.cpu_count(), "host": platform.node()}
try:
    if c:
        p, v = torch.cuda.get_device_properties(0), torch.cuda.nccl.version()
        d.update(name=p.name, capability=list(torch.cuda.get_device_capability(0)),
                 memory_gib=round(p.total_memory / 2**30, 1), bf16_supported=torch.cuda.is_bf16_supported(),
                 nccl=".".join(map(str, v)) if isinstance(v, tuple) else str(v), arch_list=torch.cuda.get_arch_list())
        x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16); x @ x; torch.cuda.synchronize()
        import time; t = time.perf_counter()
        for _ in range(20): y = x @ x
        torch.cuda.synchronize(); d["bf16_matmul_tflops"] = round(20 * 2 * 4096**3 / (time.perf_counter() - t) / 1e12, 1)
except Exception as e:
    d["cuda_error"] = f"{type(e).__name__}: {e}"
print(json.dumps(d))'
run_step env 60 "" env "nvidia_smi_query=$WORK/logs/nvsmi_query.txt nvidia_smi=$WORK/logs/nvsmi.txt torch_cuda_line=$WORK/logs/torch_cuda.txt torch_json=$WORK/logs/env.out" -- \
  "$PY" -c "$ENV_PY"

# ---- doctor ---------------------------------------------------------------------------------------------------
run_step doctor 120 "$([ "$DRY" = 1 ] && echo "dry run: --device auto (cpu here)")" doctor "$WORK/logs/doctor.out" -- \
  "$PY" -m ppoforge doctor --json --device "$DOCTOR_DEV" --precision bf16 \
  --require control,rlhf,checkpoints,precision,fsdp --runs-root "$R"

# ---- fp16 + GradScaler ----------------------------------------------------------------------------------------
run_step fp16_gradscaler 90 "$FP16_NOTE" fp16 "$R/fp16" -- \
  "$PY" -m ppoforge train rlhf --preset demo --model "$FP16_MODEL" --precision "$PREC16" "${DEV[@]}" "${QUIET[@]}" \
  --total-updates 3 --heldout-prompts none --checkpoint-every 3 --run-dir "$R/fp16" --overwrite

# ---- torchrun at world 1 through the collective path, every trainer --------------------------------------------
# each trainer twice in one worker: plain (no process group), then forced (PPOFORGE_FORCE_COLLECTIVES=1)
pair() {  # pair LABEL ARGV...: the `::`-separated plain and forced runs of one trainer, in $R/LABEL-{plain,forced}
  local label=$1
  shift
  PAIR+=(:: "$label:plain=0" "$@" --run-dir "$R/$label-plain" --overwrite
         :: "$label:forced=1" "$@" --run-dir "$R/$label-forced" --overwrite)
}
PAIR=()
pair control train control --preset cartpole --total-steps 1024 --num-envs 4 --num-steps 128 --hand-gradients false \
  "${DEV[@]}" "${QUIET[@]}" --precision fp32 --dist-timeout 120 --seed 0
pair ppo train rlhf --preset tiny "${LM[@]}" --heldout-prompts none --reward length:4 --max-prompt-tokens 16 \
  --max-new-tokens 6 --batch-size 4 --mini-batch-size 2 --micro-batch-size 1 --ppo-epochs 2 --total-updates 2
pair grpo train rlhf --preset grpo "${LM[@]}" --heldout-prompts none --reward length:4 --max-prompt-tokens 16 \
  --max-new-tokens 6 --batch-size 2 --num-generations 4 --mini-batch-size 8 --micro-batch-size 4 --total-updates 2
pair grpo_multiturn train rlhf --preset guess_number "${LM[@]}" --env 'guess_number?hi=4' --max-turns 2 \
  --max-env-tokens 24 --batch-size 2 --num-generations 2 --mini-batch-size 4 --micro-batch-size 2 \
  --heldout-prompts demo-heldout --heldout-samples 1 --total-updates 2
RL_RUNS=("${PAIR[@]}")
PAIR=()
SUP=("${DEV[@]}" "${QUIET[@]}" --model "$TINY" --precision fp32 --dist-timeout 120 --max-length 64 --batch-size 4
     --micro-batch-size 2 --epochs 1 --eval-fraction 0.25 --eval-every 3 --seed 0)
pair sft train sft --preset tiny --data "$WORK/sft.jsonl" "${SUP[@]}" --sample-prompts 1 --sample-tokens 8
pair reward train reward --preset tiny --data "$WORK/pairs.jsonl" "${SUP[@]}" --layout lora
SUP_RUNS=("${PAIR[@]}")
run_step torchrun_rl 120 "$NOTE_COLL" collective "$WORK/torchrun_rl.json" -- \
  "${TORCHRUN[@]}" "$WRAP" "$WORK/torchrun_rl.json" "${RL_RUNS[@]}"
run_step torchrun_supervised 90 "$NOTE_COLL" collective "$WORK/torchrun_supervised.json" -- \
  "${TORCHRUN[@]}" "$WRAP" "$WORK/torchrun_supervised.json" "${SUP_RUNS[@]}"

# ---- FSDP at world 1 under torchrun ----------------------------------------------------------------------------
FS=("${DEV[@]}" "${QUIET[@]}" --model "$TINY" --dist-timeout 120 --seed 0 --layout full)
FSDP_RUNS=(
  :: "rlhf_full:plain=0" train rlhf --preset tiny "${FS[@]}" --precision "$FSDP_PREC" --heldout-prompts none
     --reward length:4 --max-new-tokens 6 --batch-size 4 --mini-batch-size 4 --micro-batch-size 2
     --total-updates 2 --checkpoint-every 1 --learning-rate 1e-5 --run-dir "$R/fsdp-rlhf-plain" --overwrite
  :: "rlhf_full:fsdp=1" train rlhf --preset tiny "${FS[@]}" --precision "$FSDP_PREC" --heldout-prompts none
     --reward length:4 --max-new-tokens 6 --batch-size 4 --mini-batch-size 4 --micro-batch-size 2
     --total-updates 2 --checkpoint-every 1 --learning-rate 1e-5 --fsdp true --run-dir "$R/fsdp-rlhf" --overwrite
  :: "rlhf_full_resume:fsdp=1" train rlhf --resume "$R/fsdp-rlhf" --total-updates 3
  :: "sft_full:plain=0" train sft --preset tiny "${FS[@]}" --precision "$FSDP_PREC" --data "$WORK/sft.jsonl"
     --max-length 64 --batch-size 4 --micro-batch-size 2 --eval-fraction 0.25 --eval-every 3 --sample-prompts 1
     --sample-tokens 8 --learning-rate 1e-4 --run-dir "$R/fsdp-sft-plain" --overwrite
  :: "sft_full:fsdp=1" train sft --preset tiny "${FS[@]}" --precision "$FSDP_PREC" --data "$WORK/sft.jsonl"
     --max-length 64 --batch-size 4 --micro-batch-size 2 --eval-fraction 0.25 --eval-every 3 --sample-prompts 1
     --sample-tokens 8 --learning-rate 1e-4 --fsdp true --run-dir "$R/fsdp-sft" --overwrite
)
run_step fsdp_world1 120 "$NOTE_COLL" collective "$WORK/fsdp_world1.json" -- \
  "${TORCHRUN[@]}" "$WRAP" "$WORK/fsdp_world1.json" "${FSDP_RUNS[@]}"

# ---- the demo in bf16 -----------------------------------------------------------------------------------------
run_step demo_bf16 "$([ "$DRY" = 1 ] && echo 300 || echo 180)" \
  "$([ "$DRY" = 1 ] && echo "dry run: CPU, precision auto, 1 update of 4 prompts")" demo "$R/demo $WORK/logs/demo_bf16.log" -- \
  "$PY" -m ppoforge demo "${DEV[@]}" "${QUIET[@]}" "${DEMO_EXTRA[@]}" --run-dir "$R/demo" --overwrite

# ---- vLLM as the rollout engine, colocated ---------------------------------------------------------------------
VLLM_PY=${GPU_CHECK_VLLM_PYTHON:-$ROOT/.venv-vllm/bin/python}
[ -x "$VLLM_PY" ] || VLLM_PY=$PY
if "$VLLM_PY" -c "import vllm" >/dev/null 2>&1; then
  run_step vllm "$([ "$DRY" = 1 ] && echo 900 || echo 150)" "$([ "$DRY" = 1 ] && echo "dry run: CPU, no sleep mode")" \
    json "$WORK/vllm.json" -- "$VLLM_PY" benchmarks/vllm_gpu_check.py "$WORK/vllm.json" --device "$DEVICE"
else
  want vllm && skip_step vllm "no python with vLLM ($VLLM_PY): make venv-vllm, or pip install 'ppoforge[vllm]'"
fi

# ---- GRPO and PPO against TRL on the 0.5B-shaped workload -----------------------------------------------------
TRL_SKIP=""
TRL_PY=$TRL_VENV/bin/python
if [ ! -x "$TRL_PY" ]; then
  TRL_SKIP="no TRL venv at $TRL_VENV (rlhf_vs_trl.py makes it with pip, which needs the package index)"
elif ! "$TRL_PY" -c "import trl, sys; sys.exit(not trl.__version__.startswith('1.12.'))" >/dev/null 2>&1; then
  TRL_SKIP="$TRL_VENV has no TRL 1.12"
elif [ "$DRY" = 0 ] && ! "$TRL_PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" >/dev/null 2>&1; then
  TRL_SKIP="the torch of $TRL_VENV ($("$TRL_PY" -c 'import torch; print(torch.__version__)' 2>&1 | tail -n 1)) sees no GPU"
fi
TRL_GRPO_SKIP=$TRL_SKIP
if [ -z "$TRL_SKIP" ] && ! "$TRL_PY" -c "import requests" >/dev/null 2>&1; then
  TRL_GRPO_SKIP="$TRL_VENV lacks requests (GRPOTrainer imports it; rlhf_vs_trl.py would pip install it)"
fi
mkdir -p "$WORK/bench/grpo" "$WORK/bench/ppo"
[ -n "$TRL_GRPO_SKIP" ] && echo "$TRL_GRPO_SKIP" >"$WORK/bench/grpo/TRL_SKIP"
[ -n "$TRL_SKIP" ] && echo "$TRL_SKIP" >"$WORK/bench/ppo/TRL_SKIP"
BENCH=("$PY" benchmarks/rlhf_vs_trl.py --workloads "$BENCH_WORKLOAD" --device "$DEVICE" --updates "$BENCH_UPDATES"
       --warmup 1 --rounds 1 --threads "$THREADS" --quiet-wait 0 --timeout 240 --trl-venv "$TRL_VENV")
run_step grpo_vs_trl "$([ "$DRY" = 1 ] && echo 400 || echo 150)" "${TRL_GRPO_SKIP:+TRL skipped: $TRL_GRPO_SKIP}" \
  bench "$WORK/bench/grpo" -- \
  "${BENCH[@]}" --grpo --grpo-prompts 4 --grpo-generations 8 --grpo-new-tokens 32 --grpo-micro 8 --layouts lora \
  --precisions "$BENCH_PREC" --trl-precisions "$BENCH_TRL_GRPO" --out "$WORK/bench/grpo" ${TRL_GRPO_SKIP:+--skip-trl}
run_step ppo_vs_trl "$([ "$DRY" = 1 ] && echo 500 || echo 180)" "${TRL_SKIP:+TRL skipped: $TRL_SKIP}" \
  bench "$WORK/bench/ppo" -- \
  "${BENCH[@]}" --layouts full,lora --precisions "$BENCH_PREC" --trl-precisions "$BENCH_TRL_PPO" \
  --out "$WORK/bench/ppo" ${TRL_SKIP:+--skip-trl}

assemble 1
"$PY" - "$JSON" <<'PYEOF'
import json, sys
d = json.load(open(sys.argv[1]))
print(f"[gpu_check] {d['total_wall_s']} s; " + "; ".join(f"{k}: {', '.join(v)}" for k, v in d["summary"].items() if v))
print(f"[gpu_check] wrote {sys.argv[1]}")
PYEOF
