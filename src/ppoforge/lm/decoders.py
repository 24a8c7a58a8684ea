"""The two decoders the sampler can drive: prefill the prompts, then one token per step, KV-cached.

- `LlamaDecoder`: a lean forward for the Llama family (Llama, Qwen2 — SmolLM2 and Qwen2.5 included).
  Their block is the same: RMSNorm -> q, k, v (Qwen2: with bias) -> RoPE -> grouped-query attention ->
  o -> residual -> RMSNorm -> SwiGLU MLP -> residual. We read the weights once per rollout and run
  ~25 tensor ops per layer and token on a static KV cache, against roughly twice the per-token time
  through Hugging Face's module stack (decorators, output dataclasses, cache objects); at small model
  sizes that overhead, not arithmetic, is the decode time. RoPE comes from the model's own
  `rotary_emb` module, so every rope scaling type it supports is reproduced exactly.
- `HFDecoder`: the model's own forward with a `DynamicCache` and our 4D masks, for any other model.

Both read the same masks and positions (`attention.py`), so their log-probs agree with the trainer's
full forward to fp32 rounding. Each call returns the last position's logits and, where the decoder has
it for free (LlamaDecoder), its final hidden state: what a value head on the policy's trunk reads.
`linear_params` lets a caller substitute effective weights (the LoRA layout passes base + adapter,
merged once per rollout) without touching the model.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import LlamaModel

from ppoforge.lm.attention import as_attention_bias, causal_mask, position_ids

# transformers renamed `past_key_values` to `cache` in 5.x; pass whichever this version takes.
CACHE_KWARG = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"
LLAMA_FAMILY = ("llama", "qwen2")

LinearParams = Callable[[nn.Module], tuple[torch.Tensor, torch.Tensor | None]]


Output = tuple[torch.Tensor, torch.Tensor | None]  # (B, V) logits, (B, H) final hidden state or None


class Decoder(Protocol):
    def prefill(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, max_new_tokens: int
                ) -> Output: ...  # after the last prompt token

    def step(self, tokens: torch.Tensor, t: int) -> Output: ...  # after feeding response token t (B,)


def plain_linear_params(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    return module.weight, module.bias


def is_llama_family(config) -> bool:
    """Llama or Qwen2 with full attention in every layer and a SiLU MLP (what LlamaDecoder implements)."""
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    return (config.model_type in LLAMA_FAMILY and config.hidden_act == "silu"
            and all(t == "full_attention" for t in layer_types))


class HFDecoder:
    """The model's own forward: works for any Hugging Face causal LM."""

    def __init__(self, model: nn.Module):
        self.model = model

    def _logits(self, ids, attn, pos):
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1,
                         **{CACHE_KWARG: self.cache})
        return out.logits[:, -1], None

    def prefill(self, prompt_ids, prompt_mask, max_new_tokens):
        batch, self.n_prompt = prompt_ids.shape
        keys = torch.cat([prompt_mask.bool(), prompt_mask.new_ones(batch, max_new_tokens, dtype=torch.bool)], 1)
        self.step_bias = as_attention_bias(keys[:, None, None, :], self.model)  # (B, 1, 1, P + T), sliced per step
        pos = position_ids(prompt_mask)
        self.next_pos = pos[:, -1:] + 1  # left padding puts every row's last real token at the end
        self.cache = DynamicCache(config=self.model.config)
        return self._logits(prompt_ids, as_attention_bias(causal_mask(prompt_mask), self.model), pos)

    def step(self, tokens, t):
        return self._logits(tokens[:, None], self.step_bias[..., :self.n_prompt + t + 1], self.next_pos + t)


class _Layer:
    """One decoder block's tensors."""

    def __init__(self, block: nn.Module, linear_params: LinearParams):
        attn, mlp = block.self_attn, block.mlp
        self.q, self.k, self.v, self.o = (linear_params(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj,
                                                                      attn.o_proj))  # (weight, bias)
        self.gate, self.up, self.down = (linear_params(m) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
        self.norm1, self.norm2 = block.input_layernorm.weight, block.post_attention_layernorm.weight


LINEARS = ("qkv", "o", "gate_up", "down")  # after _prepare_weights: q, k, v and gate, up stacked


def _concat(*params: tuple[torch.Tensor, torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stack (weight, bias) pairs along the output dim: one matmul computes all of them."""
    weight = torch.cat([w for w, _ in params])
    if all(b is None for _, b in params):
        return weight, None
    return weight, torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in params])


_ONEDNN_PACKING = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear for a weight prepacked by mkldnn._reorder_linear_weight (the op inductor's CPU freezing uses)."""
    return torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), weight, bias, "none", [], "")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaDecoder:
    """Lean KV-cached forward of a Llama-family causal LM (see the module docstring)."""

    def __init__(self, model: nn.Module, linear_params: LinearParams = plain_linear_params):
        cfg, backbone = model.config, model.base_model
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps, self.hidden = cfg.rms_norm_eps, cfg.hidden_size
        self.embed = model.get_input_embeddings().weight
        self.head = linear_params(model.get_output_embeddings())
        self.rotary = backbone.rotary_emb
        self.final_norm = backbone.norm.weight
        self.layers = [_Layer(block, linear_params) for block in backbone.layers]
        self._cast_dtype = None  # the dtype the linear weights were prepared in (see _prepare_weights)
        self.linear = F.linear  # (x, weight, bias) -> x @ weight.T + bias; packed for oneDNN on CPU bf16

    def _prepare_weights(self, dtype: torch.dtype, device: torch.device) -> None:
        """Once per decoder (i.e. per rollout), before the first token:
        - under autocast, cast the linear weights to its dtype here instead of in every step's F.linear
          (autocast re-casts on every call outside one region; same values as its own cast);
        - stack q, k, v and gate, up: 4 matmuls per layer and token instead of 7;
        - on CPU in bf16, also reorder them into oneDNN's blocked layout. Decoding a few rows streams every
          weight from memory once per token, and plain F.linear repacks it on each call: prepacked, the
          decode's matmuls run ~1.5x faster here, with bit-identical results (tested)."""
        if self._cast_dtype is not None:  # the per-layer q, k, v, gate, up are gone once stacked
            if self._cast_dtype != dtype:
                raise RuntimeError(f"this decoder's weights are {self._cast_dtype}; build a new one for {dtype}")
            return
        cast = lambda wb: tuple(None if t is None else t.to(dtype) for t in wb)  # noqa: E731
        for layer in self.layers:
            # fuse after the cast: the fp32 originals are never copied
            layer.qkv = _concat(cast(layer.q), cast(layer.k), cast(layer.v))
            layer.gate_up = _concat(cast(layer.gate), cast(layer.up))
            layer.o, layer.down = cast(layer.o), cast(layer.down)
            del layer.q, layer.k, layer.v, layer.gate, layer.up
        self.head, self._cast_dtype = cast(self.head), dtype
        if device.type == "cpu" and dtype == torch.bfloat16 and _ONEDNN_PACKING:
            pack = lambda wb: (torch.ops.mkldnn._reorder_linear_weight(wb[0].contiguous(), 8), wb[1])  # noqa: E731
            for layer in self.layers:
                for name in LINEARS:
                    setattr(layer, name, pack(getattr(layer, name)))
            self.head, self.linear = pack(self.head), _packed_linear

    def _norm(self, x, weight):
        return F.rms_norm(x, (self.hidden,), weight, self.eps)

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q (B, heads, S, hd), k and v (B, kv heads, L, hd), bool mask (B, 1, S, L) -> (B, heads, S, hd)."""
        if q.shape[2] > 1:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_heads != self.n_kv)
        # One query per row: three small ops beat SDPA's flash kernel (~5x on CPU). Grouped-query
        # attention by folding each kv head's query heads into the query-length dim.
        batch, group = q.shape[0], self.n_heads // self.n_kv
        q = q.reshape(batch, self.n_kv, group, self.head_dim)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.head_dim ** -0.5  # (B, kv heads, group, L)
        probs = torch.softmax(torch.where(mask, scores, float("-inf")), dim=-1, dtype=torch.float32)
        return torch.matmul(probs.to(v.dtype), v).reshape(batch, self.n_heads, 1, self.head_dim)

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: int,
                 attn_mask: torch.Tensor) -> Output:
        """x (B, S, H) at cache slots [start, start + S) -> logits (B, V) and final hidden (B, H) of the
        last position."""
        batch, n, end = x.shape[0], x.shape[1], start + x.shape[1]
        cos, sin = cos[:, None], sin[:, None]  # (B, 1, S, hd)
        x = x.reshape(batch * n, -1)  # 2D activations: F.linear is then one fused addmm, not matmul + add
        linear = self.linear
        for layer, k_cache, v_cache in zip(self.layers, self.k_cache, self.v_cache, strict=True):
            h = self._norm(x, layer.norm1)
            qkv = linear(h, *layer.qkv).view(batch, n, self.n_heads + 2 * self.n_kv, self.head_dim)
            qk = qkv[:, :, :self.n_heads + self.n_kv].transpose(1, 2)  # (B, heads + kv heads, S, hd): one RoPE
            qk = qk * cos + _rotate_half(qk) * sin
            k_cache[:, :, start:end] = qk[:, self.n_heads:]
            v_cache[:, :, start:end] = qkv[:, :, self.n_heads + self.n_kv:].transpose(1, 2)
            o = self._attention(qk[:, :self.n_heads], k_cache[:, :, :end], v_cache[:, :, :end], attn_mask)
            x = x + linear(o.transpose(1, 2).reshape(batch * n, -1), *layer.o)
            h = self._norm(x, layer.norm2)
            gate, up = linear(h, *layer.gate_up).chunk(2, dim=-1)
            x = x + linear(F.silu(gate) * up, *layer.down)
        hidden = self._norm(x.view(batch, n, -1)[:, -1], self.final_norm)
        return linear(hidden, *self.head), hidden

    def prefill(self, prompt_ids, prompt_mask, max_new_tokens):
        batch, self.n_prompt = prompt_ids.shape
        total = self.n_prompt + max_new_tokens
        x = F.embedding(prompt_ids, self.embed)
        shape = (batch, self.n_kv, total, self.head_dim)
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        self._prepare_weights(dtype, x.device)
        self.k_cache = [x.new_zeros(shape, dtype=dtype) for _ in self.layers]
        self.v_cache = [x.new_zeros(shape, dtype=dtype) for _ in self.layers]
        keys = torch.cat([prompt_mask.bool(), prompt_mask.new_ones(batch, max_new_tokens, dtype=torch.bool)], 1)
        self.step_mask = keys[:, None, None, :]  # (B, 1, 1, P + T), sliced per step
        pos = position_ids(prompt_mask)
        self.next_pos = pos[:, -1:] + 1
        cos, sin = self.rotary(x, pos)
        return self._forward(x, cos, sin, 0, causal_mask(prompt_mask))

    def step(self, tokens, t):
        x = F.embedding(tokens[:, None], self.embed)  # (B, 1, H)
        cos, sin = self.rotary(x, self.next_pos + t)
        slot = self.n_prompt + t
        return self._forward(x, cos, sin, slot, self.step_mask[..., :slot + 1])


def decoder_for(model: nn.Module, linear_params: LinearParams = plain_linear_params) -> Decoder:
    """LlamaDecoder when the model is of the Llama family, else HFDecoder."""
    if is_llama_family(model.config):
        return LlamaDecoder(model, linear_params)
    return HFDecoder(model)
