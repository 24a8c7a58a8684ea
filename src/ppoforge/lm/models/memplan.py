"""Will it fit? A trainer config's memory, phase by phase, before the run: `ppoforge plan`.

The model is built on the meta device from its config alone (no weights are read), so the parameter counts
are exact for any architecture transformers knows: its linears (what LoRA adapts), embeddings and LM head.
Everything else is arithmetic on the config, counted as ppoforge's trainers hold it:

- trained weights in fp32 with their fp32 gradients and AdamW's two fp32 moments (16 bytes a parameter),
  split over `world` ranks with FSDP (`fsdp`); a LoRA base frozen in the run's compute dtype;
- the full layout's frozen reference (its linears in the compute dtype, the rest fp32; none at kl_coef 0),
  a critic model trained like the policy, a reward model in the compute dtype;
- the lean decoder's stacked copy of the decoder's linear weights: the full layout's, and on CPU (oneDNN
  packing) the LoRA base's too; on a GPU the LoRA base's stacks are the model's own weights (`decoder: hf`
  holds none);
- generation: the KV cache of every row sampled at once (prompt + completion budget) and its logits;
- scoring passes (old log-probs, values, reference) run over one micro-batch at a time with no graph;
- training: per micro-batch the activations autograd keeps for backward — per layer and token the inputs of
  the norms, the attention and MLP projections, the MLP's intermediates and, with eager attention, the
  attention probabilities (heads x positions) — or with gradient checkpointing only each layer's input plus
  one layer's; and the LM head's chunked fp32 logits (`logprobs.HEAD_CHUNK_ELEMENTS`).

Each phase's peak is what stays resident plus what the phase adds, plus the runtime's own (CUDA context and
allocator; on CPU the interpreter and libraries). The verdict compares the largest with the device's memory
and, when it does not fit, names the one change that makes it fit. The estimate is checked against measured
peaks in docs/benchmarks.md ("Memory plan against measured peaks").
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from ppoforge.errors import UserError
from ppoforge.lm.models.attention import EAGER_MAX_TOKENS
from ppoforge.lm.models.loading import model_config
from ppoforge.lm.models.logprobs import HEAD_CHUNK_ELEMENTS
from ppoforge.lm.models.vllm_engine import vllm_version
from ppoforge.runtime import distributed

GiB = 1 << 30
ADAM_BYTES = 16  # fp32 weight, gradient and AdamW's two moments
RUNTIME = {"cuda": 1.0 * GiB, "cpu": 0.6 * GiB}  # CUDA context + allocator slack; interpreter + torch + transformers
FIT_SHARE = 0.95  # fragmentation and what the estimate leaves out


@dataclass(frozen=True)
class ModelShape:
    """A causal LM's sizes, read from its config (exact parameter counts from a meta-device build)."""
    model_type: str
    params: int
    linear_params: int   # the decoder layers' linears: what the lean decoder stacks and `all-linear` LoRA adapts
    lora_per_rank: int   # sum of (in + out) over the adapted linears: LoRA's parameters are r x this
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int


@dataclass(frozen=True)
class Workload:
    """What the config asks of the memory, in the plan's terms (one rank's share)."""
    layout: str            # lora | full
    compute_bytes: int     # 2 (bf16) or 4 (fp32)
    lora_r: int
    micro_rows: int        # sequences per forward/backward
    tokens: int            # positions per training row (prompt + completion budget)
    gen_rows: int          # rows sampled at once (0: no generation, SFT and reward training)
    resp_tokens: int       # completion positions per row (the LM head's rows; SFT: every position)
    world: int = 1         # FSDP ranks sharing the trained weights
    gradient_checkpointing: bool = False
    eager_attention: bool = False
    reference: bool = False    # the full layout's frozen copy (kl_coef > 0)
    critic_model: bool = False  # a separately trained critic of the policy's size
    reward_model: bool = False  # a frozen reward model of the policy's size (the plan's assumption)
    lean_decoder: bool = True
    packed: bool = False    # CPU: the lean decoder's oneDNN-packed stacks are a copy even of a LoRA base
    vllm_share: float = 0.0  # rollout_engine vllm on CUDA: the share of the GPU the engine takes (its own KV)
    vllm: bool = False       # rollout_engine vllm: the engine holds a copy of the weights and its own KV cache
    vllm_sleep: bool = False  # CUDA: the engine sleeps between rollouts, resident only while generating


@dataclass
class Plan:
    """Bytes per component and per phase; the verdict against `capacity` bytes."""
    components: dict[str, float]
    phases: dict[str, float]
    capacity: float | None
    device: str
    fix: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> float:
        return max(self.phases.values())

    @property
    def fits(self) -> bool | None:
        return None if self.capacity is None else self.peak <= FIT_SHARE * self.capacity

    def lines(self) -> list[str]:
        out = [f"{name:<34} {size / GiB:8.2f} GiB" for name, size in self.components.items() if size]
        out += [""] + [f"peak while {name:<23} {size / GiB:8.2f} GiB" for name, size in self.phases.items()]
        if self.capacity is None:
            out.append(f"\n{self.device}: capacity unknown; the peak is {self.peak / GiB:.2f} GiB")
            return out
        verdict = "fits" if self.fits else "does NOT fit"
        out.append(f"\n{verdict} on {self.device} ({self.capacity / GiB:.1f} GiB; the plan keeps "
                   f"{1 - FIT_SHARE:.0%} free): peak {self.peak / GiB:.2f} GiB")
        if self.fix:
            out.append(f"to make it fit: {self.fix}")
        return out + self.notes


def model_shape(config, lora_targets: str = "all-linear") -> ModelShape:
    """Counts from a transformers config: the model built on the meta device, nothing allocated."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    targets = None if lora_targets == "all-linear" else {t.strip() for t in lora_targets.split(",")}
    linear, lora = 0, 0
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or name.endswith("lm_head"):
            continue
        linear += module.weight.numel()
        if targets is None or name.rsplit(".", 1)[-1] in targets:
            lora += module.in_features + module.out_features
    params = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    text = getattr(config, "text_config", None) or config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return ModelShape(text.model_type, params, linear, lora, text.num_hidden_layers, text.hidden_size,
                      getattr(text, "intermediate_size", 4 * text.hidden_size), heads,
                      getattr(text, "num_key_value_heads", None) or heads, head_dim, text.vocab_size)


def components(m: ModelShape, w: Workload) -> dict[str, float]:
    """Bytes of every resident and per-phase piece, one rank's share."""
    lora = w.layout == "lora"
    trained = m.lora_per_rank * w.lora_r if lora else m.params
    frozen_base = m.params * w.compute_bytes if lora else 0
    shard = 1 if lora else w.world  # FSDP shards the full layout's trained weights and their states
    out = {"trained weights + grads + AdamW": trained * ADAM_BYTES / shard,
           "frozen base (LoRA)": frozen_base,
           "reference (frozen copy)": (m.linear_params * w.compute_bytes + (m.params - m.linear_params) * 4) / shard
           if w.reference and not lora else 0,
           "critic model (trained)": m.params * ADAM_BYTES / shard if w.critic_model else 0,
           "reward model (frozen)": m.params * w.compute_bytes if w.reward_model else 0,
           # the LoRA base's stacks are the model's own weights unless packed (`LlamaDecoder.share_frozen`); the
           # full layout's fp32 weights are read in place in fp32 (`in_place`), cast (a copy) under bf16
           "lean decoder's stacked linears": m.linear_params * w.compute_bytes
           if w.gen_rows and w.lean_decoder and (w.packed or not lora and w.compute_bytes != 4) else 0}
    positions = w.tokens
    kv = 2 * m.layers * w.gen_rows * m.kv_heads * positions * m.head_dim * w.compute_bytes
    # vLLM: its own weights and KV cache (on CUDA its whole share, set in `plan`); none of the local decoder's
    out["vLLM engine (weights + KV cache)"] = m.params * w.compute_bytes + 1.25 * kv if w.vllm else 0
    out["KV cache (generation)"] = 0 if w.vllm else kv
    out["generation logits"] = w.gen_rows * m.vocab * 4 * 2
    per_token_layer = 16 * m.hidden + 3 * m.intermediate  # elements autograd keeps per layer and token
    eager = m.heads * positions * 2 if w.eager_attention else 0  # scores + probabilities
    tokens = w.micro_rows * positions
    if w.gradient_checkpointing:
        act = tokens * (m.layers * m.hidden + per_token_layer + eager) * w.compute_bytes
    else:
        act = tokens * m.layers * (per_token_layer + eager) * w.compute_bytes
    out["training activations (micro-batch)"] = act
    head_logits = min(w.micro_rows * w.resp_tokens * m.vocab, 2 * HEAD_CHUNK_ELEMENTS)
    out["LM head logits (chunked, fp32)"] = head_logits * 4 * 3  # logits, log-softmax, their gradient
    out["scoring pass (micro-batch, no graph)"] = (tokens * (per_token_layer + eager) * w.compute_bytes
                                                   + head_logits * 4 * 2)  # logits, log-softmax
    return out


def phases(c: dict[str, float], runtime: float, generates: bool, engine_sleeps: bool = False) -> dict[str, float]:
    engine = c.get("vLLM engine (weights + KV cache)", 0)
    resident = runtime + sum(c[k] for k in ("frozen base (LoRA)", "reference (frozen copy)",
                                            "reward model (frozen)", "lean decoder's stacked linears"))
    resident += 0 if engine_sleeps else engine  # asleep, the engine frees its GPU memory between rollouts
    states = c["trained weights + grads + AdamW"] + c["critic model (trained)"]
    out = {}
    if generates:
        out["generating"] = (resident + states + c["KV cache (generation)"] + c["generation logits"]
                             + (engine if engine_sleeps else 0))
        out["scoring the rollout"] = resident + states + c["scoring pass (micro-batch, no graph)"]
    out["training a micro-batch"] = resident + states + c["training activations (micro-batch)"] + \
        c["LM head logits (chunked, fp32)"]
    return out


def plan(m: ModelShape, w: Workload, capacity: float | None, device: str) -> Plan:
    """The plan, and when it does not fit the first single change that makes it fit."""
    runtime = RUNTIME["cuda" if device.startswith("cuda") else "cpu"]

    def build(work: Workload) -> Plan:
        c = components(m, work)
        if work.vllm_share and capacity is not None:  # CUDA: vLLM takes its configured share, whatever it needs
            c["vLLM engine (weights + KV cache)"] = work.vllm_share * capacity
        return Plan(c, phases(c, runtime, work.gen_rows > 0, work.vllm_sleep), capacity, device)

    result = build(w)
    if result.fits is False:
        result.fix = first_fix(w, lambda work: build(work).fits)
    return result


def first_fix(w: Workload, fits) -> str | None:
    """The first of: a smaller micro-batch, gradient checkpointing, the HF decoder, LoRA, FSDP over more GPUs,
    shorter completions — whichever alone makes the plan fit; else `together`."""
    micro = w.micro_rows // 2
    while micro >= 1:
        if fits(replace(w, micro_rows=micro)):
            return f"micro_batch_size {micro}"
        micro //= 2
    if not w.gradient_checkpointing and fits(replace(w, gradient_checkpointing=True)):
        return "gradient_checkpointing true"
    if w.gen_rows and w.lean_decoder and fits(replace(w, lean_decoder=False)):
        return "decoder hf (the lean decoder's copy of the linears is not held)"
    if w.layout == "full" and fits(replace(w, layout="lora", reference=False, critic_model=False)):
        return "layout lora"
    for world in (2, 4, 8):
        if w.layout == "full" and world > w.world and fits(replace(w, world=world)):
            return f"fsdp over {world} GPUs (torchrun --nproc_per_node {world}, fsdp true)"
    budget = w.resp_tokens // 2
    while budget >= 16 and w.gen_rows:
        if fits(replace(w, tokens=w.tokens - w.resp_tokens + budget, resp_tokens=budget)):
            return f"max_new_tokens {budget}"
        budget //= 2
    return together(w, fits)


def together(w: Workload, fits) -> str | None:
    """No single change is enough: gradient checkpointing, the HF decoder, LoRA and the largest micro-batch that
    fits with them, together (or None: not on this device)."""
    changes, w = ["gradient_checkpointing true"], replace(w, gradient_checkpointing=True)
    if w.gen_rows and w.lean_decoder:
        changes.append("decoder hf")
        w = replace(w, lean_decoder=False)
    if w.layout == "full":
        w = replace(w, layout="lora", reference=False, critic_model=False)
        changes.insert(0, "layout lora")
    micro = w.micro_rows
    while micro >= 1:
        if fits(replace(w, micro_rows=micro)):
            return ", ".join(changes + ([f"micro_batch_size {micro}"] if micro < w.micro_rows else [])) + " together"
        micro //= 2
    return None


def parse_capacity(device: str) -> tuple[float | None, str]:
    """`cuda:80GB` / `cuda:24GiB` (a target), `cuda` (the GPU here), `cpu` (this machine's available memory)."""
    name, _, size = device.partition(":")
    if name == "cuda" and size and size.upper().rstrip("IB").rstrip("G").replace(".", "", 1).isdigit():
        number = float(size.upper().removesuffix("GIB").removesuffix("GB"))
        return number * (GiB if size.upper().endswith("GIB") else 1e9), f"cuda ({size})"
    if name == "cpu" and not size:
        with open("/proc/meminfo") as f:
            available = [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
        return (available[0] if available else None), "cpu (available memory)"
    if name == "cuda" and (not size or size.isdigit()):
        if not torch.cuda.is_available():
            raise UserError(f"device: {device} but no CUDA device is visible; allowed: cpu, or a target such as "
                            "cuda:24GB, cuda:40GB, cuda:80GB")
        props = torch.cuda.get_device_properties(int(size or 0))
        return float(props.total_memory), f"cuda:{size or 0} ({props.name})"
    raise UserError(f"device: {device!r}; allowed: cpu, cuda, cuda:N, or a target such as cuda:24GB or cuda:80GiB")


def compute_bytes(precision: str, device: str) -> int:
    """2 where the run computes in bf16 (`precision` bf16, or auto on a GPU target), else 4."""
    if precision == "auto":
        return 2 if device.startswith("cuda") else 4
    return 2 if precision == "bf16" else 4


def rlhf_workload(cfg, device: str, world: int = 1) -> Workload:
    """An RLHFConfig's workload on `device` (one rank of `world`)."""
    positions = cfg.max_prompt_tokens + cfg.episode_tokens
    eager = cfg.attn_implementation == "eager" or (cfg.attn_implementation == "auto" and device == "cpu"
                                                    and positions <= EAGER_MAX_TOKENS)
    gen_rows = math.ceil(max(cfg.rollout_size, cfg.batch_size * cfg.heldout_samples) / world)
    return Workload(layout="full" if cfg.layout == "full" else "lora",
                    compute_bytes=compute_bytes(cfg.precision, device), lora_r=cfg.lora_r,
                    micro_rows=cfg.micro_batch_size, tokens=positions, gen_rows=gen_rows,
                    resp_tokens=cfg.episode_tokens, world=world, gradient_checkpointing=cfg.gradient_checkpointing,
                    eager_attention=eager, reference=cfg.kl_coef > 0, critic_model=bool(cfg.critic_model),
                    reward_model=not cfg.reward.startswith(("py:", "task", "vader", "length", "format"))
                    and "/" in cfg.reward, lean_decoder=cfg.rollout_engine != "hf", packed=device == "cpu",
                    **_engine(cfg, device))


def _engine(cfg, device: str) -> dict:
    """The Workload's vLLM fields: rollout_engine vllm (auto: on CUDA where vLLM is installed, as the run picks)."""
    cuda = device.startswith("cuda")
    if not (cfg.rollout_engine == "vllm" or (cfg.rollout_engine == "auto" and cuda and vllm_version())):
        return {}
    return {"vllm": True, "vllm_share": cfg.vllm_gpu_memory_utilization if cuda else 0.0,
            "vllm_sleep": cuda and cfg.vllm_sleep}


def supervised_workload(cfg, device: str, world: int = 1, pairs: bool = False) -> Workload:
    """An SFTConfig's workload (every position through the LM head), or with `pairs` a RewardConfig's (a
    chosen and a rejected row per example, a one-number head): no generation."""
    return Workload(layout="full" if cfg.layout == "full" else "lora",
                    compute_bytes=compute_bytes(cfg.precision, device), lora_r=cfg.lora_r,
                    micro_rows=cfg.micro_batch_size * (2 if pairs else 1), tokens=cfg.max_length, gen_rows=0,
                    resp_tokens=0 if pairs else cfg.max_length, world=world,
                    gradient_checkpointing=cfg.gradient_checkpointing,
                    eager_attention=device == "cpu" and cfg.max_length <= 512)


def for_config(cfg, kind: str, device: str, world: int = 1) -> Plan:
    """The plan of a trainer config (`kind`: rlhf, sft or reward) on `device` (see `parse_capacity`)."""
    capacity, where = parse_capacity(device)
    target = "cuda" if device.startswith("cuda") else "cpu"
    workload = (rlhf_workload(cfg, target, world) if kind == "rlhf" else
                supervised_workload(cfg, target, world, pairs=kind == "reward"))
    shape = model_shape(model_config(cfg.model), cfg.lora_target_modules)
    result = plan(shape, workload, capacity, where)
    result.notes.append(f"model {cfg.model}: {shape.model_type}, {shape.params / 1e6:,.0f}M parameters "
                        f"({shape.linear_params / 1e6:,.0f}M in the layers' linears); {kind}, "
                        f"layout {workload.layout}, "
                        f"{'bf16' if workload.compute_bytes == 2 else 'fp32'}, micro-batch {workload.micro_rows} x "
                        f"{workload.tokens} positions" + (f", {workload.gen_rows} rows sampled at once"
                                                          if workload.gen_rows else "")
                        + (f", FSDP over {world}" if world > 1 else ""))
    return result


def check_fits(cfg, kind: str, device) -> None:
    """At a CUDA run's start: one line with the plan's peak, and a config the plan says cannot fit refused in
    one line before any weight is loaded. On CPU nothing: the machine's memory is shared and swaps rather than
    failing at a known line; `ppoforge plan` says it there."""
    if device.type != "cuda":
        return
    world = distributed.world().size if getattr(cfg, "fsdp", False) else 1
    result = for_config(cfg, kind, f"cuda:{device.index or 0}", world)
    if result.fits is False:
        raise UserError(f"memory: the plan's peak is {result.peak / GiB:.1f} GiB, more than {FIT_SHARE:.0%} of this "
                        f"GPU's {result.capacity / GiB:.1f} GiB; allowed: {result.fix or 'a smaller model'} "
                        f"(`ppoforge plan {kind}` with the same options shows where it goes)")
    if distributed.world().is_main:
        print(f"ppoforge: memory plan: peak {result.peak / GiB:.2f} GiB a rank "
              f"({max(result.phases, key=result.phases.get)}); `ppoforge plan {kind}` with the same options "
              "shows where it goes", file=sys.stderr)
