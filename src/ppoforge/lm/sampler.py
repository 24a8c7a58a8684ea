"""Batched sampling with a KV cache: our own decode loop over a Hugging Face causal LM.

Why not `model.generate`: for small models a PPO update is dominated by per-token framework overhead,
and generate's logits processors, stopping criteria and 2D-mask rebuilding cost more than the model.
This loop keeps one preallocated output buffer, one precomputed attention mask sliced per step, no
Python lists of tensors and one host sync per step (the "all finished?" check, free on CPU).

Log-probs are those of the sampled tokens under softmax(logits / temperature) — the same scaling the
PPO update uses (`token_logprobs`). With top-k / top-p the token is drawn from the truncated
distribution but its log-prob is still the untruncated one's, as in TRL; leave both off for exact
on-policy ratios.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import LlamaModel

from ppoforge.lm.attention import as_attention_bias, causal_mask, position_ids
from ppoforge.lm.logprobs import token_logprobs

# transformers renamed `past_key_values` to `cache` in 5.x; pass whichever this version takes.
CACHE_KWARG = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0            # 0 = off
    top_p: float = 1.0        # 1 = off
    stop_ids: tuple[int, ...] = ()
    pad_id: int = 0


@dataclass
class Samples:
    response_ids: torch.Tensor   # (B, T) int64, right-padded with pad_id; T <= max_new_tokens
    response_mask: torch.Tensor  # (B, T) float32: 1 up to and including the first stop token, 0 after
    logp: torch.Tensor           # (B, T) fp32 log-prob under softmax(logits / temperature); 0 on padding
    finished: torch.Tensor       # (B,) bool: the response ended with a stop token (else it ran out)


def filter_logits(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / nucleus (top-p) set to -inf; z is (B, V)."""
    if top_k and top_k < z.shape[-1]:
        kth = z.topk(top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        sorted_z, order = z.sort(dim=-1, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        # drop a token once the tokens ranked above it already hold top_p of the mass (keeps the first)
        drop = (probs.cumsum(-1) - probs) > top_p
        z = z.scatter(-1, order, sorted_z.masked_fill(drop, float("-inf")))
    return z


def _draw(logits: torch.Tensor, params: SamplingParams, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row by inverting the CDF at u (B,) ~ U[0, 1), and its log-prob.

    Inversion needs B random numbers per step where Gumbel-max or torch.multinomial need B * V, and
    CPU random number generation costs more than the cumsum.
    """
    z = filter_logits(logits.float() / params.temperature, params.top_k, params.top_p)
    cdf = torch.softmax(z, dim=-1).cumsum_(-1)  # (B, V)
    # right=True skips zero-probability (filtered) tokens even at u = 0
    tok = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
    tok = tok.clamp_(max=z.shape[-1] - 1)
    logp, _ = token_logprobs(logits, tok, params.temperature, entropy=False)
    return tok, logp


def _last_logits(model, ids, attn, pos, cache) -> torch.Tensor:
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1,
                **{CACHE_KWARG: cache})
    return out.logits[:, -1]


@torch.inference_mode()
def sample(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None = None) -> Samples:
    """Sample up to max_new_tokens per left-padded prompt (B, P); stops early once every row has stopped.

    Run it under the caller's autocast; the model should be in eval mode. Rows that stopped keep being
    fed `pad_id` (their outputs are discarded), so shapes stay static for the whole loop.
    """
    batch, n_prompt = prompt_ids.shape
    n_new, dev = params.max_new_tokens, prompt_ids.device
    keys = torch.cat([prompt_mask.bool(), torch.ones(batch, n_new, dtype=torch.bool, device=dev)], 1)
    step_bias = as_attention_bias(keys[:, None, None, :], model)  # (B, 1, 1, P + T), sliced per step
    pos = position_ids(prompt_mask)
    cache = DynamicCache(config=model.config)
    logits = _last_logits(model, prompt_ids, as_attention_bias(causal_mask(prompt_mask), model), pos, cache)
    next_pos = pos[:, -1:] + 1  # (B, 1): left padding puts every row's last real token at the end

    ids = torch.full((batch, n_new), params.pad_id, dtype=torch.long, device=dev)
    logp = torch.zeros(batch, n_new, dtype=torch.float32, device=dev)
    mask = torch.zeros(batch, n_new, dtype=torch.float32, device=dev)
    alive = torch.ones(batch, dtype=torch.bool, device=dev)
    stop = torch.tensor(params.stop_ids, dtype=torch.long, device=dev)
    pad = torch.full_like(alive, params.pad_id, dtype=torch.long)
    uniforms = torch.rand(n_new, batch, generator=generator, device=dev)  # one draw per row and step
    for t in range(n_new):
        tok, tok_logp = _draw(logits, params, uniforms[t])
        tok = torch.where(alive, tok, pad)
        ids[:, t] = tok
        logp[:, t] = torch.where(alive, tok_logp, 0.0)
        mask[:, t] = alive
        alive &= ~torch.isin(tok, stop)
        if t + 1 == n_new or not alive.any():
            break
        logits = _last_logits(model, tok[:, None], step_bias[..., :n_prompt + t + 1], next_pos + t, cache)
    n = t + 1
    return Samples(ids[:, :n], mask[:, :n], logp[:, :n], ~alive)
