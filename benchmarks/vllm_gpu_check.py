"""gpu_check.sh's `vllm` step: `rollout_engine: vllm` colocated with training on one device, what only a GPU can
show — the engine's share of GPU memory, sleep mode between rollouts (level 1 with LoRA, 2 with full weights),
the weight sync's seconds, vLLM's log-probs against the training forward — for the LoRA and the full layout,
2 updates each on SmolLM2-135M, then a greedy continuation of vLLM against the training model's.

    python benchmarks/vllm_gpu_check.py OUT.json [--device cuda|cpu]

Writes {"runs": [...], "problems": [...]} (a problem: a run that failed, or a greedy mismatch in fp32).
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

import torch


def one_run(layout: str, precision: str, device: str, work: Path) -> dict:
    from ppoforge.config import build_config
    from ppoforge.lm.models.sampler import SamplingParams
    from ppoforge.lm.rl.config import RLHFConfig
    from ppoforge.lm.rl.trainer import RLHFTrainer

    cfg = build_config(RLHFConfig, dict(
        model="smollm2-135m-instruct", prompts="demo", heldout_prompts=None, layout=layout, precision=precision,
        device=device,
        rollout_engine="vllm", vllm_sleep=device == "cuda", advantage="grpo", num_generations=4, batch_size=4,
        kl_coef=0.0, max_new_tokens=32, max_prompt_tokens=48, learning_rate=1e-4 if layout == "lora" else 1e-6,
        total_updates=2, progress=False, tensorboard=False))
    start = time.perf_counter()
    trainer = RLHFTrainer(cfg, work / f"{layout}-{precision}")
    row = {"layout": layout, "precision": precision, "device": device, "build_s": time.perf_counter() - start,
           "updates": []}
    for _ in range(2):
        m, _ = trainer.train_one_update()
        row["updates"].append({k: m.get(k) for k in ("perf/update_s", "perf/weight_sync_s", "perf/generation_share",
                                                      "rollout/logprob_mismatch_mean", "rollout/logprob_mismatch_max",
                                                      "objective/scores")})
    if device == "cuda":
        row["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    prompt = torch.tensor([trainer.inputs.prompt_ids[0][-16:]], device=trainer.inputs.device)
    ids = prompt
    with torch.inference_mode(), trainer.precision.autocast():
        for _ in range(16):
            ids = torch.cat([ids, trainer.layout.policy_model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    trainer.engine.weights_changed()
    out = trainer.engine.generate(prompt, torch.ones_like(prompt), SamplingParams(16, temperature=0.0,
                                  pad_id=trainer.tokenizer.pad_token_id), torch.rand(16, 1))
    same = out.response_ids[0].tolist() == ids[0, prompt.shape[1]:].tolist()
    row["greedy_equal"] = same
    row["greedy_first_difference"] = next((i for i, (a, b) in enumerate(zip(out.response_ids[0].tolist(),
                                           ids[0, prompt.shape[1]:].tolist(), strict=False)) if a != b), None)
    trainer.engine.close()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    work = Path(args.out).parent / "vllm_runs"
    result = {"runs": [], "problems": []}
    for layout, precision in (("lora", "fp32"), ("full", "bf16")):
        try:
            row = one_run(layout, precision, args.device, work)
            if precision == "fp32" and not row["greedy_equal"]:
                result["problems"].append(f"{layout} fp32: vLLM's greedy continuation differs from the training "
                                          f"model's at token {row['greedy_first_difference']}")
        except Exception as e:  # noqa: BLE001 - a failing run is the finding; the next one still runs
            row = {"layout": layout, "precision": precision, "error": f"{type(e).__name__}: {e}",
                   "traceback": traceback.format_exc()[-2000:]}
            result["problems"].append(f"{layout} {precision}: {type(e).__name__}: {str(e)[:200]}")
        result["runs"].append(row)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["problems"]))


if __name__ == "__main__":
    main()
