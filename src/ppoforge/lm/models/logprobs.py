"""Log-probabilities and entropies of chosen tokens, without a (B, T, V) fp32 log-softmax.

For temperature-scaled logits z = logits / tau: logp(x) = z_x - logsumexp(z) and H = -sum p log p.
Rows are processed in chunks, each upcast to fp32 on its own, so the fp32 working set is one chunk even
when the model's logits are bf16 and the vocabulary is 150k. A custom autograd Function recomputes the
softmax chunk by chunk in backward instead of letting autograd keep every fp32 chunk alive:

    d logp / d z_j = 1[j = x] - p_j          d H / d z_j = -p_j (log p_j + H)

The sampler (one decode step, (B, V)) and the trainer ((B, T, V)) both call `token_logprobs`, so the
log-prob stored at sampling time and the one recomputed in the update are the same function of the logits.

`head_logprobs` goes one step further back: where a batch's logits exceed two chunks, it applies the LM
head itself to `HEAD_CHUNK_ELEMENTS` worth of tokens at a time, and under autograd keeps only each
chunk's hidden states, recomputing its logits in backward (activation checkpointing of the head). At
SmolLM2's 49k vocabulary and 8 x 512 response tokens, the logits and their gradient are 1.6 GiB in
fp32; chunked they are a few hundred MiB.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

CHUNK_ELEMENTS = 1 << 24  # fp32 elements per chunk: 64 MiB of working memory
HEAD_CHUNK_ELEMENTS = 1 << 25  # logits per chunk of `head_logprobs`: 128 MiB in fp32


def scaled_log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature) in fp32 over the last dim: THE distribution of sampler and update."""
    z = logits.float()
    return torch.log_softmax(z / temperature if temperature != 1.0 else z, dim=-1)


def _rows_per_chunk(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // vocab)


class _TokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tokens, temperature, chunk):
        logp, entropy, lse = _forward_chunks(logits, tokens, temperature, chunk, with_entropy=True)
        ctx.save_for_backward(logits, tokens, lse, entropy)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        logits, tokens, lse, entropy = ctx.saved_tensors
        tau, chunk, n = ctx.temperature, ctx.chunk, logits.shape[0]
        # fold 1/tau (dz/dlogits) into the per-row output grads once: (N, 1) instead of (N, V) work
        gl = None if g_logp is None else (g_logp / tau)[:, None]
        ge = None if g_entropy is None else (g_entropy / tau)[:, None]
        grad = torch.empty_like(logits) if n > chunk else None
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            z = logits[s:e]  # a fresh fp32 tensor (never a view of the saved logits: edited in place below)
            log_p = (z.float() / tau if tau != 1.0 else z.to(torch.float32, copy=True)).sub_(lse[s:e, None])
            p = torch.exp(log_p)
            if ge is not None:  # -p (gl + ge (log p + H)), the entropy part from dH/dz = -p (log p + H)
                g = log_p.add_(entropy[s:e, None]).mul_(ge[s:e])
                g = (g.add_(gl[s:e]) if gl is not None else g).mul_(p).neg_()
            else:
                g = p.mul_(-gl[s:e])
            if gl is not None:
                g.scatter_add_(1, tokens[s:e, None], gl[s:e])
            if grad is None:
                return g.to(logits.dtype), None, None, None
            grad[s:e] = g
        return grad, None, None, None


def _forward_chunks(logits, tokens, temperature, chunk, with_entropy):
    """(logp, entropy, logsumexp) or (logp, None, None), (N,) fp32, chunk by chunk over the rows of (N, V)."""
    n = logits.shape[0]
    logp = torch.empty(n, dtype=torch.float32, device=logits.device)
    entropy = torch.empty_like(logp) if with_entropy else None
    lse = torch.empty_like(logp) if with_entropy else None
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        tok = tokens[s:e, None]
        log_p = scaled_log_softmax(logits[s:e], temperature)  # one fused op: ~2x faster than logsumexp on CPU
        logp[s:e] = log_p.gather(1, tok).squeeze(1)
        if with_entropy:  # -sum p log p: no cancellation when p is peaked
            entropy[s:e] = -(torch.exp(log_p) * log_p).sum(-1)
            # logsumexp(z) = z_x - log p(x), kept for backward
            lse[s:e] = logits[s:e].gather(1, tok).squeeze(1).float() / temperature - logp[s:e]
    return logp, entropy, lse


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, *,
                   entropy: bool = True, chunk_rows: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 log-prob of `tokens` and entropy (None unless asked) under softmax(logits / temperature).

    logits (..., V) in any float dtype, tokens (...) int64 -> (...) fp32 tensors, differentiable with
    respect to the logits when they require grad.
    """
    shape, vocab = tokens.shape, logits.shape[-1]
    chunk = chunk_rows or _rows_per_chunk(vocab)
    flat_logits, flat_tokens = logits.reshape(-1, vocab), tokens.reshape(-1)
    if torch.is_grad_enabled() and logits.requires_grad:
        logp, ent = _TokenLogProbs.apply(flat_logits, flat_tokens, float(temperature), chunk)
        return logp.view(shape), (ent.view(shape) if entropy else None)
    logp, ent, _ = _forward_chunks(flat_logits, flat_tokens, float(temperature), chunk, entropy)
    return logp.view(shape), (ent.view(shape) if entropy else None)


def head_logprobs(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, tokens: torch.Tensor,
                  vocab: int, temperature: float = 1.0, *, entropy: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs(head(hidden), tokens)`, the head applied to chunks of the flattened tokens.

    hidden (..., H), tokens (...), `vocab` the head's output size -> (...) fp32 tensors. Where the logits
    fit in two chunks this is exactly `token_logprobs(head(hidden), ...)`. Larger, each chunk runs alone;
    with grad enabled it is checkpointed, so backward recomputes its logits (the same kernels on the same
    rows: the same numbers) instead of autograd keeping every chunk's logits and their gradient alive —
    at the price of one more head GEMM (measured: ≤ 4 % of a 512-token GRPO step, for 1.5 GiB less).
    Two calls on the same shapes chunk alike, so a no-grad pass and a training pass agree bit for bit.
    """
    shape = tokens.shape
    flat_hidden, flat_tokens = hidden.reshape(-1, hidden.shape[-1]), tokens.reshape(-1)
    n, step = flat_tokens.numel(), max(1, HEAD_CHUNK_ELEMENTS // vocab)

    def chunk(h: torch.Tensor, t: torch.Tensor):
        return token_logprobs(head(h), t, temperature, entropy=entropy)

    if n <= 2 * step:  # small enough to keep: no recomputation (it costs one more head GEMM in backward)
        logp, ent = chunk(flat_hidden, flat_tokens)
    else:
        grad = torch.is_grad_enabled()
        parts = [checkpoint(chunk, flat_hidden[s:s + step], flat_tokens[s:s + step], use_reentrant=False)
                 if grad else chunk(flat_hidden[s:s + step], flat_tokens[s:s + step]) for s in range(0, n, step)]
        logp = torch.cat([p[0] for p in parts])
        ent = torch.cat([p[1] for p in parts]) if entropy else None
    return logp.view(shape), (ent.view(shape) if entropy else None)
