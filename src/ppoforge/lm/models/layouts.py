"""The three model layouts PPO can train: `lora` (default), `lora-critic` and `full` (TRL's four models).

- `lora`: one frozen base model with peft LoRA adapters as the policy. The reference is the same base
  with the adapters switched off, so there is no second copy of the weights. The value head reads the
  policy's own last hidden states: one trunk pass gives logits and values, and the critic's gradients
  flow into the policy's adapters.
- `lora-critic`: the same, but the critic is a second LoRA adapter ("critic") on the same base.
- `full`: every policy weight trains; a frozen copy is the reference and the critic is its own
  backbone copy (from the policy, or from a reward model together with its score head).

With `critic=False` (the critic-free estimators: GRPO, RLOO, REINFORCE++) a layout has no value head
and no critic backbone at all: `forward` returns values None and only the policy's weights train.
Without a KL term (`kl_coef: 0`) `full` loads no reference copy (`reference` None: never called).

Every layout runs the backbone (`lm.base_model`) itself and returns the hidden states of the positions
that predict response tokens; the trainer applies the LM head (`logits`) to them in row chunks, so
prompt positions never cost a (P, V) projection and scoring never holds a (B, T, V) tensor. Everything
stays in eval mode — dropout is off, which PPO's ratio needs — and gradient checkpointing is switched
on per decoder layer without putting any module in training mode. What the layouts share with the
supervised trainers — LoRA on a frozen base, the export, the trunks, the value head — is `parts.py`.

Each layout has a plain path (Hugging Face modules) and, where `decoder` allows it, the lean decoder as
an accelerator for sampling and for the LoRA reference pass (`fast_ref_forward`); the trainer checks
once that the accelerator equals the plain path before it trusts it (see lm/rl/trainer.py).
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from pathlib import Path
from typing import Protocol

import torch
from peft import LoraConfig
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from ppoforge.errors import UserError
from ppoforge.lm.models.decoders import Decoder, HFDecoder, LlamaDecoder, is_llama_family
from ppoforge.lm.models.parts import (
    CriticTrunk,
    Trunk,
    ValueHead,
    base_linear_params,
    enable_gradient_checkpointing,
    export,
    freeze,
    lora_config,
    lora_wrap,
    merged_lora,
    output_head,
    policy_adapter,
    response_hidden,
    yielding,
)
from ppoforge.lm.models.rows import TokenRows
from ppoforge.runtime import distributed
from ppoforge.runtime.fsdp import default_mesh, full_weights, mp_policy, reshard, shard_model


class Layout(Protocol):
    """What the trainer needs from a model layout."""

    policy_model: nn.Module  # the policy as a Hugging Face causal LM (adapters injected in lora)
    fast_ref_forward: object  # `ref_forward` through the lean decoder's prepared weights, or None

    def decoder(self) -> contextlib.AbstractContextManager[Decoder]: ...  # the policy, for the sampler

    def forward(self, rows: TokenRows) -> tuple[torch.Tensor, torch.Tensor | None]: ...  # policy hidden
    #   (B, T, H) at the positions predicting the response tokens, values (B, T) fp32 (None without a critic)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...  # policy LM head: (..., H) -> (..., V)

    def values(self, rows: TokenRows) -> torch.Tensor: ...  # (B, T) fp32: the critic's pass alone

    def sampled_values(self, hidden: torch.Tensor) -> torch.Tensor | None: ...  # from the sampler's hidden
    #   states (B, T, H) when the value head reads the policy's own trunk, else None

    def ref_forward(self, rows: TokenRows) -> torch.Tensor: ...  # the reference's hidden (B, T, H)

    def ref_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def named_trainable(self) -> list[tuple[str, nn.Parameter]]: ...

    def export(self, path: Path, kind: str = "adapter", dtype: torch.dtype | None = None,
               tokenizer=None) -> Path: ...  # `parts.export`; rank 0's call, every rank's when `sharded` (it gathers)

    sharded: bool  # FSDP2: trainable weights are shards, their gradients reduced by FSDP (`FullLayout.shard`)

    def release(self) -> None: ...  # free what a no-grad pass left gathered (nothing unless sharded)


class LoraLayout:
    """`lora` (value head on the policy's trunk) and, with `critic_adapter`, `lora-critic`."""

    sharded = False  # replicated under torchrun: the trainer all-reduces the adapters' gradients

    def __init__(self, base: nn.Module, lora: LoraConfig, critic_adapter: bool = False, decoder: str = "auto",
                 critic: bool = True):
        self.peft = lora_wrap(base, lora)
        self.critic_adapter = critic_adapter
        if critic_adapter:
            self.peft.add_adapter("critic", lora)
        self.policy_model = self.peft.get_base_model()  # the HF model with adapters injected
        self.backbone = self.policy_model.base_model
        device = next(base.parameters()).device
        self.value_head = ValueHead(base.config.hidden_size).to(device).eval() if critic else None
        self._trainable = [(n, p) for n, p in self.peft.named_parameters() if "lora_" in n]
        if critic:
            self._trainable += [(f"value_head.{n}", p) for n, p in self.value_head.named_parameters()]
        self._use_adapter("default")
        # The lean decoder, kept: it prepares the frozen base's weights once for every rollout and
        # reference pass.
        lean = _use_lean(decoder, self)
        self._lean = (LlamaDecoder(self.policy_model, base_linear_params, policy_adapter, share_frozen=True)
                      if lean else None)
        self.fast_ref_forward = self._lean.base_hidden if lean else None
        if next(base.parameters()).dtype != torch.float32:
            # A low-precision base only runs under autocast, which casts the activations for the
            # adapters' matmuls itself; peft's own cast of every adapter input to the adapters' fp32
            # would add two activation copies per adapted layer and change no result.
            for module in self.peft.modules():
                if isinstance(module, LoraLayer):
                    module.cast_input_dtype_enabled = False

    def lean_applies(self) -> bool:
        """Can the lean decoder run this policy: a Llama-family model with plain LoRA (not DoRA, not
        Conv1D-style) on Linear layers, which it applies itself?"""
        return is_llama_family(self.policy_model.config) and all(
            isinstance(m, LoraLinear) and not m.fan_in_fan_out and not any(m.use_dora.values())
            for m in self.peft.modules() if isinstance(m, LoraLayer))

    def decoder(self):
        """The policy (base + adapter) as a decoder. The lean one reads the frozen base's prepared weights
        and applies the adapter unmerged each step, as the trainer's forward does; the HF forward runs on
        merged weights over an fp32 base (exact to fp32 rounding), else unmerged."""
        if self._lean is not None:
            return self._lean_decoder()
        if self.policy_model.get_input_embeddings().weight.dtype == torch.float32:
            return yielding(merged_lora(self.peft), HFDecoder(self.policy_model))
        return contextlib.nullcontext(HFDecoder(self.policy_model))

    @contextlib.contextmanager
    def _lean_decoder(self):
        try:
            yield self._lean
        finally:
            self._lean.drop_cache()

    def _use_adapter(self, name: str) -> None:
        # peft's set_adapter also flips requires_grad off on the inactive adapter, which would stop its
        # gradients (already recorded in the graph) from accumulating; every adapter stays trainable.
        self.peft.base_model.set_adapter(name)
        for _, p in self._trainable:
            p.requires_grad_(True)

    @contextlib.contextmanager
    def _adapter(self, name: str):
        previous = self.peft.base_model.active_adapter
        self._use_adapter(name)
        try:
            yield
        finally:
            self._use_adapter(previous)

    def recompute_with_the_same_adapter(self):
        """torch.utils.checkpoint's `context_fn`: a checkpointed layer is recomputed in backward with the
        adapter that was active in its forward. Without it the critic adapter's layers were recomputed
        with the policy's (the active one by then), so its gradients came from the wrong activations."""
        return contextlib.nullcontext(), self._adapter(self.peft.base_model.active_adapter)

    def _critic_hidden(self, rows):
        """The trunk pass with the critic's adapter in place of the policy's."""
        with self._adapter("critic"):
            return response_hidden(self.backbone, rows)

    def forward(self, rows):
        hidden = response_hidden(self.backbone, rows)
        if self.value_head is None:
            return hidden, None
        critic_hidden = self._critic_hidden(rows) if self.critic_adapter else hidden
        return hidden, self.value_head(critic_hidden)

    def values(self, rows):
        if self.critic_adapter:
            return self.value_head(self._critic_hidden(rows))
        return self.value_head(response_hidden(self.backbone, rows))

    def sampled_values(self, hidden):
        return None if self.critic_adapter or self.value_head is None else self.value_head(hidden)

    def logits(self, hidden):
        return output_head(self.policy_model)(hidden)

    def ref_forward(self, rows):
        """The base with adapters off (peft's disabled-adapter forward)."""
        with self.peft.disable_adapter():
            return response_hidden(self.backbone, rows)

    def ref_logits(self, hidden):
        with self.peft.disable_adapter():  # matters only when the LM head itself has an adapter
            return output_head(self.policy_model)(hidden)

    def named_trainable(self):
        return self._trainable

    def export(self, path: Path, kind: str = "adapter", dtype: torch.dtype | None = None, tokenizer=None) -> Path:
        """The policy's adapter (PEFT format) and/or base + adapter merged into a copy (`parts.export`)."""
        return export(self.peft, path, kind, dtype, tokenizer, drop_adapters=("critic",) if self.critic_adapter else ())

    def release(self) -> None:
        pass


class FullLayout:
    """TRL's four models: the trained policy, a frozen reference, a critic (its own backbone and value
    head). `shard` turns it into FSDP2 shards over the ranks (`runtime/fsdp.py`): each rank then holds
    1/world of every trained weight and its optimizer state, and the decoder gathers the policy whole."""

    def __init__(self, policy: nn.Module, reference: nn.Module | None, critic_backbone: nn.Module | None,
                 value_head: ValueHead | None, decoder: str = "auto"):
        self.policy_model = policy.eval()
        # eval() on the wrappers too (recursive): a module left in training mode would switch dropout on
        self.policy = Trunk(policy).eval()
        self.reference = None if reference is None else Trunk(freeze(reference)).eval()
        self.critic = None if critic_backbone is None else CriticTrunk(critic_backbone, value_head).eval()
        self.value_head = value_head
        self.lean = _use_lean(decoder, self)
        self.fast_ref_forward = None  # the reference is its own model: only the plain pass
        self.sharded = False
        self._index_trainable()

    def _index_trainable(self) -> None:
        """The trained weights by stable names (checkpoint.pt's keys); after `shard`, the shards."""
        self._trainable = [(f"policy.{n}", p) for n, p in self.policy_model.named_parameters()]
        if self.critic is not None:
            self._trainable += [(f"critic.{n}", p) for n, p in self.critic.backbone.named_parameters()]
            self._trainable += [(f"value_head.{n}", p) for n, p in self.critic.value_head.named_parameters()]
        for _, p in self._trainable:
            p.requires_grad_(True)

    def shard(self, precision: str) -> None:
        """FSDP2 over the process group's ranks: each decoder layer a group, the rest of each model its
        root group (`Trunk`, `CriticTrunk`); the value head its own fp32 group (it computes in fp32).
        `precision` fp32 or bf16: bf16 gathers bf16 weights (compute in bf16), reduces gradients in fp32
        and keeps fp32 master shards; the reference, stored in bf16 then, computes what the policy
        computes, so their KL is 0 before the first update. Replicas start equal (rank 0's weights)."""
        if not self.lean:
            raise UserError(f"fsdp: needs the lean decoder (a Llama-family model: llama, qwen2), which decodes "
                            f"from gathered weights; this is a {self.policy_model.config.model_type}; allowed: "
                            "fsdp false (plain data parallelism)")
        distributed.broadcast_params([p for _, p in self._trainable])
        # its advice is about in-place ops on a group's output; none is applied to these
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        mesh = default_mesh(self.policy)
        shard_model(self.policy, precision, mesh, reshard_root=False)  # the LM head runs after its forward
        if self.reference is not None:
            cast = mp_policy(precision)
            shard_model(self.reference, MixedPrecisionPolicy(param_dtype=cast.param_dtype), mesh, reshard_root=False)
        if self.critic is not None:
            fully_shard(self.critic.value_head, mesh=mesh, mp_policy=MixedPrecisionPolicy())
            shard_model(self.critic, precision, mesh)
        self.sharded = True
        self._index_trainable()

    def release(self) -> None:
        if self.sharded:
            reshard(self.policy)
            if self.reference is not None:
                reshard(self.reference)

    def checkpoint_module(self) -> nn.Module:
        """The trained models under one root, for torch.distributed.checkpoint (names independent of the
        world size and of sharding)."""
        parts = {"policy": self.policy} | ({"critic": self.critic} if self.critic is not None else {})
        return nn.ModuleDict(parts)

    def lean_applies(self) -> bool:
        return is_llama_family(self.policy_model.config)

    def decoder(self):
        """A fresh decoder per rollout: its prepared weights are a snapshot of the training weights.
        Sharded, the lean decoder reads the policy gathered whole for the length of the context
        (collective: every rank enters); it calls no module, so no FSDP hook would gather for it."""
        if self.sharded:
            return self._gathered_decoder()
        return contextlib.nullcontext(LlamaDecoder(self.policy_model) if self.lean else HFDecoder(self.policy_model))

    @contextlib.contextmanager
    def _gathered_decoder(self):
        with full_weights(self.policy):
            yield LlamaDecoder(self.policy_model)

    def forward(self, rows):
        values = None if self.critic is None else self.critic(rows)
        return self.policy.response_hidden(rows), values

    def values(self, rows):
        return self.critic(rows)

    def sampled_values(self, hidden):
        return None  # the critic is its own trunk

    def logits(self, hidden):
        return output_head(self.policy_model)(hidden)

    def ref_forward(self, rows):
        return self.reference.response_hidden(rows)

    def ref_logits(self, hidden):
        return output_head(self.reference.lm)(hidden)

    def named_trainable(self):
        return self._trainable

    def export(self, path: Path, kind: str = "adapter", dtype: torch.dtype | None = None, tokenizer=None) -> Path:
        """The whole policy in `dtype` (`kind` aside: no adapter); sharded, gathered by every rank, rank 0 writes."""
        return export(self.policy_model, path, kind, dtype, tokenizer, sharded=self.sharded)


def build_lora(base: nn.Module, r: int, alpha: float, target_modules: str, critic_adapter: bool = False,
               gradient_checkpointing: bool = False, decoder: str = "auto", critic: bool = True) -> LoraLayout:
    """LoRA layout over an already loaded causal LM (it is frozen in place); `critic=False`: no value head."""
    layout = LoraLayout(base, lora_config(r, alpha, target_modules), critic_adapter, decoder, critic)
    if gradient_checkpointing:
        enable_gradient_checkpointing(layout.policy_model, layout.recompute_with_the_same_adapter)
    return layout


def build_full(policy: nn.Module, reference: nn.Module | None, critic_source: nn.Module | None = None,
               gradient_checkpointing: bool = False, decoder: str = "auto", critic: bool = True) -> FullLayout:
    """Full layout. The critic's backbone is a copy of `critic_source`'s (default: the policy's); a
    reward model as the source also gives the value head its score head (TRL starts the value model
    from the whole reward model). `critic=False`: no critic copy and no value head."""
    backbone = head = None
    if critic:
        backbone = copy.deepcopy((critic_source or policy).base_model)
        head = ValueHead(backbone.config.hidden_size).to(next(policy.parameters()).device)
    if critic and critic_source is not None:
        score = getattr(critic_source, "score", None)
        if not (isinstance(score, nn.Linear) and score.out_features == 1):
            raise UserError("critic_model: its sequence-classification head is not a (hidden -> 1) `score` "
                            "Linear; allowed: a causal-LM reward model (e.g. LlamaForSequenceClassification)")
        head.from_score_head(score)
    layout = FullLayout(policy, reference, backbone, head, decoder)
    if gradient_checkpointing:
        enable_gradient_checkpointing(policy)
        if backbone is not None:
            enable_gradient_checkpointing(backbone)
    return layout


def _use_lean(choice: str, layout) -> bool:
    """`decoder`: auto -> the lean decoder where it applies; lean -> it, or a UserError; hf -> never."""
    if choice == "hf":
        return False
    applies = layout.lean_applies()
    if choice == "lean" and not applies:
        raise UserError(f"decoder: lean needs a Llama-family model (llama, qwen2) with plain LoRA on Linear "
                        f"layers; this is a {layout.policy_model.config.model_type}; allowed: auto or hf")
    return applies
