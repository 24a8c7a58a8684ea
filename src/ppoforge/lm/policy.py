"""The two model layouts PPO can train: `lora` (default) and `full` (TRL's four models).

- `LoraLayout`: one frozen base model with peft LoRA adapters as the policy. The reference is the same
  base with the adapters switched off (`disable_adapter()`), so there is no second copy of the weights.
  The value head reads the policy's own last hidden states (one trunk pass gives logits and values, and
  the critic's gradients flow into the adapters), or, with `value_adapter`, a second LoRA adapter.
- `FullLayout`: every policy weight trains; a frozen copy is the reference and the critic is its own
  backbone copy (from the policy or from another checkpoint such as the reward model) with a value head.

Both run the backbone (`lm.base_model`) themselves and return the hidden states of the positions that
predict response tokens; the trainer applies the LM head (`logits`) to them in row chunks, so prompt
positions never cost a (P, V) projection and scoring never holds a (B, T, V) tensor. Everything stays in eval
mode — dropout is off, which PPO's ratio needs — and gradient checkpointing is switched on per decoder
layer without putting any module in training mode.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from functools import partial
from pathlib import Path
from typing import Protocol

import torch
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer
from torch import nn

from ppoforge.lm.attention import as_attention_bias, causal_mask, position_ids
from ppoforge.lm.decoders import Decoder, HFDecoder, LlamaDecoder, decoder_for, is_llama_family


class ValueHead(nn.Module):
    """Linear(hidden, 1) computed in fp32 on the last hidden states.

    Zero-initialized: the first values are 0 and, on a shared trunk, the first value-loss gradients
    reach the trunk (the policy's adapters) only as the head grows, instead of a random head's large
    error pushing the policy around (and inflating Adam's second moments) before it has learned anything.
    """

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, 1)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            return nn.functional.linear(hidden.float(), self.linear.weight, self.linear.bias).squeeze(-1)


def response_hidden(backbone: nn.Module, ids: torch.Tensor, mask: torch.Tensor, n_resp: int) -> torch.Tensor:
    """Last hidden states (B, T, H) at the positions that predict the T response tokens of (B, P + T)."""
    out = backbone(input_ids=ids, attention_mask=as_attention_bias(causal_mask(mask), backbone),
                   position_ids=position_ids(mask), use_cache=False)
    # contiguous: a strided 3D input makes matmul fall back to bmm over a (B, H, V) copy of the LM head
    return out.last_hidden_state[:, -n_resp - 1:-1].contiguous()


def enable_gradient_checkpointing(lm: nn.Module) -> None:
    """Recompute each decoder layer in backward. HF only checkpoints a layer whose own `training` flag is
    set, so we set that flag on the layer objects alone: their children stay in eval (no dropout)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lm.eval()
    for module in lm.modules():
        if isinstance(module, GradientCheckpointingLayer):
            module.training = True


def _base_linear_params(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of a Linear; for a LoRA Linear, its frozen base layer's."""
    base = module.get_base_layer() if isinstance(module, LoraLayer) else module
    return base.weight, base.bias


def _policy_adapter(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """(A, B, scaling) of the policy's adapter ("default") on a LoRA Linear, else None."""
    if not isinstance(module, LoraLayer) or "default" not in module.lora_A:
        return None
    return module.lora_A["default"].weight, module.lora_B["default"].weight, module.scaling["default"]


@contextlib.contextmanager
def merged_lora(peft_model: nn.Module, adapter: str = "default"):
    """Decode with base + adapter merged into temporary weights: one matmul per adapted layer instead of
    three, ~40% of a small model's decode step. Only for an fp32 base (in bf16 the merge's rounding
    swallows small adapter deltas). The base weight objects are swapped out and back, never modified,
    so the frozen base (and with it the reference) cannot drift by merge/unmerge rounding."""
    swaps = []
    with torch.no_grad():
        for module in peft_model.modules():
            if isinstance(module, LoraLayer) and adapter in module.lora_A:
                base = module.get_base_layer()
                merged = (base.weight.float() + module.get_delta_weight(adapter).float()).to(base.weight.dtype)
                swaps.append((base, base.weight, nn.Parameter(merged, requires_grad=False)))
    with peft_model.disable_adapter():
        for base, _, merged in swaps:
            base.weight = merged
        try:
            yield
        finally:
            for base, original, _ in swaps:
                base.weight = original


@contextlib.contextmanager
def _yielding(context, value):
    with context:
        yield value


def _freeze(module: nn.Module) -> nn.Module:
    module.requires_grad_(False)
    return module.eval()


class Layout(Protocol):
    """What the trainer needs from a model layout."""

    policy_model: nn.Module  # the policy as a Hugging Face causal LM (adapters injected in lora)

    def decoder(self) -> contextlib.AbstractContextManager[Decoder]: ...  # the policy, for the sampler

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, n_resp: int
                ) -> tuple[torch.Tensor, torch.Tensor]: ...  # policy hidden (B, T, H), values (B, T) fp32

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...  # policy LM head: (..., H) -> (..., V)

    def values(self, ids: torch.Tensor, mask: torch.Tensor, n_resp: int
               ) -> torch.Tensor: ...  # (B, T) fp32: the critic's pass alone

    def sampled_values(self, hidden: torch.Tensor) -> torch.Tensor | None: ...  # from the sampler's hidden
    #   states (B, T, H) when the value head reads the policy's own trunk, else None

    def ref_forward(self, ids: torch.Tensor, mask: torch.Tensor, n_resp: int) -> torch.Tensor: ...  # hidden

    def ref_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def named_trainable(self) -> list[tuple[str, nn.Parameter]]: ...

    def export(self, path: Path) -> None: ...


class LoraLayout:
    def __init__(self, base: nn.Module, r: int, alpha: float, target_modules: str | list[str],
                 value_adapter: bool = False):
        from peft import LoraConfig, get_peft_model

        _freeze(base)
        lora = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=target_modules, bias="none")
        with warnings.catch_warnings():  # peft reads transformers' deprecated is_gradient_checkpointing
            warnings.simplefilter("ignore", FutureWarning)
            self.peft = get_peft_model(base, lora).eval()
        self.value_adapter = value_adapter
        if value_adapter:
            self.peft.add_adapter("critic", lora)
        self.policy_model = self.peft.get_base_model()  # the HF model with adapters injected
        self.backbone = self.policy_model.base_model
        device = next(base.parameters()).device
        self.value_head = ValueHead(base.config.hidden_size).to(device).eval()
        self._trainable = [(n, p) for n, p in self.peft.named_parameters() if "lora_" in n]
        self._trainable += [(f"value_head.{n}", p) for n, p in self.value_head.named_parameters()]
        self._use_adapter("default")
        # what the lean decoder applies itself: plain (not DoRA, not Conv1D-style) LoRA on Linear layers
        self._lean_adapters = all(isinstance(m, LoraLinear) and not m.fan_in_fan_out and not any(m.use_dora.values())
                                  for m in self.peft.modules() if isinstance(m, LoraLayer))
        self._lean = None  # the lean decoder, kept: it prepares the frozen base's weights once
        if next(base.parameters()).dtype != torch.float32:
            # A low-precision base only runs under autocast, which casts the activations for the
            # adapters' matmuls itself; peft's own cast of every adapter input to the adapters' fp32
            # would add two activation copies per adapted layer and change no result.
            for module in self.peft.modules():
                if isinstance(module, LoraLayer):
                    module.cast_input_dtype_enabled = False

    def decoder(self):
        """The policy (base + adapter) as a decoder. The lean one reads the frozen base's weights,
        prepared once, and applies the adapter unmerged each step, as the trainer's forward does; the
        HF forward runs on merged weights over an fp32 base (exact to fp32 rounding), else unmerged."""
        lean = self._lean_decoder()
        if lean is not None:
            return contextlib.nullcontext(lean)
        if self.policy_model.get_input_embeddings().weight.dtype == torch.float32:
            return _yielding(merged_lora(self.peft), HFDecoder(self.policy_model))
        return contextlib.nullcontext(HFDecoder(self.policy_model))

    def _lean_decoder(self) -> LlamaDecoder | None:
        """The lean decoder over the frozen base, built on first use and kept (its prepared weights
        serve every rollout and every reference pass), or None where it does not apply."""
        if not (is_llama_family(self.policy_model.config) and self._lean_adapters):
            return None
        if self._lean is None:
            self._lean = LlamaDecoder(self.policy_model, _base_linear_params, _policy_adapter)
        return self._lean

    def _use_adapter(self, name: str) -> None:
        # peft's set_adapter also flips requires_grad off on the inactive adapter, which would stop its
        # gradients (already recorded in the graph) from accumulating; every adapter stays trainable.
        self.peft.base_model.set_adapter(name)
        for _, p in self._trainable:
            p.requires_grad_(True)

    def _critic_hidden(self, ids, mask, n_resp):
        """The trunk pass with the critic's adapter in place of the policy's."""
        self._use_adapter("critic")
        try:
            return response_hidden(self.backbone, ids, mask, n_resp)
        finally:
            self._use_adapter("default")

    def forward(self, ids, mask, n_resp):
        hidden = response_hidden(self.backbone, ids, mask, n_resp)
        critic_hidden = self._critic_hidden(ids, mask, n_resp) if self.value_adapter else hidden
        return hidden, self.value_head(critic_hidden)

    def values(self, ids, mask, n_resp):
        critic = self._critic_hidden if self.value_adapter else partial(response_hidden, self.backbone)
        return self.value_head(critic(ids, mask, n_resp))

    def sampled_values(self, hidden):
        return None if self.value_adapter else self.value_head(hidden)

    def logits(self, hidden):
        return self.policy_model.get_output_embeddings()(hidden)

    def ref_forward(self, ids, mask, n_resp):
        """The base with adapters off. Through the lean decoder's prepared base weights where it
        applies (no grad is ever needed here): ~10 % faster than peft's disabled-adapter forward on
        SmolLM2 in bf16 on CPU, and bit for bit the same under eager attention (tested)."""
        lean = self._lean_decoder()
        if lean is not None:
            return lean.base_hidden(ids, mask, n_resp)
        with self.peft.disable_adapter():
            return response_hidden(self.backbone, ids, mask, n_resp)

    def ref_logits(self, hidden):
        with self.peft.disable_adapter():  # matters only when the LM head itself has an adapter
            return self.policy_model.get_output_embeddings()(hidden)

    def named_trainable(self):
        return self._trainable

    def export(self, path: Path) -> None:
        """save_pretrained of base + policy adapter merged in fp32, from a copy (the live model stays as
        it is). fp32 even over a bf16 base: rounding W + s * B @ A to bf16 loses a small delta (65 % of
        the demo's trained adapter, measured), so a bf16 export would not be the policy that trained."""
        merged = copy.deepcopy(self.peft).float()
        if self.value_adapter:
            merged.delete_adapter("critic")
        merged.merge_and_unload().save_pretrained(path)


class FullLayout:
    def __init__(self, policy: nn.Module, reference: nn.Module, critic_backbone: nn.Module):
        self.policy_model = policy.eval()
        self.policy_backbone = policy.base_model
        self.reference = _freeze(reference)
        self.critic = critic_backbone.eval()
        self.value_head = ValueHead(critic_backbone.config.hidden_size).to(next(policy.parameters()).device).eval()
        self._trainable = [(f"policy.{n}", p) for n, p in policy.named_parameters()]
        self._trainable += [(f"critic.{n}", p) for n, p in self.critic.named_parameters()]
        self._trainable += [(f"value_head.{n}", p) for n, p in self.value_head.named_parameters()]
        for _, p in self._trainable:
            p.requires_grad_(True)

    def decoder(self):
        return contextlib.nullcontext(decoder_for(self.policy_model))

    def forward(self, ids, mask, n_resp):
        values = self.value_head(response_hidden(self.critic, ids, mask, n_resp))
        return response_hidden(self.policy_backbone, ids, mask, n_resp), values

    def values(self, ids, mask, n_resp):
        return self.value_head(response_hidden(self.critic, ids, mask, n_resp))

    def sampled_values(self, hidden):
        return None  # the critic is its own trunk

    def logits(self, hidden):
        return self.policy_model.get_output_embeddings()(hidden)

    def ref_forward(self, ids, mask, n_resp):
        return response_hidden(self.reference.base_model, ids, mask, n_resp)

    def ref_logits(self, hidden):
        return self.reference.get_output_embeddings()(hidden)

    def named_trainable(self):
        return self._trainable

    def export(self, path: Path) -> None:
        self.policy_model.save_pretrained(path)


def build_lora(base: nn.Module, r: int, alpha: float, target_modules: str, value_adapter: bool,
               gradient_checkpointing: bool = False) -> LoraLayout:
    """LoRA layout over an already loaded causal LM (it is frozen in place)."""
    targets = target_modules if target_modules == "all-linear" else [t.strip() for t in target_modules.split(",")]
    layout = LoraLayout(base, r, alpha, targets, value_adapter)
    if gradient_checkpointing:
        enable_gradient_checkpointing(layout.policy_model)
    return layout


def build_full(policy: nn.Module, reference: nn.Module, critic_source: nn.Module | None = None,
               gradient_checkpointing: bool = False) -> FullLayout:
    """Full layout; the critic's backbone is a copy of `critic_source`'s (default: the policy's)."""
    critic = copy.deepcopy((critic_source or policy).base_model)
    layout = FullLayout(policy, reference, critic)
    if gradient_checkpointing:
        enable_gradient_checkpointing(policy)
        enable_gradient_checkpointing(critic)
    return layout
