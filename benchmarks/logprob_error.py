"""How far bf16 moves the log-probs a policy-gradient step uses, and how much of that is the LM head.

SmolLM2-135M-Instruct samples completions to two-digit arithmetic prompts (the harder variant of the
arithmetic preset) in fp32; then the log-prob of every sampled token is computed as the trainer does (one
forward over prompt + completion, `token_logprobs` at the response positions) five ways:

- fp32: the reference;
- bf16: autocast, the LM head in bf16 too (what `precision: bf16` computes by default);
- bf16, fp32 head: autocast for the body, the head in fp32 (`lm_head_fp32: true`);
- fp32 body, logits rounded to bf16: isolates the head's output rounding;
- fp32 body, hidden state rounded to bf16 before an fp32 head: isolates the head's input rounding;
- with `--emulated`, also bf16 as bf16_emulation.py computes it at fp32 speed, against fp32 and against
  this CPU's own bf16 kernels (the last row): how far the emulation is from the real thing.

Printed per variant: mean and max |delta log p| per token against fp32, the mean |delta| of each
completion's summed log-prob (what a sequence-level ratio such as GSPO's sees, before its length
normalization) and the KL(fp32 || variant) estimate k3 at the sampled tokens. One JSON line at the end.

    .venv/bin/python benchmarks/logprob_error.py --completions 8 --new-tokens 24

bf16 is emulated (slow) on a CPU without AVX-512-BF16 or AMX; the figures are the same wherever it runs
(the rounding is the format's, the kernels differ only in summation order).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import time

import torch

from bf16_emulation import EmulatedBf16Matmuls
from ppoforge.lm.models.attention import causal_mask, position_ids
from ppoforge.lm.models.loading import load_causal_lm, load_tokenizer
from ppoforge.lm.models.logprobs import token_logprobs
from ppoforge.lm.models.parts import head_in_fp32
from ppoforge.lm.models.sampler import SamplingParams, sample


def prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"What is {rng.randint(10, 99)} {rng.choice('+-*')} {rng.randint(10, 99)}? Answer with the number only."
            for _ in range(n)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--completions", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--emulated", action="store_true", help="add bf16 emulated at fp32 speed (bf16_emulation.py)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.model)
    model = load_causal_lm(args.model, torch.float32, "cpu", tokenizer=tokenizer, attn_implementation="eager")
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in prompts(args.completions, args.seed)]
    tokenizer.padding_side = "left"
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    params = SamplingParams(args.new_tokens, temperature=args.temperature,
                            stop_ids=(tokenizer.eos_token_id,), pad_id=tokenizer.pad_token_id)
    with torch.inference_mode():
        out = sample(model, enc.input_ids, enc.attention_mask, params, torch.Generator().manual_seed(args.seed))
    ids = torch.cat([enc.input_ids, out.response_ids], 1)
    mask = torch.cat([enc.attention_mask.float(), out.response_mask], 1)
    start, resp, keep = enc.input_ids.shape[1] - 1, out.response_ids, out.response_mask.bool()
    head = model.get_output_embeddings()

    def hidden(bf16: bool) -> torch.Tensor:
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            h = model.model(input_ids=ids, attention_mask=causal_mask(mask), position_ids=position_ids(mask))
            return h.last_hidden_state[:, start:-1]

    def logp(h: torch.Tensor, bf16: bool, round_logits=False, round_hidden=False) -> torch.Tensor:
        if round_hidden:
            h = h.bfloat16().float()
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        with torch.inference_mode(), ctx:
            z = head(h)
        z = z.bfloat16() if round_logits else z
        return token_logprobs(z, resp, args.temperature, entropy=False)[0]

    t0 = time.perf_counter()
    h32, h16 = hidden(False), hidden(True)
    exact = logp(h32, False)
    variants = {"bf16": logp(h16, True),
                "fp32 body, logits rounded to bf16": logp(h32, False, round_logits=True),
                "fp32 body, hidden rounded to bf16": logp(h32, False, round_hidden=True)}
    if args.emulated:
        with EmulatedBf16Matmuls():
            variants["bf16 emulated"] = logp(hidden(True), True)
    head_in_fp32(model)  # last: the option as a run applies it, from here on
    variants = {"bf16": variants.pop("bf16"), "bf16, fp32 head": logp(h16, True), **variants}
    result = {"model": args.model, "completions": args.completions, "tokens": int(keep.sum()),
              "mean_len": float(out.response_mask.sum(1).mean()), "seconds": round(time.perf_counter() - t0, 1),
              "torch": torch.__version__, "variants": {}}
    print(f"{int(keep.sum())} sampled tokens, {args.completions} completions (mean length {result['mean_len']:.1f})")
    print(f"{'variant':36s} {'mean |dlogp|':>12s} {'max |dlogp|':>12s} {'mean |d seq logp|':>18s} {'KL k3':>10s}")
    rows = [(name, lp, exact) for name, lp in variants.items()]
    if args.emulated:
        rows.append(("bf16 emulated, against bf16", variants["bf16 emulated"], variants["bf16"]))
    for name, lp, exact in rows:
        d = (lp - exact)[keep]
        seq = ((lp - exact) * out.response_mask).sum(1).abs().mean()
        log_ratio = (lp - exact)[keep]  # log q/p at tokens drawn from p (the reference): k3 = e^r - 1 - r
        k3 = (log_ratio.exp() - 1 - log_ratio).mean()
        row = {"mean_abs": d.abs().mean().item(), "max_abs": d.abs().max().item(), "seq_mean_abs": seq.item(),
               "kl_k3": k3.item()}
        result["variants"][name] = row
        print(f"{name:36s} {row['mean_abs']:12.5f} {row['max_abs']:12.5f} {row['seq_mean_abs']:18.5f} "
              f"{row['kl_k3']:10.2e}")
    print("BENCH_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
