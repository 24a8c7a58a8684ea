"""Log-probabilities and entropies of chosen tokens, without a (B, T, V) fp32 log-softmax.

For temperature-scaled logits z = logits / tau: logp(x) = z_x - logsumexp(z) and H = -sum p log p.
Rows are processed in chunks, each upcast to fp32 on its own, so the fp32 working set is one chunk even
when the model's logits are bf16 and the vocabulary is 150k. A custom autograd Function recomputes the
softmax chunk by chunk in backward instead of letting autograd keep every fp32 chunk alive:

    d logp / d z_j = 1[j = x] - p_j          d H / d z_j = -p_j (log p_j + H)

The sampler (one decode step, (B, V)) and the trainer ((B, T, V)) both call `token_logprobs`, so the
log-prob stored at sampling time and the one recomputed in the update are the same function of the logits.
"""

from __future__ import annotations

import torch

CHUNK_ELEMENTS = 1 << 24  # fp32 elements per chunk: 64 MiB of working memory


def _rows_per_chunk(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // vocab)


class _TokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tokens, temperature, chunk):
        logp, entropy, lse = _forward_chunks(logits, tokens, temperature, chunk, with_entropy=True)
        ctx.save_for_backward(logits, tokens, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        logits, tokens, lse = ctx.saved_tensors
        tau, chunk = ctx.temperature, ctx.chunk
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], chunk):
            z = logits[s:s + chunk].float()
            if tau != 1.0:
                z = z / tau
            log_p = z - lse[s:s + chunk, None]
            p = torch.exp(log_p)
            g = torch.zeros_like(p)
            if g_logp is not None:
                gl = g_logp[s:s + chunk, None]
                g -= p * gl
                g.scatter_add_(1, tokens[s:s + chunk, None], gl)
            if g_entropy is not None:
                h = -(p * log_p).sum(-1, keepdim=True)
                g -= g_entropy[s:s + chunk, None] * p * (log_p + h)
            grad[s:s + chunk] = g / tau if tau != 1.0 else g
        return grad, None, None, None


def _forward_chunks(logits, tokens, temperature, chunk, with_entropy):
    """(logp, entropy or None, logsumexp), all (N,) fp32, chunk by chunk over the rows of (N, V) logits."""
    n = logits.shape[0]
    logp = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(logp)
    entropy = torch.empty_like(logp) if with_entropy else None
    for s in range(0, n, chunk):
        z = logits[s:s + chunk].float()
        if temperature != 1.0:
            z = z / temperature
        lse_c = torch.logsumexp(z, dim=-1)
        logp[s:s + chunk] = z.gather(1, tokens[s:s + chunk, None]).squeeze(1) - lse_c
        lse[s:s + chunk] = lse_c
        if with_entropy:
            log_p = z - lse_c[:, None]  # -sum p log p, not lse - sum p z: no cancellation when peaked
            entropy[s:s + chunk] = -(torch.exp(log_p) * log_p).sum(-1)
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
