"""The loop SFT and reward-model training share: epochs of shuffled examples, one optimizer step per
batch, gradient accumulation over micro-batches, evaluation, checkpoints, exact resume.

An objective (`sft.SFTObjective`: the completion tokens' NLL; `reward_model.RewardObjective`: the
Bradley-Terry loss of preference pairs) owns the model, the examples and the loss; this module owns
everything around them, composed from the shared pieces: precision (`runtime/precision`), token-share
accumulation (`core/accumulation`: a micro-batch's mean loss is weighted by its share of the batch's
loss units — tokens for SFT, pairs for reward models — so any split gives the batch's gradient), the
non-finite guard, OOM halving of the micro-batch, `RunGuard` checkpoints on failure, `train_loop`
(signals, periodic checkpoints) and the run state a checkpoint holds (`runtime/runstate`). The data
order is a permutation per epoch seeded by (seed, epoch) and a cursor: a resumed run sees exactly the
batches the uninterrupted one would.
Under torchrun every rank draws the same global batch and trains its slice of it; the loss units are
counted over the whole batch (every rank holds all items, so no collective is needed for it), and the
gradients, loss and stats are all-reduced once per step. Evaluation is sharded the same way (the
objective combines the ranks' sums); every run-dir write is rank 0's. With `fsdp` (the full layout
sharded by FSDP2, `Objective.shard`) FSDP reduces the gradients, every rank runs as many micro-batches
as the rank with the most items (FSDP's forward and backward are collectives), and every rank
evaluates every held-out item.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from ppoforge.config import config_to_dict
from ppoforge.core.accumulation import token_share
from ppoforge.lm.models.loading import load_tokenizer, prepare_tokenizer
from ppoforge.lm.models.parts import EXPORT_DIR, export_dtype
from ppoforge.lm.supervised.config import SupervisedConfig
from ppoforge.lm.supervised.examples import read_rows
from ppoforge.runtime import distributed, runloop, runstate, trust
from ppoforge.runtime.checkpoint import resume_from, seed_everything, sharded_writer
from ppoforge.runtime.device import resolve_device
from ppoforge.runtime.metrics import open_run_dir, write_summary
from ppoforge.runtime.oom import retry_halving
from ppoforge.runtime.precision import make_precision, resolve_precision
from ppoforge.runtime.progress import Progress
from ppoforge.runtime.resilience import NonFiniteGuard, RunGuard

CHECKPOINT = "checkpoint.pt"
SHARDED_CHECKPOINT = "checkpoint"  # with `fsdp`: a torch.distributed.checkpoint directory (runtime/fsdp.py)


class Objective(Protocol):
    """What the shared loop optimises, and what it needs of it: SFT's NLL (`sft.SFTObjective`) or the
    reward model's Bradley-Terry loss (`reward_model.RewardObjective`), with the model, its examples and
    its export."""

    name: str             # "sft" / "reward": the `ppoforge train <name>` command
    train_items: list     # examples (or packed rows / pairs), in file order
    eval_items: list
    device: torch.device

    def trainable(self) -> list[tuple[str, torch.nn.Parameter]]: ...

    def size(self, item) -> int: ...  # tokens one item puts in a padded row (micro-batches group similar sizes)

    def units(self, items: list) -> torch.Tensor: ...  # loss units in items (tokens, pairs): the mean's divisor

    def loss(self, items: list) -> tuple[torch.Tensor, dict]: ...  # mean loss over items' units, detached stats
    #   under the names in `stat_keys`

    stat_keys: tuple[str, ...]  # the stats `loss` returns: the fixed layout of the per-step all-reduce, the same
    #   on every rank whatever its items (none included)

    def evaluate(self, items: list) -> dict: ...  # eval/ metrics over this rank's slice of the held-out items,
    #   combined over the ranks (the same on every rank); rank 0 writes what goes into the run dir

    def export(self, path: Path, kind: str = "adapter", dtype: torch.dtype | None = None) -> Path: ...  # `parts.export`
    #   (rank 0's call; every rank's when sharded: it gathers the weights)

    sharded: bool  # FSDP2: the model's weights are shards (`shard`, the full layout with `fsdp` under torchrun)

    def shard(self, precision: str) -> None: ...  # FSDP2 groups over the ranks; trainable() then the shards

    def checkpoint_module(self) -> torch.nn.Module: ...  # the trained model under names torch.distributed.
    #   checkpoint keeps whatever the world size

    def release(self) -> None: ...  # free what a no-grad pass left gathered


class SupervisedTrainer:
    def __init__(self, cfg: SupervisedConfig, run_dir: Path, objective: Objective):
        self.cfg, self.run_dir, self.objective = cfg, Path(distributed.rank0_value(str(run_dir))), objective
        self.world = distributed.world()  # joined in `prepare`, before the objective built its model
        distributed.shard(cfg.batch_size, "batch_size")  # a global batch that divides by the ranks
        # FSDP2 (`fsdp` under torchrun): FSDP casts the weights (bf16) in place of autocast, reduces the
        # gradients itself, and every rank runs every micro-batch's forward/backward (`_gradients`)
        self.sharded = cfg.fsdp and self.world.size > 1
        if self.sharded:
            distributed.broadcast_params([p for _, p in objective.trainable()])
            objective.shard(resolve_precision(cfg.precision, objective.device))
        self.precision = make_precision("fp32" if self.sharded else cfg.precision, objective.device)
        self.params = [p for _, p in objective.trainable()]
        if not self.sharded:
            distributed.broadcast_params(self.params)
        distributed.reseed(cfg.seed)
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                                           fused=objective.device.type in ("cpu", "cuda"))
        n = len(objective.train_items)
        self.steps_per_epoch = math.ceil(n / cfg.batch_size)
        self.total_steps = cfg.max_steps or max(1, round(cfg.epochs * self.steps_per_epoch))  # max_steps: TRL's
        self.warmup = round(cfg.warmup_ratio * self.total_steps)
        self.guard = NonFiniteGuard(cfg.nonfinite_patience, cfg.nonfinite_action)
        self.update = 0  # completed updates (optimizer steps)
        self.cursor = 0  # examples consumed: the data position, an epoch-wise shuffled stream
        self.lr_scale = 1.0  # lowered by each non-finite rollback
        self.optimizing = False  # has the current update stepped the optimizer (see runtime/resilience.py)
        self.micro_batch = cfg.micro_batch_size
        self._order = (-1, None)  # (data epoch, its permutation), derived from (seed, epoch) on demand
        self.checkpoint = self.run_dir / (SHARDED_CHECKPOINT if cfg.fsdp else CHECKPOINT)
        self.sharded_module = objective.checkpoint_module() if cfg.fsdp else None  # what `checkpoint/` holds
        self.run_guard = RunGuard(self, self.checkpoint, trust.resume_command(objective.name, run_dir, cfg),
                                  write=sharded_writer(self.checkpoint, self.sharded_module, self.optimizer)
                                  if cfg.fsdp else None)

    # ---- checkpoint (runtime/runstate.py) ---------------------------------------------------------
    def state_dict(self) -> dict:
        """The whole state; with `fsdp` all but the weights and optimizer, which `sharded_writer` saves."""
        return {**runstate.weights_state(self.objective.trainable(), self.optimizer, self.cfg.fsdp),
                "precision": self.precision.state_dict(), "config": config_to_dict(self.cfg), **self.step_state()}

    def step_state(self) -> dict:
        """What an update changes besides the weights and the optimizer: the run state and the data cursor."""
        return {**runstate.step_state(self), "cursor": self.cursor}

    def resume(self) -> None:
        """Continue from the run dir's checkpoint, whatever world size wrote it."""
        resume_from(self, self.checkpoint, self.sharded_module)

    def load(self, state: dict) -> None:
        """Restore `state_dict()`'s state (with `fsdp` the weights are already loaded: `resume_from`)."""
        runstate.load_weights(state, self.objective.trainable(), self.optimizer)
        self.precision.load_state_dict(state["precision"])
        runstate.load_step_state(self, state)
        self.cursor = state["cursor"]

    def rollback(self) -> None:
        runstate.rollback(self, [self.run_dir / "metrics.jsonl"])

    # ---- one step ----------------------------------------------------------------------------------
    def next_batch(self) -> list:
        """The next batch_size items of an epoch-wise shuffled stream (permutation seeded by (seed, epoch));
        an epoch's last batch is the partial rest of it."""
        n, epoch = len(self.objective.train_items), self.cursor // len(self.objective.train_items)
        if self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.cfg.seed, epoch]).permutation(n))
        start = self.cursor % n
        idx = self._order[1][start:start + self.cfg.batch_size]
        self.cursor += len(idx)
        return [self.objective.train_items[i] for i in idx]

    def learning_rate(self) -> float:
        """Linear warm-up over the first `warmup` steps, then linear decay to 0 at the last step."""
        step = self.update
        if step < self.warmup:
            return self.cfg.learning_rate * self.lr_scale * (step + 1) / self.warmup
        left = (self.total_steps - step) / max(1, self.total_steps - self.warmup)
        return self.cfg.learning_rate * self.lr_scale * max(0.0, left)

    def _gradients(self, items: list) -> tuple[torch.Tensor, dict]:
        """The batch's gradients in .grad (micro-batches of `micro_batch` items, halved and redone on OOM);
        the batch-mean loss and stats. Micro-batches take the items in order of size, so each pads to
        less; the token-share weights make the sum the batch's gradient whatever the split."""
        total = self.objective.units(items)  # the whole (global) batch's units: the single-process weights
        mine = sorted(items[distributed.uneven_shard(len(items))], key=self.objective.size)  # this rank's
        # sharded, every rank runs as many micro-batches as the rank with the most items (FSDP's forward and
        # backward are collectives); a rank's extra ones are a real item weighted 0
        most = math.ceil(len(items) / self.world.size) if self.sharded else len(mine)  # uneven_shard's largest
        scale = self.world.size if self.sharded else 1  # FSDP averages the ranks' gradients: x world sums them

        def attempt(n: int) -> tuple[torch.Tensor, dict]:
            self.optimizer.zero_grad(set_to_none=True)
            loss_sum, stats = torch.zeros((), device=self.objective.device), {}
            with self.precision.weight_cache():
                for s in range(0, math.ceil(most / n) * n, n):
                    micro = mine[s:s + n]
                    share = token_share(self.objective.units(micro).reshape(1), total) if micro else 0.0
                    with self.precision.autocast():
                        loss, mb_stats = self.objective.loss(micro or items[:1])
                    self.precision.backward(loss * share * scale)
                    loss_sum += share * loss.detach()
                    for k, v in mb_stats.items():
                        stats[k] = stats.get(k, 0) + share * v
            return loss_sum, stats

        result, self.micro_batch = retry_halving(attempt, self.micro_batch, "micro-batch", retry=not self.sharded)
        return result

    def _all_reduced(self, loss: torch.Tensor, stats: dict) -> tuple[torch.Tensor, dict]:
        """The ranks' gradients, loss and stats summed (each already weighted by its share of the batch)
        in one all-reduce; as they are at world 1."""
        if not distributed.collectives():
            return loss, stats
        keys = self.objective.stat_keys  # declared, not read from this rank's data: a rank without items has none
        zero = torch.zeros((), device=self.objective.device)
        extra = torch.stack([loss.reshape(()), *(torch.as_tensor(stats.get(k, zero), device=zero.device)
                                                 .reshape(()).to(zero) for k in keys)]).float()
        # one all-reduce (sharded: of the loss and stats alone, FSDP reduced the gradients in backward)
        summed = distributed.all_sum(extra) if self.sharded else distributed.all_reduce_grads(self.params, extra)
        return summed[0], dict(zip(keys, summed[1:], strict=True))

    def train_one_update(self) -> dict:
        start = time.perf_counter()
        lr = self.learning_rate()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        items = self.next_batch()
        loss, stats = self._all_reduced(*self._gradients(items))
        norm = self.precision.clip(self.optimizer, self.params, self.cfg.max_grad_norm)
        ok = self.guard.step_ok(loss, norm, self.precision.scaler is not None)
        self.optimizing = True
        self.precision.apply(self.optimizer, skip=not ok)
        self.update += 1
        metrics = {"train/loss": loss, "train/grad_norm": norm, **{f"train/{k}": v for k, v in stats.items()}}
        metrics = {k: float(v) for k, v in metrics.items()}
        elapsed = time.perf_counter() - start
        units = float(self.objective.units(items))
        metrics.update({"lr": lr, "epoch": self.cursor / len(self.objective.train_items), **self.guard.counts,
                        "guard/micro_batch_size": self.micro_batch, "perf/units_per_s": units / elapsed,
                        "perf/step_s": elapsed, "perf/world_size": self.world.size})
        return metrics

    # ---- the run -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def evaluate(self) -> dict:
        """The held-out metrics; under torchrun each rank scores its slice and the objective combines them."""
        items = self.objective.eval_items
        if not items:
            return {}
        with self.precision.autocast():  # sharded, every rank scores every item (FSDP's lockstep)
            metrics = self.objective.evaluate(items if self.sharded else items[distributed.uneven_shard(len(items))])
        self.objective.release()
        return metrics

    def run(self) -> dict:
        """Train to the end (or a stop signal): `open_run`, the updates with `after_update`, `finish` (the export),
        `close_run`, `summarize` (`runtime/runloop.py`; the Python API's `step()` runs them one update at a time).
        Returns the last metrics, eval included."""
        return runloop.run(self, self.total_steps, self.cfg.checkpoint_every)

    def open_run(self) -> None:
        """Before this process's first update: the run dir's config and logs, the progress bar; on a fresh run the
        evaluation before training (and, for rollbacks, a checkpoint to go back to)."""
        cfg, main = self.cfg, self.world.is_main  # rank 0 alone writes the run dir
        self.logger = open_run_dir(self.run_dir, cfg, distributed.describe(cfg.batch_size, "examples"), self.update,
                                   main=main)
        self.progress = Progress(self.total_steps, self.update, enabled=cfg.progress and main, unit="step")
        self.last: dict = {}  # the last metrics of each name: the run's result
        try:
            if self.update == 0:
                first = self.evaluate()
                self.logger.log(0, first)
                self.last.update(first)
                if cfg.nonfinite_action == "rollback":
                    self.run_guard.save()
        except BaseException:
            self.close_run()
            raise

    def after_update(self, metrics: dict) -> None:
        """The evaluation every eval_every steps and at the last, the metrics line every log_every, the progress."""
        cfg = self.cfg
        if self.update % cfg.eval_every == 0 or self.update == self.total_steps:
            metrics.update(self.evaluate())
        self.last.update(metrics)
        if self.update % cfg.log_every == 0 or self.update == self.total_steps:
            self.logger.log(self.update, metrics)
        self.progress.advance(1, loss=metrics["train/loss"], eval=metrics.get("eval/loss"))

    def finish(self) -> Path:
        """After the last step: the model exported to RUN/model (`export`, `export_dtype`); returns that folder."""
        export = self.run_dir / EXPORT_DIR
        if self.world.is_main or self.sharded:  # sharded, every rank takes part in gathering
            self.objective.export(export, self.cfg.export, export_dtype(self.cfg.export_dtype, self.precision.name))
        return export

    def close_run(self) -> None:
        self.progress.close()
        self.logger.close()

    def summarize(self, stopped: str | None, export: Path | None) -> dict:
        """summary.json (rank 0) and the run's result: the last metrics with `steps`, `stopped_by`, `export`."""
        if self.world.is_main:
            write_summary(self.run_dir, self.objective.name, self.update, "step", stopped, export, self.last)
        return {"steps": self.update, "stopped_by": stopped, "export": export, **self.last}

    def plot(self) -> None:
        """Nothing drawn: the loss curves are metrics.jsonl's and TensorBoard's (`runloop.Loop`)."""


def prepare(cfg: SupervisedConfig, tokenizer=None, model=None):
    """What an objective needs before it builds its model: threads and seeds set; (the device, the
    tokenizer: a copy of `tokenizer` (the Python API's, already loaded, for its loaded `model`), else
    `cfg.tokenizer`'s, else the model's own)."""
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    seed_everything(cfg.seed)
    device = resolve_device(cfg.device)
    distributed.init(cfg.dist_timeout, device)  # torchrun's process group (nothing at world 1)
    if tokenizer is not None:
        return device, prepare_tokenizer(tokenizer, model)
    return device, load_tokenizer(cfg.tokenizer or cfg.model, model=cfg.model,
                                  field="tokenizer" if cfg.tokenizer else "model")


def load_data(cfg: SupervisedConfig, run_dir: Path, tokenizer, build) -> tuple[list, list, list[dict], str, object]:
    """(training items, held-out items, held-out rows, the data's name, its Drops): `cfg.data` and
    `cfg.eval_data` (else the held-out share of `data`) read, each row made an item by
    `build(rows, where, tokenizer, max_length, strict)`, the rows left out reported."""
    rows, where = read_rows(cfg.data, cfg.data_split)
    if cfg.eval_data:
        train_rows, (eval_rows, eval_where) = rows, read_rows(cfg.eval_data, cfg.data_split)
    else:
        (train_rows, eval_rows), eval_where = split_eval(rows, cfg), f"{where} (held-out share)"
    train, drops = build(train_rows, where, tokenizer, cfg.max_length, cfg.strict)
    held, eval_drops = build(eval_rows, eval_where, tokenizer, cfg.max_length, cfg.strict)
    report_drops(run_dir, (drops, len(train)), (eval_drops, len(held)))
    return train, held, [row for _, row in eval_rows], where, drops


def report_drops(run_dir: Path, *drops) -> None:
    """Say on stderr and in data_report.json which rows were left out and why (rank 0)."""
    if not distributed.is_main():
        return
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / "data_report.json").write_text(json.dumps(
        [{"source": d.where, "used": used, "left_out": dict(d.counts),
          "first": {k: {"line": v[0], "detail": v[1]} for k, v in d.first.items()}} for d, used in drops],
        indent=1) + "\n")
    for d, used in drops:
        print(f"ppoforge: {d.summary(used)}", file=sys.stderr)


def split_eval(rows: list, cfg: SupervisedConfig) -> tuple[list, list]:
    """(train rows, held-out rows): the last `eval_fraction` of a seeded shuffle of the rows."""
    if cfg.eval_fraction == 0 or len(rows) < 2:
        return rows, []
    order = np.random.default_rng([cfg.seed, 12345]).permutation(len(rows))
    n_eval = max(1, round(cfg.eval_fraction * len(rows)))
    return [rows[i] for i in sorted(order[n_eval:])], [rows[i] for i in sorted(order[:n_eval])]
