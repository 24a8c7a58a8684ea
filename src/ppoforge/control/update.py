"""The PPO update for control: epochs of shuffled minibatches, one optimizer step per minibatch.

`ppo_update` does not know how a minibatch's gradients are made: it calls a `MinibatchStep`, chosen
once by `make_step` — autograd (any device and precision), or on CPU in fp32 the hand-derived numpy
gradients of `handgrad.py` (tested equal to autograd). Shuffling, the clipping rule, the optimizer
and the diagnostics are the same on both. Under torchrun (autograd only) each rank's minibatch is its
part of the global one: the advantage normalization uses all ranks' statistics, each rank's mean loss
is weighted by its share of the global minibatch, and one all-reduce sums the gradients and stats.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from ppoforge.control.agent import ActorCritic
from ppoforge.control.config import ControlConfig
from ppoforge.control.handgrad import HandGradStep
from ppoforge.core.losses import policy_loss, value_loss
from ppoforge.core.stats import global_mean_var
from ppoforge.runtime import distributed
from ppoforge.runtime.precision import Precision
from ppoforge.runtime.resilience import NonFiniteGuard


class UpdateStats(NamedTuple):
    """Diagnostics of an update: the mean over the last epoch's minibatches (logged as `losses/<name>`).
    A step returns them as a (6,) tensor or array in this order; building it from this tuple by keyword
    keeps every producer in the one order."""

    policy_loss: float
    value_loss: float
    entropy: float
    approx_kl: float      # k3 estimator of KL(old || new) on the minibatch
    clipfrac: float       # share of samples where the ratio left [1 - eps, 1 + eps]
    old_approx_kl: float  # mean(old logp - new logp), CleanRL's "old_approx_kl"


# (minibatch columns, with_stats) -> the UpdateStats vector, or None when not asked
MinibatchStep = Callable[[dict[str, torch.Tensor], bool], object]


def ppo_update(step: MinibatchStep, batch: dict[str, torch.Tensor], cfg: ControlConfig) -> UpdateStats:
    """`update_epochs` passes of shuffled minibatches (stopping early past `target_kl`)."""
    n = batch["obs"].shape[0]
    for epoch in range(cfg.update_epochs):
        # Diagnostics only where they are read: the logged last epoch, or every epoch for target_kl.
        with_stats = cfg.target_kl is not None or epoch == cfg.update_epochs - 1
        stats = []
        perm = torch.randperm(n, device=batch["obs"].device)
        # Shuffle once per epoch, then take contiguous views: 6 gathers an epoch instead of 6 a minibatch.
        columns = {k: v[perm].tensor_split(cfg.num_minibatches) for k, v in batch.items()}
        for i in range(cfg.num_minibatches):
            mb_stats = step({k: v[i] for k, v in columns.items()}, with_stats)
            if with_stats:
                stats.append(mb_stats)  # a tensor on the agent's device (hand gradients: the CPU)
        if with_stats:
            mean = UpdateStats(*torch.stack(stats).mean(0).tolist())  # one host sync per epoch
            if cfg.target_kl is not None and mean.approx_kl > cfg.target_kl:
                break
    return mean


def autograd_step(agent: ActorCritic, optimizer, precision: Precision, cfg: ControlConfig,
                  guard: NonFiniteGuard) -> MinibatchStep:
    params = [p for group in optimizer.param_groups for p in group["params"]]

    def step(mb: dict[str, torch.Tensor], with_stats: bool) -> torch.Tensor | None:
        """One minibatch: loss, backward, clip, Adam."""
        with precision.autocast():
            logp, entropy, values = agent.evaluate(mb["obs"], mb["actions"])
        adv, share = mb["adv"], _share(mb["adv"])  # share: this rank's part of the global minibatch
        if cfg.norm_adv and (share is not None or adv.numel() > 1):  # one process sums as the ranks do
            mean, var = global_mean_var(adv, None, distributed.all_sum)
            adv = (adv - mean) / (var.sqrt() + 1e-8)
        want = with_stats or share is not None  # under torchrun the stats ride along in the all-reduce
        pg_loss, pg_stats = policy_loss(logp, mb["logp"], adv, cfg.clip_coef, with_stats=want)
        v_loss, _ = value_loss(values, mb["values"], mb["ret"], cfg.clip_coef if cfg.clip_vloss else None,
                               with_stats=False)
        ent = entropy.mean()
        loss = pg_loss - cfg.ent_coef * ent + cfg.vf_coef * v_loss
        optimizer.zero_grad(set_to_none=True)
        stats = torch.stack(UpdateStats(
            policy_loss=pg_loss.detach(), value_loss=v_loss.detach(), entropy=ent.detach(),
            approx_kl=pg_stats["approx_kl"], clipfrac=pg_stats["clipfrac"],
            old_approx_kl=(mb["logp"] - logp.detach()).mean())) if want else None
        total = loss.detach()
        if share is not None:  # the global minibatch's mean loss, stats and gradient: sums of the shares
            precision.backward(loss * share)
            summed = distributed.all_reduce_grads(params, torch.cat([total.reshape(1), stats.float()]) * share)
            total, stats = summed[0], summed[1:]
        else:
            precision.backward(loss)
        norm = precision.clip(optimizer, params, cfg.max_grad_norm)
        precision.apply(optimizer, skip=not guard.step_ok(total, norm, precision.scaler is not None))
        return stats if with_stats else None

    return step


def _share(x: torch.Tensor) -> torch.Tensor | None:
    """This rank's rows / the global minibatch's rows (all-reduced); None at world 1."""
    if not distributed.collectives():
        return None
    n = distributed.all_sum(torch.tensor([float(x.shape[0])], device=x.device))[0]
    return x.shape[0] / n


def handgrad_step(agent: ActorCritic, optimizer, cfg: ControlConfig, guard: NonFiniteGuard) -> MinibatchStep:
    grads = HandGradStep(agent, cfg.clip_coef, cfg.clip_vloss, cfg.ent_coef, cfg.vf_coef, cfg.norm_adv)

    def step(mb: dict[str, torch.Tensor], with_stats: bool):
        """The same minibatch step with hand-derived gradients, on numpy views of the CPU minibatch (a
        non-finite loss makes a non-finite gradient norm: the guard reads the norm)."""
        stats = grads(*(mb[k].numpy() for k in ("obs", "actions", "logp", "values", "adv", "ret")), with_stats)
        norm = grads.clip_grad_norm(cfg.max_grad_norm)
        if guard.step_ok(0.0, norm):
            optimizer.step()
        return None if stats is None else torch.tensor(UpdateStats(**stats), dtype=torch.float64)  # cpu: numpy path

    return step


def make_step(agent: ActorCritic, optimizer, precision: Precision, cfg: ControlConfig,
              guard: NonFiniteGuard) -> MinibatchStep:
    """The hand-derived gradients for an fp32 agent on CPU (unless `hand_gradients` is false), else autograd.
    Either way a step whose loss or gradient norm is not finite is skipped (`guard`)."""
    on_cpu = next(agent.parameters()).device.type == "cpu"
    if cfg.hand_gradients and on_cpu and precision.name == "fp32" and not distributed.collectives():
        return handgrad_step(agent, optimizer, cfg, guard)
    return autograd_step(agent, optimizer, precision, cfg, guard)
