"""Batched sampling with a KV cache: our own decode loop over a `Decoder` (see decoders.py).

Why not `model.generate`: for small models a PPO update is dominated by per-token framework overhead,
and generate's logits processors, stopping criteria and 2D-mask rebuilding cost more than the model.
This loop keeps preallocated outputs, no Python lists of tensors, B random numbers per step, and one
host sync per step (the "all stopped?" check, free on CPU).

Log-probs are those of the sampled tokens under softmax(logits / temperature) — the same scaling the
PPO update uses (`token_logprobs`). With top-k / top-p the token is drawn from the truncated
distribution but its log-prob is the untruncated one's, which is what the update recomputes; TRL's
PPOTrainer stored the truncated (processed) scores' log-probs instead. Either way the sampling
distribution is not the one the update optimizes: leave both off for exact on-policy ratios.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ppoforge.lm.models.decoders import Decoder, decoder_for
from ppoforge.lm.models.logprobs import scaled_log_softmax


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
    hidden: torch.Tensor | None = None  # (B, T, H) final hidden state before each response token, when
    #                                     the decoder has it: a value head on the policy's trunk reads it
    token_mask: torch.Tensor | None = None  # (B, T) float: every real token, where that is more than the
    #                                         policy's (multi-turn episodes: lm/envs/episodes.py); None: response_mask

    @property
    def attended(self) -> torch.Tensor:
        """(B, T) the response's real tokens: what the model attends to."""
        return self.response_mask if self.token_mask is None else self.token_mask


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


def draw_tokens(logits: torch.Tensor, params: SamplingParams, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row by inverting the CDF at u (B,) ~ U[0, 1), and its log-prob (the decode step of
    `sample` and of multi-turn episodes, `lm/envs/episodes.py`).

    Inversion needs B random numbers per step where Gumbel-max or torch.multinomial need B * V, and
    CPU random number generation costs more than the cumsum. The CDF is accumulated in float64 and u
    compared in float64: in an fp32 CDF a token's share is the difference of two fp32 sums, so past the
    0.5 mark every token below half an ulp (3e-8) had none and was never drawn (a 152k vocabulary: 3e-4
    of the mass). The probabilities are the fp32 exp of the returned log-probs, the law the update uses.
    """
    logp_all = scaled_log_softmax(logits, params.temperature)  # (B, V) fp32, the trainer's distribution
    if params.top_k or params.top_p < 1.0:
        probs = torch.softmax(filter_logits(logp_all, params.top_k, params.top_p), dim=-1)
    else:
        probs = logp_all.exp()
    cdf = probs.double().cumsum_(-1)  # (B, V) float64: 2^-53 resolution, every fp32 probability > 0 has its share
    total = cdf[:, -1:].contiguous()  # (B, 1)
    # right=True skips zero-probability (filtered) tokens even at u = 0; u * total rounded up to the total
    # (u within 2^-53 of 1) goes to the last token with mass, not past it to a filtered one
    tok = torch.searchsorted(cdf, u.double()[:, None] * total, right=True)
    tok = torch.minimum(tok, torch.searchsorted(cdf, total))
    return tok.squeeze(1), logp_all.gather(1, tok).squeeze(1)


def draw_uniforms(params: SamplingParams, batch: int, generator: torch.Generator | None = None, turns: int = 1
                  ) -> torch.Tensor:
    """The (turns * max_new_tokens, B) uniforms a batch's sampling consumes: one per row, turn and step (turn
    k's step t is row k * max_new_tokens + t; one turn for `sample`, `max_turns` for episodes). Drawn up
    front, so sampling the batch in parts (`sample(..., uniforms=part)`) makes exactly the same draws.
    float64, as the CDF they invert: an fp32 uniform's 2^-24 grid would draw a token of p < 6e-8 at a
    quantized rate (0 or 6e-8) instead of its own (tested at p = 1e-8)."""
    device = generator.device if generator is not None else "cpu"
    return torch.rand(turns * params.max_new_tokens, batch, generator=generator, device=device, dtype=torch.float64)


@torch.inference_mode()
def sample(model: nn.Module | Decoder, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None = None, uniforms: torch.Tensor | None = None, share_prefill: bool = False
           ) -> Samples:
    """Sample up to max_new_tokens per left-padded prompt (B, P); stops early once every row has stopped.

    `model` is a Hugging Face causal LM in eval mode (wrapped by `decoder_for`) or a ready Decoder. Run
    it under the caller's autocast. A row that stopped keeps sampling (its tokens are fed back and then
    discarded), so the loop body stays a handful of ops; masks and padding are applied once at the end.
    `uniforms` (max_new_tokens, B), from `draw_uniforms`, replaces drawing them from `generator`.
    `share_prefill`: where the rows come in runs of n > 1 copies of one prompt (GRPO's completions, a
    held-out prompt's samples), each prompt is prefilled once and its KV cache repeated (`Decoder.repeat`).
    """
    decoder = decoder_for(model) if isinstance(model, nn.Module) else model
    batch, n_new, dev = prompt_ids.shape[0], params.max_new_tokens, prompt_ids.device
    logits, hidden = prefill(decoder, prompt_ids, prompt_mask, n_new, share_prefill)
    ids = torch.empty(batch, n_new, dtype=torch.long, device=dev)
    logp = torch.empty(batch, n_new, dtype=torch.float32, device=dev)
    hiddens = None if hidden is None else hidden.new_empty(batch, n_new, hidden.shape[-1])
    alive = torch.ones(batch, dtype=torch.bool, device=dev)
    stop = torch.tensor(params.stop_ids, dtype=torch.long, device=dev)
    if uniforms is None:
        uniforms = draw_uniforms(params, batch, generator)
    uniforms = uniforms.to(dev)
    for t in range(n_new):
        tok, logp[:, t] = draw_tokens(logits, params, uniforms[t])
        ids[:, t] = tok
        if hiddens is not None:
            hiddens[:, t] = hidden
        alive &= ~torch.isin(tok, stop)
        if t + 1 == n_new or not alive.any():
            break
        logits, hidden = decoder.step(tok, t)
    ids, logp = ids[:, :t + 1], logp[:, :t + 1]
    is_stop = torch.isin(ids, stop)
    mask = (is_stop.cumsum(1) - is_stop.long()) == 0  # no stop token strictly before t
    return Samples(ids.masked_fill(~mask, params.pad_id), mask.float(), logp * mask, ~alive,
                   None if hiddens is None else hiddens[:, :t + 1])


def prefill(decoder: Decoder, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, capacity: int,
            share: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`decoder.prefill`; with `share`, rows in runs of n > 1 equal prompts prefill one copy of each and
    repeat its KV cache (`Decoder.repeat`): the same (logits, hidden) of every row, to rounding."""
    repeats = run_length(prompt_ids, prompt_mask) if share else 1
    if repeats == 1:
        return decoder.prefill(prompt_ids, prompt_mask, capacity)
    logits, hidden = decoder.prefill(prompt_ids[::repeats], prompt_mask[::repeats], capacity)
    decoder.repeat(repeats)
    return tuple(None if x is None else x.repeat_interleave(repeats, 0) for x in (logits, hidden))


def run_length(ids: torch.Tensor, mask: torch.Tensor) -> int:
    """n when the rows come in runs of n equal rows (ids and mask), every run as long; else 1."""
    same = (ids[1:] == ids[:-1]).all(1) & (mask[1:] == mask[:-1]).all(1)  # (B - 1,) row i + 1 repeats row i
    starts = torch.cat([same.new_ones(1), ~same]).nonzero().flatten()
    lengths = torch.diff(starts, append=starts.new_full((1,), ids.shape[0]))
    return int(lengths[0]) if bool((lengths == lengths[0]).all()) else 1


def concat_samples(parts: list[Samples], pad_id: int) -> Samples:
    """Samples of consecutive row ranges as one batch, right-padded to the longest part's length."""
    if len(parts) == 1:
        return parts[0]
    width = max(p.response_ids.shape[1] for p in parts)

    def cat(name: str, fill) -> torch.Tensor:
        pads = []
        for p in parts:
            x = getattr(p, name)
            extra = width - x.shape[1]
            pads.append(torch.cat([x, x.new_full((x.shape[0], extra, *x.shape[2:]), fill)], 1) if extra else x)
        return torch.cat(pads)

    hidden = None if parts[0].hidden is None else cat("hidden", 0)
    return Samples(cat("response_ids", pad_id), cat("response_mask", 0), cat("logp", 0),
                   torch.cat([p.finished for p in parts]), hidden)
