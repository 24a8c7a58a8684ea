"""The memory plan (`ppoforge plan`) against measured peaks: each config runs for real through the CLI on this
CPU, its peak RSS read from the kernel (the child's ru_maxrss), beside the plan's peak for `--device cpu`.

    .venv/bin/python benchmarks/memplan_check.py                 # the five configs below
    .venv/bin/python benchmarks/memplan_check.py --only grpo-lora --json out.json
    .venv/bin/python benchmarks/memplan_check.py --table         # what fits 0.5B / 1.5B / 8B on 24 / 40 / 80 GB

Each run is short (one RLHF update, or a few SFT / reward steps): a peak is reached in the first update or
step. Output: a table (plan GiB, measured GiB, measured / plan) on stdout and with --json every figure.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMON_RLHF = ["--total-updates", "1", "--heldout-prompts", "none", "--precision", "fp32", "--torch-threads", "2",
               "--progress", "false", "--tensorboard", "false", "--device", "cpu"]
CONFIGS = {
    "grpo-lora": ["rlhf", "--preset", "grpo", *COMMON_RLHF],
    "ppo-lora": ["rlhf", "--preset", "demo", *COMMON_RLHF],
    "grpo-full-kl": ["rlhf", "--preset", "grpo", "--layout", "full", "--kl-coef", "0.05", "--learning-rate", "1e-6",
                     *COMMON_RLHF],
    "sft-lora": ["sft", "--preset", "tiny", "--model", "smollm2-135m-instruct", "--precision", "fp32",
                 "--epochs", "0.25", "--progress", "false", "--tensorboard", "false", "--device", "cpu",
                 "--torch-threads", "2"],
    "reward-full": ["reward", "--preset", "tiny", "--model", "smollm2-135m-instruct", "--precision", "fp32",
                    "--epochs", "0.1", "--progress", "false", "--tensorboard", "false", "--device", "cpu",
                    "--torch-threads", "2"],
}


def data_files(tmp: Path) -> dict[str, Path]:
    """SFT rows and preference pairs from the packaged demo pairs, each text repeated to ~200 tokens: the plan
    is for rows at the presets' max_length (256), the worst case, so the measured rows come near it."""
    pairs = [json.loads(line) for line in (ROOT / "src/ppoforge/lm/data/demo_pairs.jsonl").read_text().splitlines()]

    def long(text: str) -> str:
        return " ".join([text] * 9)

    sft, reward = tmp / "sft.jsonl", tmp / "pairs.jsonl"
    sft.write_text("".join(json.dumps({"prompt": p["prompt"], "completion": long(p["chosen"])}) + "\n"
                           for p in pairs))
    reward.write_text("".join(json.dumps({"prompt": p["prompt"], "chosen": long(p["chosen"]),
                                          "rejected": long(p["rejected"])}) + "\n" for p in pairs))
    return {"sft": sft, "reward": reward}


def measured_peak(argv: list[str]) -> float:
    """Peak RSS in bytes of `ppoforge ARGV` run in a fresh child of a fresh process (so the maximum is its own)."""
    code = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss if r.returncode == 0 else -1)")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT / ".venv/bin/ppoforge"), "train", *argv],
                         capture_output=True, text=True, cwd=ROOT)
    kib = int(out.stdout.strip().splitlines()[-1])
    if kib < 0:
        raise SystemExit(f"ppoforge train {' '.join(argv)} failed:\n{out.stderr[-2000:]}")
    return kib * 1024.0


def planned_peak(argv: list[str]) -> dict:
    cmd = [str(ROOT / ".venv/bin/ppoforge"), "plan", *[a for a in argv if a not in ("--device", "cpu")], "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    return json.loads(out.stdout)


# the public shapes (config.json values) of the models the table plans for
SHAPES = {
    "Qwen2.5-0.5B": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "Qwen2.5-1.5B": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    "Llama-3-8B": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False),
}


def table() -> None:
    """GRPO in bf16 on one GPU: 8 prompts x 8 completions sampled at once, 256 + 512 positions, micro-batch 4;
    LoRA r 16 (no reference: adapters off) and full (a reference copy, kl_coef > 0)."""
    from transformers import Qwen2Config

    from ppoforge.lm.models import memplan

    print("| model | layout | peak (GiB) | 24 GB | 40 GB | 80 GB |\n|---|---|---|---|---|---|")
    for name, shape in SHAPES.items():
        m = memplan.model_shape(Qwen2Config(**shape, max_position_embeddings=4096))
        for layout in ("lora", "full"):
            w = memplan.Workload(layout=layout, compute_bytes=2, lora_r=16, micro_rows=4, tokens=768, gen_rows=64,
                                 resp_tokens=512, reference=layout == "full")
            cells = []
            for gb in (24, 40, 80):
                result = memplan.plan(m, w, gb * 1e9, f"cuda:{gb}GB")
                cells.append("fits" if result.fits else f"no — {result.fix or 'not on one GPU'}")
            peak = memplan.plan(m, w, None, "cuda").peak / 2**30
            print(f"| {name} | {layout} | {peak:.1f} | " + " | ".join(cells) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(CONFIGS), help="comma list of: " + ", ".join(CONFIGS))
    p.add_argument("--json", help="write every figure here")
    p.add_argument("--table", action="store_true", help="the plan's table for 0.5B / 1.5B / 8B on one GPU; no run")
    args = p.parse_args()
    if args.table:
        table()
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="memplan-") as tmp:
        files = data_files(Path(tmp))
        for name in args.only.split(","):
            argv = list(CONFIGS[name])
            kind = argv[0]
            if kind in files:
                argv += ["--data", str(files[kind])]
            argv += ["--run-dir", str(Path(tmp) / name)]
            plan = planned_peak(argv[:-2])
            peak = measured_peak(argv)
            rows.append({"config": name, "argv": argv[:-2], "plan_gib": plan["peak"] / 2**30,
                         "measured_gib": peak / 2**30, "ratio": peak / plan["peak"], "phases": plan["phases"]})
            print(f"{name}: plan {rows[-1]['plan_gib']:.2f} GiB, measured {rows[-1]['measured_gib']:.2f} GiB "
                  f"(measured / plan {rows[-1]['ratio']:.2f})", flush=True)
    print("\n| config | plan (GiB) | measured peak RSS (GiB) | measured / plan |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['plan_gib']:.2f} | {r['measured_gib']:.2f} | {r['ratio']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": _cpu(), "rows": rows}, indent=1))


def _cpu() -> str:
    return next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")), "?")


if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    main()
