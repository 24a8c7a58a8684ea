"""FSDP2 for the `full` layout: shard a model over ranks, gather it for the lean decode, reshardable checkpoints.

- `shard_model` applies `torch.distributed.fsdp.fully_shard` to every decoder layer (the classes a Hugging
  Face model names in `_no_split_modules`: `Qwen2DecoderLayer`, `LlamaDecoderLayer`, ...) and then to the
  root, which keeps the embeddings, the final norm and the LM head (tied or not) in one group. Each rank
  then holds 1/world of every parameter (a `DTensor`) and of the optimizer state; a layer's full weights
  exist only between its pre-forward all-gather and its post-forward reshard.
- `full_weights` is for code that reads `module.weight` itself instead of calling the module:
  `lm.models.decoders.LlamaDecoder` does, so FSDP's forward hooks never fire for it and it would see shards.
  Inside the context every FSDP group is unsharded (all-gathered, in the mixed-precision `param_dtype`),
  so `module.weight` is a plain full `nn.Parameter`; on exit the groups are resharded and the gathered
  storage is freed. The price is the whole model's weights on each rank for the length of the decode;
  a model whose weights alone do not fit one device must decode with `decoder: hf`, whose forward runs
  the hooks (one layer gathered at a time) and needs no context.
- `save_sharded` / `load_sharded` go through `torch.distributed.checkpoint` with
  `get_state_dict` / `set_state_dict`, which name parameters and optimizer state by fully qualified name
  and record each shard's offsets: a checkpoint saved by N ranks loads on M (1 -> 2, 2 -> 1, and a plain
  process with no process group), sharded or not. A checkpoint is a directory, written beside its final
  place and renamed into it, so a crash leaves the old checkpoint or the new one (see `_swap_in`).

How a trainer uses it (lm/models/layouts.py's `FullLayout.shard`, the supervised tasks' `shard`):
1. setup: after building the policy and value models on the device, `shard_model(model, precision)` on
   each trainable one before building its optimizer (the optimizer must hold the DTensor shards); shard
   the frozen reference too (its forward runs the hooks; the RLHF reward model stays whole). With the bf16 policy use
   `make_precision("fp32", device)` (no autocast): FSDP casts the gathered weights itself.
2. rollout: `with torch.no_grad(), full_weights(policy): decoder = LlamaDecoder(policy); sample(...)`.
   Build the decoder inside the context (it keeps references to the gathered tensors, freed on exit)
   and call no forward of the model inside it: the post-forward hook reshards (tested).
3. update: FSDP averages the ranks' gradients, so a rank's loss is world x (its token sum / the global
   token count); the local token mean is right only when every rank holds as many tokens. The norm
   `clip_grad_norm_` returns is the whole model's (a replicated DTensor; `.item()` works).
4. checkpoint: `save_sharded(run_dir / "checkpoint", model, optimizer, extra)` on every rank, `extra`
   holding the update counter, config and metrics state; `extra` is rank 0's, so per-rank state (RNG,
   data cursor) goes in as a list from `dist.all_gather_object`. `load_sharded` on resume.
FSDP2 on CPU (gloo) needs a torch whose `torch.cpu.Stream` has `record_event` (2.13 does, tested); torch 2.6
does not (`cpu_unsupported_reason`): there FSDP2 is CUDA-only (untested here), while the checkpoints
work for unsharded models, 1 <-> 2 ranks (tested on both).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from ppoforge.errors import UserError

EXTRA_FILE = "extra.pt"  # weights_only-safe values beside the sharded tensors, written by rank 0


def cpu_unsupported_reason() -> str | None:
    """Why FSDP2 cannot run on CPU (gloo) with this torch, or None when it can. torch 2.6's fully_shard
    records a stream event around every all-gather, and its CPU stream has no events."""
    if hasattr(torch.cpu.Stream, "record_event"):
        return None
    return (f"FSDP2 on CPU needs torch.cpu.Stream.record_event, which torch {torch.__version__} lacks: the first "
            "all-gather of fully_shard fails with AttributeError: 'Stream' object has no attribute 'record_event'")


def mp_policy(precision: str | MixedPrecisionPolicy) -> MixedPrecisionPolicy:
    """FSDP's casting policy for a precision name: `fp32` none; `bf16` gathers bf16 weights (forward and
    backward compute in bf16) and reduces gradients in fp32, so the sharded fp32 master weights and their
    optimizer step stay fp32. A `MixedPrecisionPolicy` passes through unchanged."""
    if isinstance(precision, MixedPrecisionPolicy):
        return precision
    if precision == "fp32":
        return MixedPrecisionPolicy()
    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if precision == "fp16":
        # GradScaler's inf check sees only this rank's shard: ranks would disagree on skipping a step
        raise UserError("precision: fp16 is not supported under FSDP (its GradScaler would need a found-inf "
                        "all-reduce across ranks); allowed: fp32, bf16")
    raise UserError(f"precision: {precision!r} under FSDP; allowed: fp32, bf16 (resolve `auto` first: "
                    "runtime.precision.resolve_precision)")


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The modules whose class a Hugging Face model names in `_no_split_modules` (its decoder layers),
    in order. Read from every submodule, so a wrapped model (a value head, peft) is found too."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise UserError(f"fsdp: found no decoder layers in {type(model).__name__} (no submodule of a class named "
                        "in `_no_split_modules`); allowed: a Hugging Face transformers model")
    return layers


def default_mesh(model: nn.Module) -> DeviceMesh:
    """One dimension over every rank, on the device type of `model`'s parameters."""
    return init_device_mesh(next(model.parameters()).device.type, (dist.get_world_size(),))


def shard_model(model: nn.Module, mp: str | MixedPrecisionPolicy = "fp32", mesh: DeviceMesh | None = None,
                reshard_root: bool = True) -> nn.Module:
    """fully_shard each decoder layer, then the root; returns `model`, now an FSDPModule, in place.

    Needs an initialized process group; collective (it gathers every group once, see the end).
    `mesh` defaults to `default_mesh(model)` (a CUDA model should already be on this rank's device).
    `reshard_root=False` keeps the root group (embeddings, final
    norm, LM head) gathered after its forward, until the backward or an explicit `reshard()`: for a
    caller that applies the LM head to the forward's output outside the root's forward (lm/models/layouts.py's
    `Trunk`); the head's gradient still reaches the root's reduce-scatter, which runs when backward ends."""
    device = next(model.parameters()).device
    if device.type == "cpu" and (reason := cpu_unsupported_reason()):
        raise UserError(f"fsdp: {reason}; allowed: a CUDA device, or a newer torch on CPU")
    mesh = mesh or default_mesh(model)
    policy = mp_policy(mp)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    # the root too (torch > 2.6 would keep it gathered from forward to backward): a no-grad forward (a
    # rollout, the reference pass) would otherwise leave embeddings and LM head gathered until the next
    # backward, and an optimizer built meanwhile would hold the gathered tensors instead of the shards
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_root)
    # FSDP allocates a group's gathered weights at its first all-gather; were that inside
    # torch.inference_mode (a rollout's or an evaluation's passes), they would be inference tensors that a
    # later all-gather with autograd on may not write into. So gather every group once here, outside it.
    with full_weights(model):
        pass
    return model


def is_sharded(model: nn.Module) -> bool:
    return any(isinstance(m, FSDPModule) for m in model.modules())


def reshard(model: nn.Module) -> None:
    """Free every gathered FSDP group of `model` (a root kept gathered by `reshard_root=False` after a
    no-grad forward); nothing for a model without FSDP. Not a collective."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def whole(param: torch.Tensor) -> torch.Tensor:
    """A parameter whole: an FSDP2 shard (a DTensor) all-gathered, a plain tensor as it is. Collective for a
    shard: every rank must gather the same parameters in the same order."""
    return param.full_tensor() if hasattr(param, "full_tensor") else param


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s whole state dict on the CPU, every shard gathered (collective: every rank calls it)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


@contextlib.contextmanager
def full_weights(model: nn.Module) -> Iterator[nn.Module]:
    """All of `model`'s parameters gathered, as plain tensors, for the length of the context (see the
    module docstring); nothing happens for a model without FSDP. Collective: every rank must enter."""
    groups = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for group in groups:
        group.unshard()  # not recursive: one call per group
    try:
        yield model
    finally:
        for group in reversed(groups):
            group.reshard()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Without a process group dcp warns on every call that it assumes one process: that is the intent."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is .*uninitialized, assuming")
        yield


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _aside(path: Path, what: str) -> Path:
    return path.parent / f".{path.name}.{what}"


def _recover(path: Path) -> None:
    """Rank 0 finishes a swap a crash interrupted (the old checkpoint moved aside, the new one not yet in
    place) and removes a leftover aside copy; then every rank may read `path`. Collective."""
    old = _aside(path, "old")
    if _rank() == 0:
        if not path.exists() and old.exists():
            os.replace(old, path)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()


def _swap_in(tmp: Path, path: Path) -> None:
    """Rank 0: move a complete checkpoint dir `tmp` to `path`. A directory cannot be renamed over a
    non-empty one, so the old checkpoint goes aside first; `_recover` finishes a swap cut between the two
    renames, so `path` (or its aside copy) always holds a whole checkpoint."""
    old = _aside(path, "old")
    _fsync_dir(tmp)
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    if old.exists():
        shutil.rmtree(old)


def save_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 extra: dict | None = None) -> None:
    """Every rank writes its shards of the model and optimizer state; rank 0 writes `extra` (plain values:
    tensors, numbers, strings, lists, dicts) and renames the directory into place. Collective. `path`
    must be on a filesystem every rank sees."""
    path = Path(path)
    _recover(path)
    tmp = _aside(path, "tmp")
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # an earlier save killed half-way
        tmp.mkdir(parents=True)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, [optimizer] if optimizer else [])
    with _single_process_quiet():
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)  # ends once the metadata is written
    if _rank() == 0:
        with open(tmp / EXTRA_FILE, "wb") as f:
            torch.save(extra or {}, f)
            f.flush()
            os.fsync(f.fileno())
        _swap_in(tmp, path)
    _barrier()


def load_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load a `save_sharded` checkpoint into `model` (and `optimizer`) in place, whatever the world size
    that wrote it; returns its `extra`. Collective where a process group exists; also runs without one."""
    path = Path(path)
    _recover(path)
    if not (path / ".metadata").is_file() or not (path / EXTRA_FILE).is_file():
        raise UserError(f"resume: no sharded checkpoint at {path}")
    # the current state dicts give the keys and, for DTensors, which shard this rank reads
    model_sd, optim_sd = get_state_dict(model, [optimizer] if optimizer else [])
    state = {"model": model_sd, "optim": optim_sd}
    try:
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=path)
    except CheckpointException as e:  # a BaseException, raised on every rank: another model's checkpoint
        error = next(iter(e.failures.values()))[0]
        raise UserError(f"resume: {path} does not fit this model ({type(error).__name__}: {str(error)[:160]}); "
                        "allowed: a checkpoint of the same model and optimizer") from None
    set_state_dict(model, [optimizer] if optimizer else [], model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    extra = torch.load(path / EXTRA_FILE, map_location="cpu", weights_only=True)
    _barrier()  # no rank returns while another may still read a file a later save replaces
    return extra
