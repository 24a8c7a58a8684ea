"""Everything an RLHF run is built from — device, precision, tokenizer, model layout, stop tokens,
tokenized prompts, reward — assembled from an `RLHFConfig` in one place, so the trainer only trains.

Memory/speed choice: weights that never train (the LoRA base, reward models) are loaded in the
autocast dtype under bf16/fp16, which is what autocast would cast them to on every forward anyway;
trained weights stay fp32 (master weights). The full layout's reference is stored as autocast computes
the fp32 policy — Linear weights in the autocast dtype, embeddings and norms in fp32 — so that its KL to
the policy is exactly 0 before the first update (an all-bf16 copy was 9e-4 nats per token off).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ppoforge.errors import UserError
from ppoforge.lm.data.files import CHARS_PER_TOKEN
from ppoforge.lm.data.prompts import (
    SPLIT_MAX,
    SPLIT_MIN_ROWS,
    SPLIT_SEED,
    load_prompts,
    render_prompt,
    split_heldout,
    without,
)
from ppoforge.lm.models.attention import EAGER_MAX_TOKENS
from ppoforge.lm.models.layouts import Layout, build_full, build_lora
from ppoforge.lm.models.loading import (
    finish_loaded_lm,
    load_causal_lm,
    load_reward_model,
    load_tokenizer,
    prepare_tokenizer,
)
from ppoforge.lm.models.parts import cast_linears, head_in_fp32
from ppoforge.lm.models.windows import check_window
from ppoforge.lm.rl.config import RLHFConfig
from ppoforge.lm.rl.rewards import build_reward, score
from ppoforge.runtime import distributed
from ppoforge.runtime.device import resolve_device
from ppoforge.runtime.precision import Precision, make_precision, resolve_precision


@dataclass
class RunInputs:
    device: torch.device
    precision: Precision
    tokenizer: object
    layout: Layout
    stop_ids: tuple[int, ...]
    prompt_rows: list[dict]          # training prompt rows
    prompt_ids: list[list[int]]      # their rendered, tokenized, truncated prompts
    heldout_prompt_rows: list[dict]
    heldout_prompt_ids: list[list[int]]
    score: Callable | None           # (prompts, completions, finished, rows) -> (B,) float32 scores; None
    #                                  with an env (it scores its episodes, and renders their prompts)
    left_out: int = 0                # training rows left out as held-out prompts (a split, heldout_disjoint)
    cuts: dict = field(default_factory=dict)  # per prompt set: rows, cut rows and tokens (max_prompt_tokens)
    split: dict | None = None        # heldout_prompts auto's split of the prompts (`heldout_rows`), else None
    reward_fn: Callable | None = None  # what `score` calls (a WeightedSum keeps its terms: rewards/<name>/ metrics)

    def data_report(self) -> dict:
        """What the run's data became: data_report.json in the run dir."""
        return {"prompts": len(self.prompt_rows), "heldout_prompts": len(self.heldout_prompt_rows),
                "left_out_as_heldout": self.left_out, "heldout_split": self.split,
                "cut_to_max_prompt_tokens": self.cuts}


def heldout_rows(cfg: RLHFConfig, rows: list[dict]) -> tuple[list[dict], list[dict], dict | None]:
    """(training rows, held-out rows, the split's record for data_report.json or None). heldout_prompts auto
    with the user's own prompts holds out a few of them (`split_heldout`; one line says how many, or that a
    set this small is not split); any other value names the held-out set itself."""
    if not cfg.heldout_split:
        return rows, load_prompts(cfg.heldout_source, cfg.prompt_field) if cfg.heldout_source else [], None
    train, held, index = split_heldout(rows, cfg.heldout_fraction)
    if distributed.world().is_main:
        line = (f"{len(held)} of {len(rows)} prompts are held out of training and evaluated (heldout_fraction "
                f"{cfg.heldout_fraction:g}, at most {SPLIT_MAX}, the same rows every run)" if held else
                f"the {len(rows)} prompts are too few to hold some out (fewer than {SPLIT_MIN_ROWS}): no held-out "
                "evaluation")
        print(f"ppoforge: heldout_prompts: auto: {line}; another held-out set: heldout_prompts PATH",
              file=sys.stderr)
    split = {"source": cfg.prompts, "rows": len(rows), "fraction": cfg.heldout_fraction, "seed": SPLIT_SEED,
             "heldout_rows": index}  # 0-based row indices of the prompt set
    return train, held, split


def stop_token_ids(tokenizer, model, extra: str | None) -> tuple[int, ...]:
    """EOS, the generation config's eos ids, and `extra` (comma-separated ids or token strings)."""
    stops = {tokenizer.eos_token_id}
    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    stops |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    for item in (extra or "").split(","):
        item = item.strip()
        if not item:
            continue
        tid = int(item) if item.isdigit() else tokenizer.convert_tokens_to_ids(item)
        if tid is None or tid == tokenizer.unk_token_id or not 0 <= tid < len(tokenizer):
            raise UserError(f"stop_tokens: {item!r} is not a token of this tokenizer; "
                            "allowed: token ids or token strings, comma-separated")
        stops.add(tid)
    stops.discard(None)
    if tokenizer.pad_token_id in stops:
        raise UserError(f"stop_tokens: the pad token {tokenizer.pad_token!r} cannot be a stop token")
    return tuple(sorted(stops))


def tokenize_prompts(tokenizer, rows: list[dict], field: str, chat: bool, max_tokens: int, what: str = "prompts",
                     cuts: dict | None = None) -> list[list[int]]:
    """Render each prompt (chat template when asked and available), tokenize, keep the last max_tokens. Never
    silently: a cut is one line on stderr (how many rows, how many tokens, the longest prompt) and, given
    `cuts`, counted there under `what` for the run's data report.

    A text longer than max_tokens x CHARS_PER_TOKEN characters is tokenized from its tail alone (what is kept is
    its last tokens): a 50 MB row would otherwise become millions of Python ints before the cut. Its length
    in tokens is then estimated from the tail's (`estimated_rows` in the report)."""
    templated = chat and bool(tokenizer.chat_template)
    texts = [render_prompt(tokenizer, r[field], chat) for r in rows]
    limit = max_tokens * CHARS_PER_TOKEN
    encoded = tokenizer([t[-limit:] for t in texts], add_special_tokens=not templated)["input_ids"]
    lengths = [len(ids) for ids in encoded]
    for i, text in enumerate(texts):
        if len(text) > limit:  # the tail's first token may be a word cut in two: it is among those dropped
            if len(encoded[i]) <= max_tokens:  # no tokenizer makes tokens this long; if one does, the whole text
                encoded[i] = tokenizer(text, add_special_tokens=not templated)["input_ids"]
                lengths[i] = len(encoded[i])
            else:
                lengths[i] = round(len(encoded[i]) * len(text) / limit)
    out = [ids[-max_tokens:] for ids in encoded]
    if any(not ids for ids in out):
        raise UserError(f"prompts: a prompt of field {field!r} tokenizes to no tokens")
    over = [n - max_tokens for n in lengths if n > max_tokens]
    if cuts is not None:
        cuts[what] = {"rows": len(rows), "cut_rows": len(over), "cut_tokens": sum(over), "longest": max(lengths),
                      "max_prompt_tokens": max_tokens, "estimated_rows": sum(len(t) > limit for t in texts)}
    if over and distributed.world().is_main:
        print(f"ppoforge: {what}: {len(over)} of {len(rows)} prompts are longer than max_prompt_tokens {max_tokens} "
              f"(the longest {max_tokens + max(over)} tokens): their first {sum(over)} tokens in all are cut, the last "
              f"{max_tokens} of each kept; to keep them whole: max_prompt_tokens {max_tokens + max(over)}",
              file=sys.stderr)
    return out


def check_sequence_fits(cfg: RLHFConfig, model_config) -> None:
    """A prompt plus a response must fit the model's positions (RoPE tables, absolute embeddings)."""
    limit = getattr(model_config, "max_position_embeddings", None)
    need = cfg.max_prompt_tokens + cfg.episode_tokens
    what = "max_episode_tokens" if cfg.env else "max_new_tokens"
    if limit and need > limit:
        raise UserError(f"{what}: max_prompt_tokens {cfg.max_prompt_tokens} + {what} {cfg.episode_tokens} = "
                        f"{need} positions, more than the model's {limit}; allowed: a sum <= {limit}")


def check_sequence_window(cfg: RLHFConfig, model_config, field: str = "model") -> None:
    """A prompt plus a response must fit every windowed layer's window (`windows.py`: the run's 4D masks give
    every layer full attention, which is the model only within its window)."""
    what = "max_episode_tokens" if cfg.env else "max_new_tokens"
    check_window(model_config, cfg.max_prompt_tokens + cfg.episode_tokens,
                 f"max_prompt_tokens {cfg.max_prompt_tokens} + {what} {cfg.episode_tokens}",
                 f"rows within the window (max_prompt_tokens + {what} <= {{window}})", field)




def attention_for(choice: str, device: torch.device, row_tokens: int) -> str | None:
    """`attn_implementation` for from_pretrained. On CPU, `auto` is eager for rows of up to
    `EAGER_MAX_TOKENS` positions: for RLHF's short sequences CPU SDPA's flash kernel, its backward above
    all, is slower than three plain ops (-12 % per PPO update on the `tiny` benchmark, -4 % on `smollm2`).
    Longer rows get SDPA, whose memory grows with T where eager's grows with T². Elsewhere `auto` is the
    model's default."""
    if choice == "auto":
        return ("eager" if row_tokens <= EAGER_MAX_TOKENS else "sdpa") if device.type == "cpu" else None
    return choice


def fsdp_precision(cfg: RLHFConfig, device: torch.device) -> str | None:
    """The precision FSDP2 casts to (fp32 or bf16) when this run shards its models, else None: with
    `fsdp` under torchrun (world > 1). At world 1 `fsdp` trains the plain full layout (only the checkpoint
    format differs), so a run can move between world sizes."""
    return resolve_precision(cfg.precision, device) if cfg.fsdp and distributed.world().size > 1 else None


def _load_lm(cfg: RLHFConfig, dtype: torch.dtype, device: torch.device, loaded=None, **kw):
    """The policy's model (or its frozen base, or the reference), its LM head in fp32 with `lm_head_fp32`: from
    `cfg.model`, or a copy of `loaded` (the Python API's already-loaded model; it keeps its own attention)."""
    model = (load_causal_lm(cfg.model, dtype, device, **kw) if loaded is None else
             finish_loaded_lm(loaded, kw["tokenizer"], dtype, device))
    return head_in_fp32(model) if cfg.lm_head_fp32 else model


def _layout(cfg: RLHFConfig, tokenizer, device, frozen_dtype, attn: str | None, loaded=None) -> Layout:
    kw = {"tokenizer": tokenizer, "attn_implementation": attn}
    load = functools.partial(_load_lm, cfg, device=device, loaded=loaded, **kw)
    if cfg.layout in ("lora", "lora-critic"):
        base = load(frozen_dtype)
        return build_lora(base, cfg.lora_r, cfg.lora_alpha, cfg.lora_target_modules, cfg.layout == "lora-critic",
                          cfg.gradient_checkpointing, cfg.layout_decoder, cfg.has_critic)
    policy = load(torch.float32)
    sharded = fsdp_precision(cfg, device)
    # the reference as the fp32 policy computes under autocast: Linear weights in its dtype, the rest fp32;
    # sharded, as FSDP casts the policy: all of it in bf16, or fp32. None without a KL term (kl_coef 0:
    # no reference pass, so no copy in memory)
    reference = None
    if cfg.kl_coef and sharded:
        reference = load(torch.bfloat16 if sharded == "bf16" else torch.float32)
    elif cfg.kl_coef:
        reference = cast_linears(load(torch.float32), frozen_dtype)
    critic = load_reward_model(cfg.critic_model, torch.float32, device, **kw) if cfg.critic_model else None
    if critic is not None:  # it reads the policy's rows
        check_sequence_window(cfg, critic.config, "critic_model")
    layout = build_full(policy, reference, critic, cfg.gradient_checkpointing, cfg.layout_decoder, cfg.has_critic)
    if sharded:
        layout.shard(sharded)
    return layout


def build_inputs(cfg: RLHFConfig, reward_fn=None, model=None, tokenizer=None) -> RunInputs:
    """The run's inputs: device, precision, tokenizer, layout, stop tokens, prompts, reward. `model` and
    `tokenizer` (the Python API's, already loaded) replace loading `cfg.model` and its tokenizer; copies are
    trained, the caller's objects are left as they are."""
    device = resolve_device(cfg.device)
    # sharded, FSDP casts the weights itself (MixedPrecisionPolicy) in place of autocast
    precision = make_precision("fp32" if fsdp_precision(cfg, device) else cfg.precision, device)
    field = "tokenizer" if cfg.tokenizer else "model"
    tokenizer = (prepare_tokenizer(tokenizer, model) if tokenizer is not None else
                 load_tokenizer(cfg.tokenizer or cfg.model, model=cfg.model, field=field))
    attn = attention_for(cfg.attn_implementation, device, cfg.max_prompt_tokens + cfg.episode_tokens)
    frozen_dtype = precision.dtype or torch.float32  # weights that never train: the reference, reward models
    layout = _layout(cfg, tokenizer, device, frozen_dtype, attn, model)
    check_sequence_fits(cfg, layout.policy_model.config)
    check_sequence_window(cfg, layout.policy_model.config)  # the policy, and the reference: the same model
    stops = stop_token_ids(tokenizer, layout.policy_model, cfg.stop_tokens)
    for note in cfg.notes() if distributed.world().is_main else ():
        print(f"ppoforge: {note}", file=sys.stderr)
    rows = load_prompts(cfg.prompts, cfg.prompt_field)
    loaded = len(rows)
    rows, heldout, split = heldout_rows(cfg, rows)
    if cfg.heldout_disjoint and heldout and not cfg.env:
        rows = without(rows, heldout, cfg.prompt_field)
    cuts: dict = {}  # prompts cut to max_prompt_tokens, per set: the run's data report
    encode = functools.partial(tokenize_prompts, tokenizer, field=cfg.prompt_field, chat=cfg.use_chat_template,
                               max_tokens=cfg.max_prompt_tokens, cuts=cuts)
    if cfg.env:  # the environment's reset() gives each episode's first messages, and it scores the episode
        return RunInputs(device, precision, tokenizer, layout, stops, rows, [[] for _ in rows], heldout,
                          [[] for _ in heldout], None, loaded - len(rows), split=split)
    if reward_fn is None:
        reward_fn = build_reward(cfg.reward, cfg.reward_weights, device=device, policy_tokenizer=tokenizer,
                                 call_timeout=cfg.call_timeout, dtype=frozen_dtype, attn_implementation=attn,
                                 share_prefix=cfg.shared_prefix == "auto")
        name = cfg.reward
    else:
        name = getattr(reward_fn, "__name__", "reward_fn")
    return RunInputs(device, precision, tokenizer, layout, stops, rows, encode(rows), heldout,
                      encode(heldout, what="heldout_prompts") if heldout else [],
                      functools.partial(score, reward_fn, name), loaded - len(rows), cuts, split, reward_fn)
