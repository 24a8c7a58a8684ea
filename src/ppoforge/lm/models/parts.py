"""Model parts the layouts (lm/models/layouts.py) and the supervised trainers (lm/supervised/) share, each
once: LoRA adapters on a frozen base (`lora_config`, `lora_wrap`), the export (`export`: a LoRA adapter in
PEFT format and/or merged into a copy, or a whole model, FSDP2's gathered), the trunks (a causal LM's hidden
states as one module call, which FSDP2's root group needs), the value head, gradient checkpointing that
keeps every module in eval mode, LoRA merged for decoding, and dtype casting.
"""

from __future__ import annotations

import contextlib
import copy
import types
import warnings
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from ppoforge.lm.models.export_fields import EXPORT_KINDS
from ppoforge.lm.models.rows import TokenRows
from ppoforge.runtime import distributed
from ppoforge.runtime.fsdp import full_state_dict


# ---- LoRA on a frozen base ---------------------------------------------------------------------------
def freeze(module: nn.Module) -> nn.Module:
    """No gradients, eval mode (no dropout); `module` itself, in place."""
    module.requires_grad_(False)
    return module.eval()


def lora_config(r: int, alpha: float, target_modules: str, task_type: str | None = None) -> LoraConfig:
    """Plain LoRA (no dropout, no bias) on every Linear (`all-linear`) or on the comma-separated module
    names. `task_type` picks peft's model class: `CAUSAL_LM` (SFT), `SEQ_CLS` (a reward model: its score
    head trains in full too), None (the RLHF layouts: the plain PeftModel)."""
    targets = target_modules if target_modules == "all-linear" else [t.strip() for t in target_modules.split(",")]
    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets, bias="none",
                      task_type=task_type)


def lora_wrap(model: nn.Module, lora: LoraConfig) -> PeftModel:
    """`model` frozen in place (requires_grad off, eval mode) with `lora`'s adapters ("default") injected;
    the PeftModel, in eval mode. The adapters' A matrices are drawn from torch's global RNG, module by
    module: what is drawn before this call decides them."""
    freeze(model)
    with warnings.catch_warnings():  # peft reads transformers' deprecated is_gradient_checkpointing
        warnings.simplefilter("ignore", FutureWarning)
        return get_peft_model(model, lora).eval()


def base_linear_params(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of a Linear; for a LoRA Linear, its frozen base layer's."""
    base = module.get_base_layer() if isinstance(module, LoraLayer) else module
    return base.weight, base.bias


def policy_adapter(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor, float] | None:
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
def yielding(context, value):
    with context:
        yield value


# ---- export ------------------------------------------------------------------------------------------
EXPORT_DIR = "model"  # RUN/model: every trainer's export (RLHF runs before issue 39 wrote RUN/policy)

MERGED_DIR = "merged"  # `both`: the merged model's folder inside the adapter's


def export_dtype(name: str, precision: str) -> torch.dtype:
    """The `export_dtype` field as a dtype: auto is the training precision's (bf16 in a bf16 run, else fp32)."""
    if name == "auto":
        name = "bf16" if precision == "bf16" else "fp32"
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def export(model: nn.Module, path: Path, kind: str = "adapter", dtype: torch.dtype | None = None,
           tokenizer=None, sharded: bool = False, drop_adapters: tuple[str, ...] = ()) -> Path:
    """Save `model` (and `tokenizer`) as a folder Hugging Face loads as it is; returns `path`.

    A PeftModel (LoRA) by `kind`: `adapter` (TRL's and PEFT's way) saves its "default" adapter alone
    (adapter_config.json + adapter_model.safetensors, a few MB, `peft.PeftModel.from_pretrained(base, path)`
    loads it; ppoforge's loaders take the folder as a model); `merged` saves base + adapter merged into a copy
    (the live model left as it is), computed in fp32 and stored in `dtype`; `both` the adapter in `path`
    and the merged model in `path/merged`. In bf16 the merge's rounding loses small adapter deltas (65 % of
    the demo's trained adapter, measured): the adapter, or `dtype` fp32, is the model that trained.
    `drop_adapters` (the lora-critic layout's "critic") never leave. Any other model (the full layout) is
    saved whole in `dtype` whatever `kind`. `dtype` None keeps the weights' own. `sharded` (FSDP2):
    collective, every rank gathers the weights with the others and rank 0 writes them."""
    if kind not in EXPORT_KINDS:
        raise ValueError(f"export kind {kind!r}; allowed: {', '.join(EXPORT_KINDS)}")
    path = Path(path)
    if sharded:
        state = full_state_dict(model)  # collective
        if distributed.is_main():
            model.save_pretrained(path, state_dict=_cast(state, dtype))
    elif not isinstance(model, PeftModel):
        model.save_pretrained(path, state_dict=_cast(model.state_dict(), dtype) if dtype else None)
    else:
        if kind in ("adapter", "both"):
            model.save_pretrained(path, selected_adapters=["default"])
        if kind in ("merged", "both"):
            merged = path / MERGED_DIR if kind == "both" else path
            _merged_copy(model, drop_adapters, dtype).save_pretrained(merged)
            if tokenizer is not None and kind == "both":
                tokenizer.save_pretrained(merged)
    if tokenizer is not None and distributed.is_main():
        tokenizer.save_pretrained(path)
    return path


def _merged_copy(peft_model: PeftModel, drop_adapters: tuple[str, ...], dtype: torch.dtype | None) -> nn.Module:
    """Base + the "default" adapter merged in fp32 into a copy, then stored in `dtype` (None: the base's)."""
    base_dtype = next(peft_model.get_base_model().parameters()).dtype
    model = copy.deepcopy(peft_model).float()
    for name in drop_adapters:
        model.delete_adapter(name)
    return model.merge_and_unload().to(dtype or base_dtype)


def _cast(state: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Floating tensors of a state dict in `dtype` (None: as they are)."""
    if dtype is None:
        return state
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}


# ---- trunks and the value head -------------------------------------------------------------------------
def response_hidden(backbone: nn.Module, rows: TokenRows) -> torch.Tensor:
    """Last hidden states (B, T, H) at the positions that predict the rollout's T response tokens;
    `backbone` is a Hugging Face base model (`lm.base_model`)."""
    return rows.response(backbone(**rows.inputs(backbone)).last_hidden_state)


class Trunk(nn.Module):
    """A causal LM's last hidden states (B, L, H) as one module call, for its LM head to read: the full
    layout's policy and reference, and the supervised model. Under FSDP2 it is the root group (embeddings,
    final norm, LM head): calling `lm.base_model` directly would bypass the root's hooks, so its weights
    would stay shards; the root stays gathered after the call (`shard_model(reshard_root=False)`) for the
    LM head that runs on its output."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, **inputs) -> torch.Tensor:
        return self.lm.base_model(**inputs).last_hidden_state

    def response_hidden(self, rows: TokenRows) -> torch.Tensor:
        """`response_hidden` through this module's call (so FSDP2's hooks run)."""
        return rows.response(self(**rows.inputs(self.lm.base_model)))


class ValueHead(nn.Module):
    """Linear(hidden, 1) computed in fp32 on the last hidden states.

    Zero-initialized: the first values are 0 and, on a shared trunk, the first value-loss gradients
    reach the trunk (the policy's adapters) only as the head grows, instead of a random head's large
    error pushing the policy around (and inflating Adam's second moments) before it has learned anything.
    A critic made from a reward model starts from its score head instead (`from_score_head`).
    """

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, 1)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def from_score_head(self, score: nn.Linear) -> ValueHead:
        """Copy a reward model's (1, hidden) score head: the critic starts as the whole reward model."""
        with torch.no_grad():
            self.linear.weight.copy_(score.weight.float())
            if score.bias is not None:
                self.linear.bias.copy_(score.bias.float())
        return self

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            return nn.functional.linear(hidden.float(), self.linear.weight, self.linear.bias).squeeze(-1)


class CriticTrunk(nn.Module):
    """The full layout's critic: its backbone and value head, values (B, T) fp32 in one module call."""

    def __init__(self, backbone: nn.Module, value_head: ValueHead):
        super().__init__()
        self.backbone, self.value_head = backbone, value_head

    def forward(self, rows: TokenRows) -> torch.Tensor:
        return self.value_head(response_hidden(self.backbone, rows))


# ---- the LM head in fp32 ------------------------------------------------------------------------------
def head_size(lm: nn.Module) -> int:
    """The vocabulary the LM head of `lm` scores (its output size)."""
    return lm.get_output_embeddings().weight.shape[0]


def output_head(lm: nn.Module):
    """`lm`'s LM head as its own forward applies it: the output embedding, then the logit soft-cap where the
    config has one (Gemma 2's `final_logit_softcapping`: cap * tanh(logits / cap)). Every path that turns
    hidden states into logits without the model's forward calls this, not the output embedding alone (which
    left Gemma 2's logits uncapped: 11 nats off a log-prob)."""
    head = lm.get_output_embeddings()
    cap = getattr(lm.config, "final_logit_softcapping", None)
    if not cap:
        return head
    return lambda hidden: torch.tanh(head(hidden) / cap) * cap


def head_in_fp32(lm: nn.Module) -> nn.Module:
    """`lm_head_fp32`: the output embedding of `lm` computes in fp32 under autocast, from the fp32 hidden
    state (weights stored in bf16 are upcast, exactly). Under bf16 autocast the head's logits are otherwise
    rounded to 8 significant bits — at a logit of 20 that is +-0.06 — and that rounding is most of the
    log-prob error bf16 adds (MiniMax-M1, arXiv:2506.13585 sec. 4: their RL's train/inference probability
    mismatch came from the LM head's precision, fixed by an fp32 head). `lm` itself, changed in place;
    every path that computes logits honors it: the module call (training, reference, Hugging Face decoding)
    and the lean decoder, which reads the mark (`head_computes_in_fp32`)."""
    head = lm.get_output_embeddings()
    head.forward = types.MethodType(_fp32_linear, head)
    head.computes_in_fp32 = True
    return lm


def _fp32_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast(x.device.type, enabled=False):
        bias = None if module.bias is None else module.bias.float()
        return nn.functional.linear(x.float(), module.weight.float(), bias)


def head_computes_in_fp32(head: nn.Module) -> bool:
    """Was `head_in_fp32` applied to this head (or to the layer a LoRA wrapper holds)?"""
    return getattr(getattr(head, "base_layer", head), "computes_in_fp32", False)


# ---- memory ------------------------------------------------------------------------------------------
def enable_gradient_checkpointing(lm: nn.Module, context_fn=None) -> None:
    """Recompute each decoder layer in backward. HF only checkpoints a layer whose own `training` flag is
    set, so we set that flag on the layer objects alone: their children stay in eval (no dropout).
    `context_fn` (torch.utils.checkpoint's) sets up what the recomputation must see."""
    kwargs = {"use_reentrant": False} | ({"context_fn": context_fn} if context_fn else {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    lm.eval()
    for module in lm.modules():
        if isinstance(module, GradientCheckpointingLayer):
            module.training = True


def cast_linears(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Store every Linear (not tied to the input embeddings) in `dtype`, the rest as it is (fp32).

    A frozen copy of an fp32 policy stored so computes exactly what the policy computes under autocast
    (which casts Linear weights to `dtype` on every call, and leaves embeddings and norms in fp32) at
    about half the memory: the full layout's reference, whose KL to the policy must be 0 at update 1. A
    head that computes in fp32 (`head_in_fp32`) stays fp32, as the policy's does."""
    embedding = model.get_input_embeddings().weight
    for module in model.modules():
        fp32 = getattr(module, "computes_in_fp32", False)
        if isinstance(module, nn.Linear) and module.weight is not embedding and not fp32:
            module.to(dtype)
    return model
