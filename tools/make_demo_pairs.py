"""Build the pipeline demo's preference pairs: SmolLM2's own completions, ranked by VADER sentiment.

    .venv/bin/python tools/make_demo_pairs.py            # writes src/ppoforge/lm/data/demo_pairs.jsonl

For every built-in demo prompt (184 training, 16 held-out) SmolLM2-135M-Instruct samples 4 completions
(temperature 1.0, 32 new tokens, seed 0); VADER scores them; the most and the least positive form a
pair, and the second and third when they too differ by >= 0.2. Rows: prompt, chosen, rejected, margin
(the VADER gap, for `use_margin`), split (train / heldout: the held-out prompts never reach training).
The SFT stage of the demo trains on the training split's chosen completions (`demo-sft`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "src" / "ppoforge" / "lm" / "data" / "demo_pairs.jsonl"
SAMPLES, NEW_TOKENS, MIN_GAP = 4, 32, 0.2


def main() -> None:
    from ppoforge.lm.data.prompts import load_prompts
    from ppoforge.lm.models.attention import left_pad
    from ppoforge.lm.models.loading import load_causal_lm, load_tokenizer
    from ppoforge.lm.models.sampler import SamplingParams, sample
    from ppoforge.lm.rl.build import tokenize_prompts
    from ppoforge.lm.rl.rewards import vader_sentiment

    torch.set_num_threads(2)
    tok = load_tokenizer("smollm2-135m-instruct")
    model = load_causal_lm("smollm2-135m-instruct", torch.float32, "cpu", tokenizer=tok)
    params = SamplingParams(NEW_TOKENS, 1.0, 0, 1.0, (tok.eos_token_id,), tok.pad_token_id)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for split, source in (("train", "demo"), ("heldout", "demo-heldout")):
        prompts = [r["prompt"] for r in load_prompts(source)]
        ids = tokenize_prompts(tok, [{"prompt": p} for p in prompts], "prompt", True, 64)
        for s in range(0, len(prompts), 8):
            batch = [i for i in range(s, min(s + 8, len(prompts))) for _ in range(SAMPLES)]
            prompt_ids, mask = left_pad([ids[i] for i in batch], tok.pad_token_id, "cpu")
            out = sample(model, prompt_ids, mask, params, gen)
            lengths = out.response_mask.sum(1).long().tolist()
            texts = tok.batch_decode([r[:n] for r, n in zip(out.response_ids.tolist(), lengths, strict=True)],
                                     skip_special_tokens=True)
            scores = vader_sentiment(None, texts)
            for k, i in enumerate(range(s, min(s + 8, len(prompts)))):
                ranked = sorted(zip(scores[k * SAMPLES:(k + 1) * SAMPLES], texts[k * SAMPLES:(k + 1) * SAMPLES],
                                    strict=True), reverse=True)
                for hi, lo in ((0, -1), (1, -2)):
                    gap = ranked[hi][0] - ranked[lo][0]
                    if gap >= MIN_GAP and ranked[hi][1].strip() and ranked[lo][1].strip():
                        rows.append({"prompt": prompts[i], "chosen": ranked[hi][1], "rejected": ranked[lo][1],
                                     "margin": round(gap, 4), "split": split})
            print(f"{split} {min(s + 8, len(prompts))}/{len(prompts)}: {len(rows)} pairs", file=sys.stderr, flush=True)
    OUT.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} pairs to {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
