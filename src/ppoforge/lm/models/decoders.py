"""The two decoders the sampler can drive: prefill the prompts, then one token per step, KV-cached.

- `LlamaDecoder`: a lean forward for the Llama family (Llama, Qwen2 — SmolLM2 and Qwen2.5 included).
  Their block is the same: RMSNorm -> q, k, v (Qwen2: with bias) -> RoPE -> grouped-query attention ->
  o -> residual -> RMSNorm -> SwiGLU MLP -> residual. We read the weights once per rollout and run
  ~25 tensor ops per layer and token on a static KV cache, against roughly twice the per-token time
  through Hugging Face's module stack (decorators, output dataclasses, cache objects); at small model
  sizes that overhead, not arithmetic, is the decode time. RoPE comes from the model's own
  `rotary_emb` module, so every rope scaling type it supports is reproduced exactly.
- `HFDecoder`: the model's own forward with a `DynamicCache` and our 4D masks, for any other model (and
  a windowed one: sliding-window or chunked layers, see `windows.py`).

Both read the same masks and positions (`attention.py`), so their log-probs agree with the trainer's
full forward to fp32 rounding; LlamaDecoder also computes norms and eager attention as Hugging Face
does, so under bf16 it equals the trainer's eager forward bit for bit. Each call returns the last
position's logits and, where the decoder has it for free (LlamaDecoder), its final hidden state: what a
value head on the policy's trunk reads. `LlamaDecoder.base_hidden` runs whole sequences through the
same prepared weights with the adapters off: the LoRA layout's reference pass.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import LlamaModel

from ppoforge.lm.models import prepared
from ppoforge.lm.models.attention import as_attention_bias, causal_mask, chunk_attention, position_ids
from ppoforge.lm.models.parts import head_computes_in_fp32
from ppoforge.lm.models.rows import TokenRows
from ppoforge.lm.models.windows import attention_window

# transformers renamed `past_key_values` to `cache` in 5.x; pass whichever this version takes.
CACHE_KWARG = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"
LLAMA_FAMILY = ("llama", "qwen2")

LinearParams = Callable[[nn.Module], tuple[torch.Tensor, torch.Tensor | None]]
# (A (r, in), B (out, r), scaling) of the adapter active on a Linear, or None: y = base(x) + B(A(x)) * scaling
AdapterParams = Callable[[nn.Module], tuple[torch.Tensor, torch.Tensor, float] | None]


Output = tuple[torch.Tensor, torch.Tensor | None]  # (B, V) logits, (B, H) final hidden state or None


class Decoder(Protocol):
    def prefill(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, max_new_tokens: int
                ) -> Output: ...  # after the last prompt token

    def step(self, tokens: torch.Tensor, t: int) -> Output: ...  # after feeding response token t (B,)

    def extend(self, ids: torch.Tensor, valid: torch.Tensor) -> Output: ...  # after a (B, S) chunk, holes allowed

    def repeat(self, n: int) -> None: ...  # after prefill: every row becomes n rows (one prefill, n completions)


def plain_linear_params(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    return module.weight, module.bias


def no_adapters(module: nn.Module) -> None:
    return None


def is_llama_family(config) -> bool:
    """Llama or Qwen2 with full attention in every layer and a SiLU MLP (what LlamaDecoder implements)."""
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    return (config.model_type in LLAMA_FAMILY and config.hidden_act == "silu"
            and all(t == "full_attention" for t in layer_types))


class HFDecoder:
    """The model's own forward: works for any Hugging Face causal LM.

    It reads our 4D masks, which index every cache slot, so its cache keeps every slot: a windowed model's
    own cache (`DynamicCache(config=...)`) keeps a sliding layer's last W - 1 keys alone, which no longer
    matched the mask past the window (a crash). Those masks make a windowed model exact while each row's
    real tokens fit its window (`windows.py`), as in every other forward of a run. `own_masks` hands the
    model 2D key masks instead, so it builds each layer's mask itself, windows included, over its own cache:
    what `generate` does, exact at any length for rows without holes (SFT's samples, not `extend`'s turns).
    """

    def __init__(self, model: nn.Module, own_masks: bool = False):
        self.model, self.own_masks = model, own_masks
        self.windowed = attention_window(model.config) is not None

    def _logits(self, ids, attn, pos):
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1,
                         **{CACHE_KWARG: self.cache})
        return out.logits[:, -1], None

    def prefill(self, prompt_ids, prompt_mask, max_new_tokens):
        batch, self.n_prompt = prompt_ids.shape
        self.keys = torch.cat([prompt_mask.bool(), prompt_mask.new_ones(batch, max_new_tokens, dtype=torch.bool)], 1)
        self.step_bias = as_attention_bias(self.keys[:, None, None, :], self.model)  # (B, 1, 1, P + T), per step
        pos = position_ids(prompt_mask)
        self.next_pos = pos[:, -1:] + 1  # left padding puts every row's last real token at the end
        self.filled = self.n_prompt  # cache slots written (by prefill and `extend`; `step` counts in t)
        every_slot = self.windowed and not self.own_masks
        self.cache = DynamicCache() if every_slot else DynamicCache(config=self.model.config)
        attn = self.keys[:, :self.n_prompt] if self.own_masks else as_attention_bias(causal_mask(prompt_mask),
                                                                                     self.model)
        return self._logits(prompt_ids, attn, pos)

    def step(self, tokens, t):
        n = self.n_prompt + t + 1
        return self._logits(tokens[:, None], self.keys[:, :n] if self.own_masks else self.step_bias[..., :n],
                            self.next_pos + t)

    def extend(self, ids, valid):
        """Append a (B, S) chunk whose `valid` (B, S) bool marks each row's real tokens; the holes take
        cache slots no later query attends to, and positions count real tokens only (see LlamaDecoder)."""
        allowed, offsets = chunk_attention(self.keys, valid, self.filled)
        self.filled += ids.shape[1]
        pos = (self.next_pos + offsets).clamp(min=0)
        self.next_pos = self.next_pos + valid.sum(1, keepdim=True)
        attn = self.keys[:, :self.filled] if self.own_masks else as_attention_bias(allowed, self.model)
        return self._logits(ids, attn, pos)

    def repeat(self, n):
        self.cache.batch_repeat_interleave(n)
        self.keys, self.step_bias, self.next_pos = (x.repeat_interleave(n, 0)
                                                    for x in (self.keys, self.step_bias, self.next_pos))


class _Layer:
    """One decoder block's modules, grouped the way the decoder multiplies them (see LINEARS)."""

    def __init__(self, block: nn.Module):
        attn, mlp = block.self_attn, block.mlp
        self.modules = {"qkv": (attn.q_proj, attn.k_proj, attn.v_proj), "o": (attn.o_proj,),
                        "gate_up": (mlp.gate_proj, mlp.up_proj), "down": (mlp.down_proj,)}
        self.norm1, self.norm2 = block.input_layernorm.weight, block.post_attention_layernorm.weight


LINEARS = ("qkv", "o", "gate_up", "down")  # one matmul each per layer and token: q, k, v and gate, up stacked
_NO_ADAPTERS = dict.fromkeys(LINEARS)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaDecoder:
    """Lean KV-cached forward of a Llama-family causal LM (see the module docstring).

    `linear_params` gives each Linear's (weight, bias) — the LoRA layout passes the frozen base's —
    and `adapter_params` each Linear's LoRA adapter, applied unmerged as peft applies it, so under bf16
    the sampled log-probs equal the trainer's forward bit for bit (tested). Merging instead would round
    W + s * B @ A to bf16, which drops most of a young adapter's small delta: the sampler would draw
    from a policy closer to the base than the one being trained.
    """

    # read the weights unstacked where a stack would copy them (`_prepare_weights`); under autocast over fp32
    # weights the cast copy stays: recasting every token step would read each weight three times
    in_place = True

    def __init__(self, model: nn.Module, linear_params: LinearParams = plain_linear_params,
                 adapter_params: AdapterParams = no_adapters, share_frozen: bool = False):
        cfg, backbone = model.config, model.base_model
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.eager = getattr(cfg, "_attn_implementation", None) == "eager"  # else SDPA for the prefill
        self.embed = model.get_input_embeddings().weight
        self.head_module = model.get_output_embeddings()
        self.head_fp32 = head_computes_in_fp32(self.head_module)  # `lm_head_fp32`: as the module computes
        self.rotary = backbone.rotary_emb
        self.final_norm = backbone.norm.weight
        self.layers = [_Layer(block) for block in backbone.layers]
        self.linear_params, self.adapter_params = linear_params, adapter_params
        self._cast_dtype = None  # the dtype the linear weights were prepared in (see _prepare_weights)
        self.linear = F.linear  # (x, weight, bias) -> x @ weight.T + bias; packed for oneDNN on CPU
        # frozen weights in the compute dtype (the LoRA base): the stacked ones become the model's own storage
        self.share_frozen = share_frozen

    def _prepare_weights(self, dtype: torch.dtype, device: torch.device) -> None:
        """Once per decoder and dtype, before the first token (the LoRA layout keeps one decoder over
        its frozen base, so this runs once per run; the full layout builds one per rollout):
        - under autocast, cast the linear weights to its dtype here instead of in every step's F.linear
          (autocast re-casts on every call outside one region; same values as its own cast);
        - stack q, k, v and gate, up: 4 matmuls per layer and token instead of 7; with `share_frozen` (the
          LoRA base, frozen and already in the compute dtype) the model's own weights then become views of
          the stacks, so the decoder adds no copy (on CPU the oneDNN-packed stacks are a copy still); the
          full layout's, unpacked in their own dtype, are read in place (`in_place`: 7 matmuls, no copy);
        - on CPU, also reorder them into oneDNN's blocked layout (bf16 where the CPU can). Decoding a few
          rows streams every weight from memory once per token, and plain F.linear repacks it on each call:
          prepacked, the decode's matmuls run ~1.5x faster in bf16, with bit-identical results (tested), and
          1.4-2.5x in fp32 on an AVX2 EPYC (16 rows; oneDNN's kernels there, not MKL's: equal to rounding);
        - the LM head in fp32 when the model's head computes in fp32 (`parts.head_in_fp32`)."""
        if self._cast_dtype == dtype:
            return
        cast = lambda wb, dt=dtype: tuple(None if t is None else t.to(dt) for t in wb)  # noqa: E731
        packing = prepared.packs(dtype, device)
        views = (self.in_place and not packing and not self.share_frozen
                 and self.linear_params(self.layers[0].modules["qkv"][0])[0].dtype == dtype)
        for layer in self.layers:
            layer.out_features = {}
            for name in LINEARS:  # fuse after the cast: the fp32 originals are never copied
                originals = [self.linear_params(m) for m in layer.modules[name]]
                params = [cast(wb) for wb in originals]
                layer.out_features[name] = [w.shape[0] for w, _ in params]
                if views:  # the model's own tensors, unstacked (see above)
                    setattr(layer, name, (tuple(params), None))
                    continue
                share = (not packing and self.share_frozen
                         and all(c[0] is o[0] for c, o in zip(params, originals, strict=True)))
                # shared, the stack becomes the model's weights: a normal tensor even under the sampler's
                # inference mode, so the training forward can save it for backward
                with torch.inference_mode(False) if share else contextlib.nullcontext():
                    fused = prepared.concat_linears(*params)
                if packing:  # oneDNN's blocked layout is a second, reordered copy (CPU: the speed is worth it)
                    fused = prepared.pack(fused)
                elif share:
                    prepared.share_storage(originals, fused)  # one copy: the model reads views of the stack
                setattr(layer, name, fused)
        self.head_dtype = torch.float32 if self.head_fp32 else dtype
        head = cast(self.linear_params(self.head_module), self.head_dtype)
        self.head_out_features = [head[0].shape[0]]
        if prepared.packs(self.head_dtype, device):
            self.head, self.head_linear = prepared.pack(head), prepared.packed_linear
        else:
            self.head, self.head_linear = head, F.linear
        linear = prepared.packed_linear if packing else prepared.parts_linear if views else F.linear
        self.linear, self._cast_dtype = linear, dtype

    def _prepare_adapters(self, dtype: torch.dtype) -> None:
        """Every rollout (the adapters train): cast and stack each group's LoRA matrices."""
        for layer in self.layers:
            layer.adapters = {name: prepared.stack_adapters([self.adapter_params(m) for m in modules],
                                                            layer.out_features[name], dtype)
                              for name, modules in layer.modules.items()}
        self.head_adapter = prepared.stack_adapters([self.adapter_params(self.head_module)],
                                                    self.head_out_features, self.head_dtype)

    def _linear(self, x: torch.Tensor, weights: tuple, adapter, linear=None) -> torch.Tensor:
        """base(x) (+ B(A(x)) * scaling: peft's LoRA forward, op for op, so rounding matches it too)."""
        y = (linear or self.linear)(x, *weights)
        if adapter is None:
            return y
        a, b, scale = adapter
        u = F.linear(F.linear(x, a), b)
        if scale is None:  # folded into b
            return y + u
        return y + (u * scale if isinstance(scale, float) else (u.float() * scale).to(u.dtype))

    def _norm(self, x, weight):
        """Llama's RMSNorm exactly as Hugging Face computes it (fp32 statistics, rounded to the input's
        dtype before the weight multiplies): F.rms_norm rounds once, at the end, and under bf16 that
        alone moved sampled log-probs by ~0.05 nats per token against the trainer's forward."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * h.to(x.dtype)

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q (B, heads, S, hd), k and v (B, kv heads, L, hd), bool mask (B, 1, S, L) -> (B, heads, S, hd).

        Eager math (Hugging Face's eager attention, bit for bit) for single-query steps, where three
        small ops beat SDPA's flash kernel ~5x on CPU, and for the prefill when the model's own
        attention is eager; otherwise SDPA, like the model. Grouped-query attention by folding each kv
        head's query heads into the query-length dim.
        """
        batch, n = q.shape[0], q.shape[2]
        group = self.n_heads // self.n_kv
        if n > 1 and not self.eager:
            # kv heads repeated, as Hugging Face does whenever a mask is given: SDPA's enable_gqa path is
            # another kernel, which rounds differently on torch 2.6
            k, v = (t[:, :, None].expand(-1, -1, group, -1, -1).flatten(1, 2) for t in (k, v))
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        q = q.reshape(batch, self.n_kv, group * n, self.head_dim)
        scores = (torch.matmul(q, k.transpose(-1, -2)) * self.head_dim ** -0.5).view(batch, self.n_kv, group, n, -1)
        probs = torch.softmax(torch.where(mask[:, :, None], scores, float("-inf")), dim=-1, dtype=torch.float32)
        out = torch.matmul(probs.to(v.dtype).view(batch, self.n_kv, group * n, -1), v)  # (B, kv, group * S, hd)
        return out.view(batch, self.n_heads, n, self.head_dim)

    def _blocks(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: int,
                attn_mask: torch.Tensor, caches, adapters: bool = True) -> torch.Tensor:
        """x (B, S, H) at cache slots [start, start + S) -> the residual stream after the last block,
        (B * S, H). `caches` holds each layer's (k, v) cache; `adapters=False` runs the frozen base alone."""
        batch, n, end = x.shape[0], x.shape[1], start + x.shape[1]
        cos, sin = cos[:, None], sin[:, None]  # (B, 1, S, hd)
        x = x.reshape(batch * n, -1)  # 2D activations: F.linear is then one fused addmm, not matmul + add
        linear = self._linear
        for layer, (k_cache, v_cache) in zip(self.layers, caches, strict=True):
            adapters_of = layer.adapters if adapters else _NO_ADAPTERS
            h = self._norm(x, layer.norm1)
            qkv = linear(h, layer.qkv, adapters_of["qkv"]).view(batch, n, self.n_heads + 2 * self.n_kv, self.head_dim)
            qk = qkv[:, :, :self.n_heads + self.n_kv].transpose(1, 2)  # (B, heads + kv heads, S, hd): one RoPE
            qk = qk * cos + _rotate_half(qk) * sin
            k_cache[:, :, start:end] = qk[:, self.n_heads:]
            v_cache[:, :, start:end] = qkv[:, :, self.n_heads + self.n_kv:].transpose(1, 2)
            o = self._attention(qk[:, :self.n_heads], k_cache[:, :, :end], v_cache[:, :, :end], attn_mask)
            x = x + linear(o.transpose(1, 2).reshape(batch * n, -1), layer.o, adapters_of["o"])
            h = self._norm(x, layer.norm2)
            gate, up = linear(h, layer.gate_up, adapters_of["gate_up"]).chunk(2, dim=-1)
            x = x + linear(F.silu(gate) * up, layer.down, adapters_of["down"])
        return x

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: int,
                 attn_mask: torch.Tensor) -> Output:
        """x (B, S, H) at cache slots [start, start + S) -> logits (B, V) and final hidden (B, H) of the
        last position."""
        batch, n = x.shape[:2]
        x = self._blocks(x, cos, sin, start, attn_mask, self.caches)
        hidden = self._norm(x.view(batch, n, -1)[:, -1], self.final_norm)
        if not self.head_fp32:
            return self._linear(hidden, self.head, self.head_adapter, self.head_linear), hidden
        with torch.autocast(hidden.device.type, enabled=False):
            return self._linear(hidden.float(), self.head, self.head_adapter, self.head_linear), hidden

    def _embed_and_prepare(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        """Token embeddings, and the compute dtype (autocast's, else the weights') with the weights
        prepared for it."""
        x = F.embedding(ids, self.embed)
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        self._prepare_weights(dtype, x.device)
        return x, dtype

    def _new_caches(self, batch: int, length: int, dtype: torch.dtype, device: torch.device,
                    layers: int | None = None) -> list:
        """One (k, v) cache pair per layer (or `layers` pairs), (B, kv heads, length, hd) each."""
        shape = (batch, self.n_kv, length, self.head_dim)
        return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                for _ in range(len(self.layers) if layers is None else layers)]

    @torch.no_grad()
    def base_hidden(self, rows: TokenRows) -> torch.Tensor:
        """The frozen base's (adapters off) last hidden states (B, T, H) at the positions that predict the
        response tokens of `rows`: what `parts.response_hidden` returns for the base model, here through
        the weights the sampler prepared (the LoRA layout's reference pass)."""
        batch, n = rows.ids.shape
        x, dtype = self._embed_and_prepare(rows.ids)
        cos, sin = self.rotary(x, rows.positions)
        # every position in one pass: each layer writes all n slots before it reads them, so one (k, v) pair
        # serves every layer in turn and a layer's K/V is the only one alive
        caches = self._new_caches(batch, n, dtype, x.device, layers=1) * len(self.layers)
        x = self._blocks(x, cos, sin, 0, rows.allowed, caches, adapters=False)
        return rows.response(self._norm(x.view(batch, n, -1), self.final_norm))

    def prefill(self, prompt_ids, prompt_mask, max_new_tokens):
        batch, self.n_prompt = prompt_ids.shape
        x, dtype = self._embed_and_prepare(prompt_ids)
        self._prepare_adapters(dtype)
        self.caches = self._new_caches(batch, self.n_prompt + max_new_tokens, dtype, x.device)
        self.keys = torch.cat([prompt_mask.bool(), prompt_mask.new_ones(batch, max_new_tokens, dtype=torch.bool)], 1)
        self.step_mask = self.keys[:, None, None, :]  # (B, 1, 1, P + T), sliced per step
        pos = position_ids(prompt_mask)
        self.next_pos = pos[:, -1:] + 1
        self.filled = self.n_prompt  # cache slots written (by prefill and `extend`; `step` counts in t)
        cos, sin = self.rotary(x, pos)
        return self._forward(x, cos, sin, 0, causal_mask(prompt_mask))

    def step(self, tokens, t):
        x = F.embedding(tokens[:, None], self.embed)  # (B, 1, H)
        cos, sin = self.rotary(x, self.next_pos + t)
        slot = self.n_prompt + t
        return self._forward(x, cos, sin, slot, self.step_mask[..., :slot + 1])

    def extend(self, ids, valid):
        """Append a (B, S) chunk at the next cache slots: one decode step (S = 1) or an environment's reply
        (chunked prefill). `valid` (B, S) bool marks each row's real tokens — rows of a batch append
        different numbers (turns end at different lengths) — and the holes take slots that no later
        query attends to; positions count real tokens only, so a row's sequence is the one it would be
        alone, without holes. The slots `prefill(..., max_new_tokens)` reserved bound the chunks' total."""
        x = F.embedding(ids, self.embed)
        start = self.filled
        allowed, offsets = chunk_attention(self.keys, valid, start)
        self.filled += ids.shape[1]
        cos, sin = self.rotary(x, (self.next_pos + offsets).clamp(min=0))
        self.next_pos = self.next_pos + valid.sum(1, keepdim=True)
        return self._forward(x, cos, sin, start, allowed)

    def drop_cache(self) -> None:
        """Free the KV cache between rollouts (the prepared weights stay): at 8 rows x 670 positions it is
        a quarter GiB that would otherwise live on through the training passes. The next prefill makes a
        new one."""
        self.caches = self.keys = self.step_mask = None

    def repeat(self, n):
        self.caches = [(k.repeat_interleave(n, 0), v.repeat_interleave(n, 0)) for k, v in self.caches]
        self.keys, self.step_mask, self.next_pos = (x.repeat_interleave(n, 0)
                                                    for x in (self.keys, self.step_mask, self.next_pos))


def decoder_for(model: nn.Module) -> Decoder:
    """LlamaDecoder when the model is of the Llama family, else HFDecoder."""
    if is_llama_family(model.config):
        return LlamaDecoder(model)
    return HFDecoder(model)
