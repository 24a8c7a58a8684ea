"""Data-parallel training under torchrun: one process group, the few collectives a trainer needs, and
the rule that a run's numbers do not depend on how many ranks computed them.

`init()` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK); without it the world is one
process, no process group exists and every helper here is the identity (a run is bit-identical to one
that never imported this module). Backend: NCCL when the training device is CUDA, gloo on CPU; the
collective timeout is the config's `dist_timeout`. `PPOFORGE_FORCE_COLLECTIVES=1` keeps a one-process
group at world 1 and sends every helper through its collective (`collectives()`, the one predicate), so
one GPU runs the placement eight do. Every tensor a collective sees is moved to the backend's device
(`_device()`: this rank's GPU under NCCL, the CPU under gloo) here, in one place, and back.

Design: replicated parameters, a manual gradient all-reduce — not `DistributedDataParallel`:
- The LM trainer takes each mini-batch from a permutation of the *global* rollout (drawn from a
  generator every rank seeds alike), so a rank owns a varying number of a mini-batch's rows (zero
  included); DDP's bucketed hooks assume every rank runs the same forward/backward calls.
- The layouts (LoRA adapters, a value head on the policy's trunk, TRL's four models) train a subset of
  several modules; one flat buffer of the trainable gradients (plus the step's loss statistics riding
  along) is one all-reduce per optimizer step, whatever the layout.
- The loss weights need the mini-batch's *global* token / sequence count before the first backward:
  `all_sum` it first, then each micro-batch's loss is weighted by its units / the global units, and the
  summed gradient is exactly the single-process mini-batch gradient (up to float summation order).

World-size invariance (what makes 2 ranks equal 1, and a checkpoint resume on another world size): the
trainers' own generators (sampling uniforms, shuffles, data order) are seeded alike on every rank and
draw the global batch's numbers; each rank uses its slice. Only the process-global RNGs (python, numpy,
torch: user code such as a reward function) are seeded per rank, `seed + rank`.

Failure: `checked(fn)` runs a rank's collective-free work (sampling, reward calls) and then all-reduces
an error flag, so one rank's exception becomes the same one-line error on every rank ("rank 1: reward
my_reward raised ValueError: ...") and the same exit code (2 for bad input, `RankBadInput` on the
others; 1 for a fault, `RankFailed`); a rank that hangs or dies surfaces as a collective timeout on the
others (`DistTimeout`), and torchrun stops the rest when a worker process exits.
"""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ppoforge.errors import EXIT_USER, Fault, UserError, classify
from ppoforge.runtime.checkpoint import seed_everything
from ppoforge.runtime.timeouts import StopRequested

DEFAULT_TIMEOUT = 600.0  # seconds; the `dist_timeout` config default


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_world = World()
_timeout = DEFAULT_TIMEOUT
_active = False  # do the helpers run their collectives (world > 1, or forced at world 1)?
_agreed_failure = False  # did every rank learn of a failure in `checked` (then all exit together)?
FORCE_ENV = "PPOFORGE_FORCE_COLLECTIVES"  # "1": a one-process group at world 1 (docs/distributed.md)


class DistTimeout(Fault):
    """A collective did not complete within dist_timeout: another rank hung or died."""


class RankFailed(Fault):
    """Another rank's update raised; the message names that rank and the cause. Exit code 1."""

    ppoforge_shared = True  # every rank knows this line: rank 0 prints it (cli.main)


class RankBadInput(UserError):
    """Another rank stopped on bad input (its UserError, exit code 2): every rank exits 2 with it, so the
    exit code torchrun's summary shows for whichever worker it saw fail first is ours."""

    ppoforge_shared = True


def env_world() -> World:
    """The world torchrun's environment describes (world 1 without it)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    return World(int(os.environ.get("RANK", "0")), size, int(os.environ.get("LOCAL_RANK", "0")))


def init(timeout_s: float = DEFAULT_TIMEOUT, device: torch.device | None = None) -> World:
    """Join torchrun's process group once per process (later calls return the same world); a CUDA
    `device` selects NCCL and this rank's local GPU. World 1: nothing is initialized, unless
    PPOFORGE_FORCE_COLLECTIVES=1 asks for a one-process group (an in-memory store, no rendezvous)."""
    global _world, _timeout, _active
    _timeout = timeout_s
    if dist.is_available() and dist.is_initialized():
        return _world
    world = env_world()
    forced = world.size == 1 and os.environ.get(FORCE_ENV) == "1"
    if world.size == 1 and not forced:
        _world, _active = world, False
        return world
    cuda = device is not None and device.type == "cuda"
    if cuda:
        torch.cuda.set_device(world.local_rank)
    backend, timeout = "nccl" if cuda else "gloo", datetime.timedelta(seconds=timeout_s)
    try:
        if forced:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group(backend, timeout=timeout)
    except Exception as e:  # noqa: BLE001 - rendezvous failures are the environment's: one line
        raise Fault(f"distributed: rank {world.rank} of {world.size} could not join the process group "
                    f"({type(e).__name__}: {_first_line(e)}); run `ppoforge doctor` on each node") from None
    _world, _active = world, True
    return world


def collectives() -> bool:
    """Do the helpers run their collectives? Under torchrun, and at world 1 with PPOFORGE_FORCE_COLLECTIVES=1;
    otherwise each is the identity. Callers that skip work only a collective needs ask this, not the size."""
    return _active


def world() -> World:
    return _world


def is_main() -> bool:
    return _world.is_main


def shard(n_global: int, what: str) -> slice:
    """This rank's contiguous slice of `n_global` items, which must divide by the world size (a UserError
    naming `what` otherwise: every rank finds it alike, so rank 0 alone prints it)."""
    size = _world.size
    if n_global % size:
        e = UserError(f"{what}: {n_global} does not divide by the {size} ranks of this torchrun; allowed: a "
                      f"multiple of {size}, or --nproc_per_node that divides it")
        e.ppoforge_shared = True
        raise e
    n = n_global // size
    return slice(_world.rank * n, (_world.rank + 1) * n)


def uneven_shard(n_global: int) -> slice:
    """This rank's slice of `n_global` items that need not divide: the first n % size ranks get one more."""
    base, extra = divmod(n_global, _world.size)
    start = _world.rank * base + min(_world.rank, extra)
    return slice(start, start + base + (_world.rank < extra))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


def _collective(op, *args):
    """Run a collective; a timeout (or a peer that went away) becomes one line naming this rank."""
    try:
        return op(*args)
    except RuntimeError as e:
        raise DistTimeout(f"rank {_world.rank}: a collective did not complete within {_timeout:g} s "
                          f"(dist_timeout) — another rank hung or died ({_first_line(e)[:120]})") from None


def all_sum(x: torch.Tensor) -> torch.Tensor:
    """x summed over ranks, in place (x itself, untouched, at world 1). The reduction runs on the
    backend's device: a tensor elsewhere (a CPU one under NCCL) goes there and its sum comes back into x."""
    if _active:
        y = x.to(_device())
        _collective(dist.all_reduce, y)
        if y is not x:
            x.copy_(y)
    return x


def reducer():
    """`all_sum` under torchrun, None at world 1 (core functions then take their single-process path)."""
    return all_sum if _active else None


def all_mean(x: torch.Tensor) -> torch.Tensor:
    """x averaged over ranks (a mean over equal-sized shards is the global mean)."""
    return all_sum(x) / _world.size if _active else x


def any_true(flag: bool) -> bool:
    """True on every rank when it is True on any (a stop request, a failed check)."""
    if not _active:
        return flag
    return bool(all_sum(torch.tensor([float(flag)], device=_device())).item() > 0)


def all_gather(x: torch.Tensor) -> torch.Tensor:
    """The ranks' equal-shaped tensors concatenated along dim 0, in rank order, on x's device."""
    if not _active:
        return x
    y = x.to(_device()).contiguous()  # NCCL gathers on this rank's GPU; gloo on the CPU
    parts = [torch.empty_like(y) for _ in range(_world.size)]
    _collective(dist.all_gather, parts, y)
    return torch.cat(parts).to(x.device)


def all_gather_np(a):
    """A numpy array's rows from every rank, concatenated in rank order (control's per-env arrays: with
    contiguous env shards, the global env order). Returned unchanged at world 1."""
    if not _active:
        return a
    t = torch.from_numpy(a.copy())
    if t.dtype == torch.bool:  # gathered as bytes: not every backend reduces bools
        return all_gather(t.to(torch.uint8)).numpy().astype(bool)
    return all_gather(t).numpy()


def gather_rows(rows: list) -> list:
    """Every rank's list of picklable rows, concatenated in rank order (tables, completions)."""
    if not _active:
        return rows
    out: list = [None] * _world.size
    _collective(dist.all_gather_object, out, rows)
    return [r for part in out for r in part]


class SlicedRng:
    """A numpy Generator whose draws are the global batch's, sliced to this rank's `rows`: every rank
    draws for all `n_global` rows (environments) and keeps its own, so the world size changes no draw.
    The first dimension of each draw is the batch; `bit_generator` is the wrapped one's (checkpoints)."""

    def __init__(self, rng, rows: slice, n_global: int):
        self.rng, self.rows, self.n_global = rng, rows, n_global
        self.bit_generator = rng.bit_generator

    def _size(self, size) -> tuple[int, ...]:
        size = (size,) if isinstance(size, int) else tuple(size)
        return (self.n_global, *size[1:])

    def random(self, size, dtype=None):
        return self.rng.random(self._size(size), dtype=dtype)[self.rows]

    def standard_normal(self, size, dtype=None):
        return self.rng.standard_normal(self._size(size), dtype=dtype)[self.rows]


def sliced_rng(rng, rows: slice, n_global: int):
    """`rng` itself at world 1, else a SlicedRng over it."""
    return SlicedRng(rng, rows, n_global) if _active else rng


def rank0_value(value):
    """Rank 0's `value` on every rank (a run dir each rank named from its own clock)."""
    if not _active:
        return value
    box = [value]
    _collective(dist.broadcast_object_list, box, 0)
    return box[0]


def all_reduce_grads(params: list[torch.nn.Parameter], extra: torch.Tensor) -> torch.Tensor:
    """Sum every rank's .grad of `params` and the vector `extra` in ONE flat all-reduce; the summed
    gradients are written back into .grad (a rank that had no rows contributes zeros); returns the
    summed `extra` (on extra's device). At world 1: nothing happens, `extra` comes back."""
    if not _active:
        return extra
    device = _device()  # the buffer lives where the backend reduces (NCCL: this rank's GPU)
    grads = [p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in params]
    flat = torch.cat([*[g.to(device, extra.dtype) for g in grads], extra.reshape(-1).to(device)])
    _collective(dist.all_reduce, flat)
    offset = 0
    for p in params:
        n = p.numel()
        g = flat[offset:offset + n].view_as(p).to(p.device, p.dtype)
        p.grad = g if p.grad is None else p.grad.copy_(g)
        offset += n
    return flat[offset:].view_as(extra).to(extra.device)


def broadcast_params(params) -> None:
    """Rank 0's values of `params` on every rank (replicas start identical whatever each rank's RNG did)."""
    if not _active:
        return
    with torch.no_grad():
        for p in params:
            data = p.data
            y = data.to(_device())
            _collective(dist.broadcast, y, 0)
            if y is not data:
                data.copy_(y)


def mean_metrics(values: dict[str, torch.Tensor], summed: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Per-rank metrics over equal-sized shards -> the global ones in one all-reduce: means averaged,
    the keys in `summed` (counts) summed. The values may sit on different devices (a host-side count
    beside GPU statistics): they are stacked on the backend's device, where the results stay."""
    if not _active:
        return values
    keys, device = list(values), _device()
    mean = all_mean(torch.stack([values[k].detach().float().reshape(()).to(device) for k in keys]))
    return {k: mean[i] * (_world.size if k in summed else 1) for i, k in enumerate(keys)}


def reseed(seed: int) -> None:
    """The process-global RNGs (python, numpy, torch: user code's) seeded per rank, seed + rank; the
    trainers' own generators stay seeded alike on all ranks. Nothing at world 1 (bit-identical runs)."""
    if _world.size > 1:
        seed_everything(seed + _world.rank)


def describe(batch: int, unit: str) -> str:
    """The launch, for the head of a run dir's config.yaml."""
    return f"world_size: {_world.size}, per-rank batch: {batch // _world.size} {unit} (global {batch})"


def barrier() -> None:
    if _active:
        _collective(dist.barrier)


def checked(fn, *args):
    """`fn(*args)` (a rank's collective-free work), then an error flag all-reduced: when any rank raised,
    every rank raises — the failing rank its own exception (its traceback and the run guard's note stay
    its own), the others `RankFailed` with the failing rank's one line (`RankBadInput` when that was bad
    input: every rank then exits 2, the failing rank's code) — so rank 0 prints one line that names the
    rank and the cause. A stop request (SIGTERM inside a user call) on any rank stops all."""
    if not _active:
        return fn(*args)
    result, error = None, None
    try:
        result = fn(*args)
    except (Exception, StopRequested) as e:  # re-raised below, after the other ranks know
        error = e
    kind = torch.zeros(_world.size, device=_device())  # per rank: 0 ok, 1 stop requested, 2 raised
    kind[_world.rank] = 0 if error is None else 1 if isinstance(error, StopRequested) else 2
    all_sum(kind)
    if not kind.any():
        return result
    if kind.max() == 1:
        raise error if error is not None else StopRequested("SIGTERM")
    first = int((kind == 2).nonzero()[0])
    failure = [_describe(error) if first == _world.rank else None]  # (exit code, "rank r: ...")
    _collective(dist.broadcast_object_list, failure, first)
    global _agreed_failure
    _agreed_failure = True
    if error is not None and not isinstance(error, StopRequested):
        error.ppoforge_shared = True
        error.ppoforge_rank = _world.rank
        raise error
    code, line = failure[0]
    raise RankBadInput(line) if code == EXIT_USER else RankFailed(line)


def _describe(e: BaseException) -> tuple[int, str]:
    """(exit code, the failing rank's line) of this rank's exception."""
    code, line = classify(e)
    return code, f"rank {_world.rank}: {line}"


def _device() -> torch.device:
    """Where small flag tensors live: NCCL needs them on this rank's GPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_LEFT_GROUPS: list = []  # forced one-process groups left by `finish`, never destroyed (see there)


def finish(code: int) -> None:
    """The end of a torchrun worker (cli.main): after a run that succeeded, or failed in a way `checked`
    made every rank know of, wait for the other ranks (none leaves while another still works), then exit
    with `code` without running the process group's destructor — torch 2.6's gloo one can deadlock joining
    its threads once a peer has left (seen here: rank 1 stuck in ~ProcessGroupGloo after rank 0 exited);
    the group dies with the process. Every file a trainer writes is closed (and fsynced) by then. Nothing
    at world 1; the forced one-process group (PPOFORGE_FORCE_COLLECTIVES) has no peer to wait for and is
    simply left, so the process returns `code` as at world 1."""
    global _active
    if not _active or not dist.is_initialized():
        return
    if _world.size == 1:
        # torch 2.6's ~ProcessGroupGloo can deadlock joining its threads even in a one-process group (seen
        # in CI): the group is deregistered but kept alive, idle, so its destructor never runs
        _LEFT_GROUPS.append(dist.distributed_c10d._get_default_group())
        dist.destroy_process_group()
        _active = False
        return
    if code == 0 or _agreed_failure:
        # after a shared failure the first rank out made torchrun SIGTERM the others, rank 0 perhaps
        # still writing its checkpoint and its line (seen on torch 2.6: rank 0's exit code lost)
        try:
            barrier()
        except DistTimeout:
            code = code or 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


