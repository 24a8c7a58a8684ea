"""The rollout engines side by side in one process: decode tokens/s of ppoforge's lean decoder and of vLLM
(`rollout_engine: vllm`, in-process) at 8 / 32 / 64 rows, vLLM's engine start, and the weight sync per update
(LoRA: the merged adapted Linears; full: every parameter). Run with the vLLM venv (`make venv-vllm`):

    .venv-vllm/bin/python benchmarks/vllm_decode.py --precisions bf16,fp32 --out benchmarks/results

The real SmolLM2-135M-Instruct (the built-in model), the demo prompts (~20-30 tokens), 128 new tokens with no
stop token (every row decodes the whole budget on both sides), temperature 1; each point is the best of
--repeats calls after one warm-up call. Same torch, same threads, same process: ratios are comparable; the
absolute numbers are this CPU's.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="8,32,64", help="rows sampled at once (comma list)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--precisions", default="bf16,fp32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2, help="timed calls per point (the best is kept)")
    p.add_argument("--out", default=None, help="folder for vllm_decode.json")
    return p.parse_args()


def trainer_for(precision: str, layout: str, rows: int, new_tokens: int, engine: str):
    from ppoforge.config import build_config
    from ppoforge.lm.rl.config import RLHFConfig
    from ppoforge.lm.rl.trainer import RLHFTrainer

    cfg = build_config(RLHFConfig, dict(model="smollm2-135m-instruct", prompts="demo", heldout_prompts=None,
                                        layout=layout,
                                        precision=precision, device="cpu", rollout_engine=engine,
                                        batch_size=rows, num_generations=1, advantage="reinforce_pp",
                                        max_new_tokens=new_tokens, max_prompt_tokens=48, kl_coef=0.0,
                                        progress=False, tensorboard=False, total_updates=1))
    return RLHFTrainer(cfg, Path(f"/tmp/vllm-decode-{precision}-{layout}-{engine}"))


def best_time(fn, repeats: int) -> float:
    fn()  # warm-up: vLLM's first generate compiles and allocates
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def best_sync(engine, repeats: int = 3) -> float:
    """The best of `repeats` whole syncs (every changed weight pushed, the prefix cache reset)."""
    engine.take_sync_seconds()
    syncs = []
    for _ in range(repeats):
        engine.weights_changed()
        engine._wake_and_sync()
        syncs.append(engine.take_sync_seconds())
    return min(syncs)


def measure(precision: str, rows_list: list[int], new_tokens: int, repeats: int) -> dict:
    from ppoforge.lm.models.attention import left_pad
    from ppoforge.lm.models.engines import LocalEngine
    from ppoforge.lm.models.sampler import SamplingParams

    biggest = max(rows_list)
    start = time.perf_counter()
    trainer = trainer_for(precision, "lora", biggest, new_tokens, "vllm")  # builds the engine inside
    build_s = time.perf_counter() - start
    vllm_engine = trainer.engine
    lean = LocalEngine(trainer.layout, trainer.precision, biggest, "lean")
    tok = trainer.tokenizer
    params = SamplingParams(new_tokens, temperature=1.0, stop_ids=(), pad_id=tok.pad_token_id)
    out = {"precision": trainer.precision.name, "build_s_with_engine": build_s, "rows": {}}
    for rows in rows_list:
        prompts = [trainer.inputs.prompt_ids[i % len(trainer.inputs.prompt_ids)] for i in range(rows)]
        ids, mask = left_pad(prompts, tok.pad_token_id, torch.device("cpu"))
        u = torch.rand(new_tokens, rows, generator=torch.Generator().manual_seed(0))
        point = {}
        for name, engine in (("lean", lean), ("vllm", vllm_engine)):
            s = best_time(lambda e=engine, i=ids, m=mask, u=u: e.generate(i, m, params, u), repeats)
            point[name] = {"s": s, "tokens_per_s": rows * new_tokens / s, "ms_per_step": 1000 * s / new_tokens}
            print(f"{precision} {rows} rows {name}: {point[name]['tokens_per_s']:.0f} tokens/s "
                  f"({point[name]['ms_per_step']:.1f} ms per step)", flush=True)
        point["vllm_over_lean"] = point["vllm"]["tokens_per_s"] / point["lean"]["tokens_per_s"]
        out["rows"][rows] = point
    out["sync_s_lora"] = best_sync(vllm_engine)
    vllm_engine.close()
    # the engine's start alone, and the full layout's sync (every parameter)
    from ppoforge.lm.models.loading import resolve_model
    from ppoforge.lm.models.vllm_engine import VLLMEngine
    full = trainer_for(precision, "full", 8, new_tokens, "lean")
    start = time.perf_counter()
    dtype = full.precision.dtype or torch.float32
    engine = VLLMEngine(resolve_model("smollm2-135m-instruct"), full.layout, torch.device("cpu"), dtype, 8,
                        48 + new_tokens, 0)
    out["engine_start_s"] = time.perf_counter() - start
    out["sync_s_full"] = best_sync(engine)
    engine.close()
    print(f"{precision}: engine start {out['engine_start_s']:.1f} s, sync LoRA {out['sync_s_lora']:.3f} s, "
          f"full {out['sync_s_full']:.3f} s", flush=True)
    return out


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    import vllm

    import ppoforge
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")), "?")
    result = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpu": model, "machine": platform.machine(),
              "threads": args.threads, "new_tokens": args.new_tokens,
              "versions": {"ppoforge": ppoforge.__version__, "vllm": vllm.__version__, "torch": torch.__version__},
              "precisions": {}}
    for precision in args.precisions.split(","):
        result["precisions"][precision] = measure(precision, [int(r) for r in args.rows.split(",")],
                                                  args.new_tokens, args.repeats)
    if args.out:
        path = Path(args.out) / "vllm_decode.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
