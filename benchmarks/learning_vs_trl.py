"""Held-out accuracy against wall time: ppoforge's GRPO and TRL's GRPOTrainer on the same task and machine.

    .venv/bin/python benchmarks/learning_vs_trl.py                      # 480 s of training each side
    .venv/bin/python benchmarks/learning_vs_trl.py --budget-s 120 --every-s 40 --heldout 16   # a quick look
    .venv/bin/python benchmarks/learning_vs_trl.py --max-updates 8 --every-updates 2 --seeds 1,2,3  # per update

What runs (one after the other, on this machine, each for the same training wall-clock budget):
- the task (learning_task.py): the real SmolLM2-135M-Instruct, reasoning-gym chain_sum as the arithmetic
  demo sets it (two terms of one digit, the preset's few-shot prompt, answers in <answer> tags), training
  problems disjoint from `--heldout` held-out problems of another generator seed;
- ppoforge (ppoforge_learning_worker.py, this venv, `--ppoforge-precision`, default fp32, as TRL's side) and TRL
  (trl_learning_worker.py, `--trl-venv`, default the newest TRL in .bench-venvs/trl-current, made if
  missing; `--trl-precision`, default fp32 = bf16=False, TRL's fastest setting on the CPUs measured here)
  with the same prompts, reward, G, prompts per step, learning rate, LoRA rank and alpha, beta,
  temperature and token budget (each worker's docstring lists them in its framework's words);
- each saves its LoRA adapter every `--every-s` seconds of training and at the end;
- then this process scores the untrained model and every snapshot of both with the same code: HF
  `generate` in fp32, `--samples` completions of every held-out problem at the training temperature, the
  same seed for every snapshot, scored by `learning_task.answer_reward`. Accuracy = exact answers / samples,
  with Wilson's 95 % interval (ppoforge.core.stats.binomial_interval; over samples, so narrower than over
  problems).

Output under --out: learning_vs_trl.json (every point, both runs' settings and versions, the machine's
other load during each run), learning_vs_trl.png (accuracy against training seconds, error bars) and a
markdown table on stdout. The summary line compares TRL's final accuracy with the first ppoforge
snapshot that reaches it. `--max-updates N --every-updates K` instead trains each side N updates with a
snapshot every K and compares accuracy per update (learning_vs_trl_per_update.*), over `--seeds`: the
question behind seconds — does one update of each side move held-out accuracy alike?
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import learning_task  # noqa: E402
import rlhf_vs_trl  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget-s", type=float, default=480.0, help="training wall time of each side")
    p.add_argument("--every-s", type=float, default=60.0, help="a snapshot every this many training seconds")
    p.add_argument("--heldout", type=int, default=64, help="held-out problems")
    p.add_argument("--samples", type=int, default=4, help="completions scored per held-out problem")
    p.add_argument("--digits", type=int, default=1, help="operand digits (2: the harder variant)")
    p.add_argument("--seed", type=int, default=0, help="both trainers' seed")
    p.add_argument("--seeds", default=None, help="comma list of seeds, one run of each side per seed (default: --seed)")
    p.add_argument("--max-updates", type=int, default=None, help="each side stops after this many updates too")
    p.add_argument("--every-updates", type=int, default=None,
                   help="a snapshot every this many updates instead of --every-s; compares accuracy per update")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ppoforge-precision", default="fp32", choices=["fp32", "bf16", "auto"],
                   help="fp32 by default, as TRL's side (--trl-precision): identical settings")
    p.add_argument("--ppoforge-lm-head-fp32", action="store_true",
                   help="ppoforge's lm_head_fp32: the LM head in fp32 under bf16 (docs/rlhf.md)")
    p.add_argument("--ppoforge-emulate-bf16", action="store_true",
                   help="with --ppoforge-precision bf16 on a CPU without native bf16: its matmuls computed as "
                        "bf16 hardware rounds them, at fp32 speed (bf16_emulation.py)")
    p.add_argument("--ppoforge-batch", type=int, default=None,
                   help="ppoforge's prompts per update (default: the preset's 4, as TRL's): what its faster "
                        "steps can buy; one optimizer step per rollout either way")
    p.add_argument("--ppoforge-engine", default="auto", choices=["auto", "lean", "hf", "vllm"],
                   help="ppoforge's rollout_engine (vllm: run this harness with .venv-vllm's python)")
    p.add_argument("--trl-precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--trl-venv", default=str(ROOT / ".bench-venvs" / "trl-current"))
    p.add_argument("--sides", default="ppoforge,trl", help="which to run, in this order")
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--timeout", type=float, default=3600.0, help="per worker")
    p.add_argument("--combine", metavar="JSON", nargs="+", default=None,
                   help="merge the scored runs of these result files (same task and evaluator; other seeds) into "
                        "one table and figure, training and scoring nothing")
    p.add_argument("--score-only", metavar="WORK_DIR", default=None,
                   help="score the snapshots already in WORK_DIR (a work dir this script printed), train nothing")
    p.add_argument("--quiet-wait", type=float, default=120.0,
                   help="seconds to wait, before each run, for other load to fall below 0.3 cores")
    return p.parse_args()


def trl_python(venv: Path) -> Path:
    """The newest TRL's venv, with what the task needs: peft (this venv's version), reasoning-gym, requests."""
    py = rlhf_vs_trl.ensure_trl_venv(venv, *rlhf_vs_trl.TRL_VENVS["trl-current"])
    for module, req in (("peft", f"peft=={importlib.metadata.version('peft')}"), ("requests", "requests"),
                        ("reasoning_gym", f"reasoning-gym=={importlib.metadata.version('reasoning_gym')}")):
        if subprocess.run([str(py), "-c", f"import {module}"], capture_output=True).returncode:
            subprocess.run([str(py), "-m", "pip", "install", "-q", req], check=True)
    return py


def run(cmd: list[str], args: argparse.Namespace, log: Path) -> dict:
    """One worker in a fresh process (its output to `log`); the machine's other load while it ran."""
    env = {**rlhf_vs_trl.worker_env(args), "CUDA_VISIBLE_DEVICES": ""}
    waited = rlhf_vs_trl.wait_for_quiet(args.quiet_wait)
    (b0, t0), c0 = rlhf_vs_trl.busy_seconds(), rlhf_vs_trl.children_cpu()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=args.timeout, cwd=ROOT)
    (b1, t1), c1 = rlhf_vs_trl.busy_seconds(), rlhf_vs_trl.children_cpu()
    if proc.returncode:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise SystemExit(f"{cmd[1]} exited {proc.returncode}:\n{tail}")
    return {"other_load_cores": max(0.0, (b1 - b0) - (c1 - c0)) / (t1 - t0), "quiet_wait_s": waited,
            "process_s": t1 - t0}


class Evaluator:
    """The held-out score of a LoRA snapshot: one fp32 model with peft's adapter slots, the same seed,
    sampling settings and reward for every snapshot of either side."""

    def __init__(self, model_dir: Path, rows: list[dict], samples: int, seed: int, batch: int = 64,
                 new_tokens: int | None = None):
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from ppoforge.config import read_preset

        preset = read_preset("arithmetic_demo", "rlhf")
        self.temperature, self.new_tokens = preset["temperature"], new_tokens or preset["max_new_tokens"]
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.tok.padding_side = "left"
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.eos = [self.tok.eos_token_id, self.tok.convert_tokens_to_ids("Ċ")]
        lora = LoraConfig(**learning_task.LORA)
        self.model = get_peft_model(base, lora).eval()
        self.rows = [r for r in rows for _ in range(samples)]
        self.seed, self.batch = seed, batch

    def _complete(self) -> list[str]:
        import torch

        torch.manual_seed(self.seed)
        texts = []
        for i in range(0, len(self.rows), self.batch):
            prompts = [r["prompt"] for r in self.rows[i:i + self.batch]]
            enc = self.tok(prompts, return_tensors="pt", padding=True)
            with torch.inference_mode():
                ids = self.model.generate(**enc, do_sample=True, temperature=self.temperature, top_k=0, top_p=1.0,
                                          max_new_tokens=self.new_tokens, eos_token_id=self.eos,
                                          pad_token_id=self.tok.pad_token_id or self.tok.eos_token_id)
            texts += self.tok.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        return texts

    def score(self, snapshot: Path | None) -> dict:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        from ppoforge.core.stats import binomial_interval

        if snapshot is None:
            with self.model.disable_adapter():
                texts = self._complete()
        else:
            set_peft_model_state_dict(self.model, load_file(snapshot), adapter_name="default")
            texts = self._complete()
        print(f"[eval] {snapshot or 'untrained'}", flush=True)
        scores = learning_task.answer_reward([r["prompt"] for r in self.rows], texts, [r["entry"] for r in self.rows])
        exact = sum(s == 1.0 for s in scores)
        lo, hi = binomial_interval(exact, len(scores))
        return {"accuracy": exact / len(scores), "lo": lo, "hi": hi, "exact": exact, "n": len(scores),
                "tagged": sum("<answer>" in t for t in texts) / len(texts), "example": texts[0]}


def reach(points: list[dict], target: float) -> dict | None:
    """The first point at or above `target` accuracy."""
    return next((p for p in points if p["accuracy"] >= target), None)


def summary(runs: dict, x: str) -> list[str]:
    """The table of every run's points (`runs`: seed -> side -> run), TRL's final accuracy against the
    first ppoforge point that reaches it, and with several seeds the mean per `x` (updates or seconds)."""
    lines = ["| seed | side | training s | updates | held-out exact | 95 % interval |", "|---|---|---|---|---|---|"]
    for seed, sides in runs.items():
        for name, side in sides.items():
            for p in side["points"]:
                lines.append(f"| {seed} | {name} | {p['train_s']:.0f} | {p['updates']} | {p['accuracy']:.1%} "
                             f"({p['exact']}/{p['n']}) | [{p['lo']:.1%}, {p['hi']:.1%}] |")
    for seed, sides in runs.items():
        if {"ppoforge", "trl"} <= sides.keys():
            trl_end, ours = sides["trl"]["points"][-1], sides["ppoforge"]["points"]
            hit = reach(ours[1:], trl_end["accuracy"])
            if hit is None:
                lines.append(f"\nseed {seed}: ppoforge never reached TRL's final {trl_end['accuracy']:.1%} "
                             f"(its best {max(p['accuracy'] for p in ours):.1%}).")
            else:
                lines.append(f"\nseed {seed}: ppoforge reached TRL's final {trl_end['accuracy']:.1%} (at "
                             f"{trl_end['train_s']:.0f} s, {trl_end['updates']} updates) after {hit['train_s']:.0f} s, "
                             f"{hit['updates']} updates: {hit['train_s'] / trl_end['train_s']:.2f} of TRL's time; "
                             f"final {ours[-1]['accuracy']:.1%} vs {trl_end['accuracy']:.1%}.")
    if len(runs) > 1:
        lines += ["", f"| side | {x} | mean held-out exact over seeds | lowest | highest |", "|---|---|---|---|---|"]
        for name, curve in mean_curves(runs, x).items():
            lines += [f"| {name} | {at:g} | {mean:.1%} | {lo:.1%} | {hi:.1%} |" for at, mean, lo, hi in curve]
    return lines


def mean_curves(runs: dict, x: str) -> dict[str, list[tuple[float, float, float, float]]]:
    """Per side: (x, mean, lowest, highest accuracy over the seeds that ran it) at each x all of them have a
    point at (combined files may hold a side for some seeds only). Snapshots by seconds fall a few seconds
    apart in each seed: there the k-th snapshots of the seeds are averaged, at their mean second."""
    out = {}
    for name in dict.fromkeys(name for sides in runs.values() for name in sides):
        seeds = [sides[name] for sides in runs.values() if name in sides]
        by_x: dict[float, list[tuple[float, float]]] = {}
        for side in seeds:
            for k, p in enumerate(side["points"]):
                by_x.setdefault(p[x] if x == "updates" else k, []).append((p[x], p["accuracy"]))
        out[name] = [(round(sum(at for at, _ in v) / len(v)), sum(a for _, a in v) / len(v), min(a for _, a in v),
                      max(a for _, a in v)) for _, v in sorted(by_x.items()) if len(v) == len(seeds)]
    return out


def plot(runs: dict, path: Path, title: str, x: str) -> None:
    """Held-out accuracy against `x` (train_s or updates): each run with its error bars; with several seeds
    also their mean per x, bold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    names = list(dict.fromkeys(name for sides in runs.values() for name in sides))
    colours = dict(zip(names, ("tab:blue", "tab:orange"), strict=False))
    labels = {name: side["label"] for sides in runs.values() for name, side in sides.items()}
    several = len(runs) > 1
    for sides in runs.values():
        for name, side in sides.items():
            pts = side["points"]
            xs, y = [p[x] for p in pts], [100 * p["accuracy"] for p in pts]
            err = [[100 * (p["accuracy"] - p["lo"]) for p in pts], [100 * (p["hi"] - p["accuracy"]) for p in pts]]
            ax.errorbar(xs, y, yerr=err, marker="o", capsize=3, color=colours[name], alpha=0.35 if several else 1,
                        lw=1 if several else 1.5, label=None if several else side["label"])
    if several:
        for name, curve in mean_curves(runs, x).items():
            count = sum(name in sides for sides in runs.values())
            label = labels[name] + f", mean of {count} seeds"
            ax.plot([c[0] for c in curve], [100 * c[1] for c in curve], marker="s", lw=2.5, color=colours[name],
                    label=label)
    ax.set_xlabel("training wall time (s)" if x == "train_s" else "updates (optimizer steps)")
    ax.set_ylabel("held-out exact answers (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def train_side(name: str, args: argparse.Namespace, work: Path, model_dir: Path, seed: int) -> dict:
    """Run one side's worker for the budget; its settings, the machine's load and its snapshots."""
    out = work / f"seed{seed}" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    common = ["--task-dir", str(work / "task"), "--budget-s", str(args.budget_s), "--every-s", str(args.every_s),
              "--seed", str(seed), "--threads", str(args.threads), "--out", str(out),
              *(["--max-updates", str(args.max_updates)] if args.max_updates else []),
              *(["--every-updates", str(args.every_updates)] if args.every_updates else [])]
    if name == "ppoforge":
        cmd = [sys.executable, str(HERE / "ppoforge_learning_worker.py"), *common,
               "--precision", args.ppoforge_precision, "--rollout-engine", getattr(args, "ppoforge_engine", "auto"),
               *(["--batch-size", str(args.ppoforge_batch)] if args.ppoforge_batch else []),
               *(["--lm-head-fp32"] if args.ppoforge_lm_head_fp32 else []),
               *(["--emulate-bf16"] if args.ppoforge_emulate_bf16 else [])]
    else:
        cmd = [str(trl_python(Path(args.trl_venv))), str(HERE / "trl_learning_worker.py"), *common,
               "--model-dir", str(model_dir), "--precision", args.trl_precision]
    print(f"[run] {name}, seed {seed}: {args.budget_s:.0f} s of training"
          + (f" or {args.max_updates} updates" if args.max_updates else ""), flush=True)
    return side_result(name, out, run(cmd, args, out.with_suffix(".log")))


def side_result(name: str, out: Path, load) -> dict:
    """A side's finished run in `out` (run.json, snapshots.jsonl) as `train_side` returns it."""
    info = json.loads((out / "run.json").read_text())
    label = (f"ppoforge {info['version']} ({info['resolved_precision']}"
             f"{' emulated' if info.get('emulate_bf16') else ''}, "
             f"{'vLLM, ' if info.get('rollout_engine') == 'vllm' else ''}"
             f"{info['settings']['batch_size']} prompts/update)" if name == "ppoforge"
             else f"TRL {info['version']} ({'bf16=True' if info['precision'] == 'bf16' else 'bf16=False'})")
    return {"label": label, "run": info, "load": load, "dir": str(out),
            "snapshots": learning_task.read_rows(out / "snapshots.jsonl")}


def main() -> None:
    args = parse_args()
    from ppoforge.lm.models.smollm2 import ensure_cached

    model_dir = ensure_cached()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [args.seed]
    if args.combine:
        results = [json.loads(Path(f).read_text()) for f in args.combine]
        if len({json.dumps(r["task"], sort_keys=True) for r in results}) > 1:
            raise SystemExit("--combine: the files hold different tasks")
        runs: dict = {}
        for r in results:  # a seed's sides may come from several files (one side each)
            for seed, sides in r["runs"].items():
                runs.setdefault(seed, {}).update(sides)
        x = results[0].get("x") or ("updates" if results[0]["args"]["every_updates"] else "train_s")
        scored = {k: results[0]["args"][k] for k in ("samples", "threads")}  # how the runs were scored
        report(argparse.Namespace(**(vars(args) | scored)), out, results[0]["task"], runs, x)
        return
    if args.score_only:
        work = Path(args.score_only)
        task = json.loads((work / "task" / "task.json").read_text())
        runs = json.loads((work / "runs.json").read_text())
    else:
        work = Path(tempfile.mkdtemp(prefix="learning-vs-trl-"))
        task, runs = learning_task.build(work / "task", heldout=args.heldout, digits=args.digits), {}
        print(f"[task] {task['train_rows']} training rows ({task['distinct_train_problems']} distinct problems, "
              f"{task['left_out']} left out as held out), {task['heldout_rows']} held-out problems; work dir {work}",
              flush=True)
        for seed in seeds:
            for name in args.sides.split(","):
                runs.setdefault(str(seed), {})[name] = train_side(name, args, work, model_dir, seed)
                (work / "runs.json").write_text(json.dumps(runs, indent=1))
    print("[eval] scoring the untrained model and every snapshot", flush=True)
    import torch

    torch.set_num_threads(args.threads)
    evaluator = Evaluator(model_dir, learning_task.read_rows(work / "task" / "heldout.jsonl"), args.samples,
                          seed=1234)
    start = {"train_s": 0.0, "updates": 0, **evaluator.score(None)}
    for sides in runs.values():
        for side in sides.values():
            side["points"] = [start] + [{"train_s": s["train_s"], "updates": s["updates"], "train_score": s["score"],
                                         **evaluator.score(Path(side["dir"]) / f"snap_{s['snapshot']}.safetensors")}
                                        for s in side["snapshots"]]
    report(args, out, task, runs, "updates" if args.every_updates else "train_s")


def cpu_name() -> str:
    return next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")), "?")


def report(args: argparse.Namespace, out: Path, task: dict, runs: dict, x: str) -> None:
    """The table on stdout, the figure and the JSON of scored `runs` against `x` (train_s or updates)."""
    lines = summary(runs, x)
    print("\n".join(lines))
    cpu = cpu_name()
    title = (f"SmolLM2-135M-Instruct, chain_sum {task['digits']}-digit, GRPO G=8, LoRA r16; {task['heldout_rows']} "
             f"held-out x {args.samples}\n{cpu}, {args.threads} threads")
    stem = out / ("learning_vs_trl" + ("" if task["digits"] == 1 else f"_{task['digits']}digit")
                  + ("_per_update" if x == "updates" else ""))
    plot(runs, stem.with_suffix(".png"), title, x)
    stem.with_suffix(".json").write_text(json.dumps({"args": vars(args), "task": task, "cpu": cpu, "x": x,
                                                     "runs": runs, "table": lines}, indent=1))
    print(f"[out] {stem}.json, {stem}.png")


if __name__ == "__main__":
    main()
