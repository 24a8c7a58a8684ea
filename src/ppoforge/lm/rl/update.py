"""The PPO update of one rollout: `ppo_epochs` x shuffled mini-batches x accumulated micro-batches, one
optimizer step per mini-batch, on the policy loss `policy_loss` names (ppo, gspo, cispo: core/policy_losses.py).

Each micro-batch's loss is weighted by its share of the mini-batch's loss units (`loss_agg`: tokens or
sequences, `core/accumulation.py`), counted once per mini-batch over every rank, so that gradient
accumulation — and any split of a mini-batch over ranks or micro-batches, an out-of-memory halving
included — gives exactly the mini-batch's gradient. Loss stats are weighted by the loss units, the
other stats by the tokens. A step whose loss or gradient norm is not finite is skipped (the guard counts
it). Under torchrun the gradients are all-reduced once per step; with FSDP2 (`sharded`) FSDP reduces them
in backward and every rank trains an equal slice of each mini-batch of the gathered rollout.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ppoforge.core.accumulation import loss_aggregation, token_share, unit_share
from ppoforge.core.kl import kl_penalty
from ppoforge.core.losses import value_loss
from ppoforge.core.policy_losses import POLICY_LOSSES, truncated_is_weights, weighted_reduce
from ppoforge.core.stats import masked_mean
from ppoforge.lm.models.layouts import Layout
from ppoforge.lm.models.logprobs import head_logprobs
from ppoforge.lm.models.parts import head_size
from ppoforge.lm.models.rows import RowPlan, unit_order
from ppoforge.lm.rl.config import RLHFConfig
from ppoforge.lm.rl.rollout import Rollout
from ppoforge.runtime import distributed
from ppoforge.runtime.oom import retry_halving
from ppoforge.runtime.precision import Precision
from ppoforge.runtime.resilience import NonFiniteGuard


class PPOUpdate:
    """Call it on a rollout with the optimizer and the KL coefficient: the update's mean stats.
    `on_step` runs before each optimizer step (the trainer's "has this update stepped" flag for RunGuard)."""

    def __init__(self, cfg: RLHFConfig, layout: Layout, precision: Precision, params: list, guard: NonFiniteGuard,
                 generator: torch.Generator, my_rows: slice, on_step: Callable[[], None], plan: RowPlan | None = None):
        self.cfg, self.layout, self.precision, self.params, self.guard = cfg, layout, precision, params, guard
        self.plan = plan or RowPlan()  # the rows the forwards run: shared-prefix units of k rows, or padded (k = 1)
        self.gen, self.my_rows, self.on_step = generator, my_rows, on_step
        self.world, self.sharded = distributed.world(), layout.sharded
        self.loss_keys, self.token_keys = cfg.stat_keys
        self.stat_names = (*self.loss_keys, *self.token_keys, "policy/grad_norm")  # what an update returns
        # (reduce, units) of every loss term; seq_sum_norm's constant is the most policy tokens a row can have
        self.agg = loss_aggregation(cfg.aggregation, cfg.max_new_tokens * cfg.max_turns)
        self.policy_loss = POLICY_LOSSES[cfg.policy_loss]  # ppo, gspo or cispo (core/policy_losses.py)
        self.micro_batch = cfg.micro_batch_size  # halved on out-of-memory
        self.unit = 1  # the last update's shared-prefix unit size (1: padded rows), perf/shared_prefix_unit
        self.vocab = head_size(layout.policy_model)
        # a mini-batch whose every advantage is 0 under a policy-gradient-only loss has a 0 gradient: no step
        self.skip_flat = cfg.skip_flat_rollouts and cfg.loss_is_policy_gradient_only
        self.flat_steps = 0  # such mini-batches skipped over the run: guard/flat_steps_skipped

    def __call__(self, b: Rollout, optimizer: torch.optim.Optimizer, beta: float) -> dict[str, torch.Tensor]:
        """ppo_epochs x shuffled mini-batches x accumulated micro-batches; loss-unit-weighted loss stats,
        token-weighted other stats. A step whose loss or gradient norm is not finite is skipped (the guard
        counts it)."""
        cfg, keys = self.cfg, self.loss_keys + self.token_keys
        totals, n_mini = torch.zeros(1 + len(keys), device=b.resp.device), 0
        norms = torch.zeros((), device=b.resp.device)  # the gradient norms before clipping, TRL's grad_norm
        k = self.unit = self.plan.k  # the rollout's, as the scoring passes ran it: old log-probs match
        for _epoch in range(cfg.ppo_epochs):
            order = torch.randperm(cfg.rollout_size, generator=self.gen, device=self.gen.device).to(b.resp.device)
            for mb in unit_order(order, k).split(cfg.mini_batch_size):  # whole units in every micro-batch
                mb = self._own_rows(mb)
                if self._flat(b, mb):  # AdamW would step on momentum alone: the failure skip_flat_rollouts stops
                    self.flat_steps += 1
                    continue
                sums = self._mini_batch_gradients(b, mb, optimizer, beta)  # (total loss, *stats in `keys` order)
                # one all-reduce per step (sharded: of the stats alone, FSDP reduced the gradients in backward)
                sums = (distributed.all_sum(sums) if self.sharded else
                        distributed.all_reduce_grads(self.params, sums))
                norm = self.precision.clip(optimizer, self.params, cfg.max_grad_norm)
                ok = self.guard.step_ok(sums[0], norm, self.precision.scaler is not None)
                self.on_step()
                self.precision.apply(optimizer, skip=not ok)
                totals += sums if ok else 0
                norms += norm.float() if ok else 0
                n_mini += ok
        means = [*(totals / max(n_mini, 1))[1:], norms / max(n_mini, 1)]
        return dict(zip(self.stat_names, means, strict=True))

    def _flat(self, b: Rollout, mb: torch.Tensor) -> bool:
        """`skip_flat_rollouts` per mini-batch: every advantage of its rows on every rank is 0 (one all-reduce)."""
        if not self.skip_flat:
            return False
        return not bool(distributed.all_sum((b.adv[mb] * b.resp_mask[mb]).abs().sum()).item())

    def _own_rows(self, mb: torch.Tensor) -> torch.Tensor:
        """The rows of global mini-batch `mb` this rank holds, as indices into its rollout (any number,
        none included: the gradient all-reduce and the global unit count make the step the global one)."""
        if self.world.size == 1:
            return mb
        if self.sharded:  # `b` is the gathered rollout; every rank takes an equal slice (FSDP's lockstep)
            return mb.tensor_split(self.world.size)[self.world.rank]
        return mb[(mb >= self.my_rows.start) & (mb < self.my_rows.stop)] - self.my_rows.start

    def _mini_batch_gradients(self, b: Rollout, mb: torch.Tensor, optimizer: torch.optim.Optimizer,
                              beta: float) -> torch.Tensor:
        """The mini-batch's gradients in .grad, accumulated over micro-batches of `micro_batch` rows (halved
        and redone on out-of-memory: the shares keep the sum the same); its weighted loss and stats. The
        loss's normalizer (the mini-batch's tokens or sequences, `loss_agg`) is counted once, here."""
        mb_mask = b.resp_mask[mb]
        mb_units, mb_tokens = self.agg.units(mb_mask), mb_mask.sum()
        if distributed.collectives():  # all ranks' units, before any backward: the single-process loss weights
            mb_units, mb_tokens = distributed.all_sum(torch.stack([mb_units, mb_tokens]))

        def attempt(n: int) -> torch.Tensor:
            optimizer.zero_grad(set_to_none=True)
            if mb.numel() == 0:  # this rank holds none of the mini-batch's rows: its gradient is 0
                return b.resp_mask.new_zeros(1 + len(self.loss_keys) + len(self.token_keys))
            with self.precision.weight_cache():
                return sum(self._micro_batch(b, micro, mb_units, mb_tokens, beta) for micro in mb.split(n))

        totals, self.micro_batch = retry_halving(attempt, self.micro_batch, "micro-batch", retry=not self.sharded)
        return totals

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with self.precision.autocast():
            return self.layout.logits(hidden)

    def _micro_batch(self, b: Rollout, micro: torch.Tensor, mb_units: torch.Tensor, mb_tokens: torch.Tensor,
                     beta: float) -> torch.Tensor:
        """Forward/backward of rows `micro`, its loss weighted by its share of the mini-batch's loss units;
        (its weighted total loss, its weighted stats)."""
        cfg, n_resp, m, reduce = self.cfg, b.resp.shape[1], b.resp_mask[micro], self.agg.reduce
        with self.precision.autocast():
            hidden, values = self.layout.forward(self.plan.rows(b.ids[micro], b.mask[micro], n_resp))
        with self.precision.full_precision():
            logp, entropy = head_logprobs(self._logits, hidden, b.resp[micro], self.vocab, cfg.temperature)
            old_logp, adv = (logp.detach() if cfg.on_policy else b.logp[micro]), b.adv[micro]
            pg_reduce = reduce
            if cfg.vllm_is_correction and b.behaviour_logp is not None:  # rollout correction (TIS)
                pg_reduce = weighted_reduce(reduce, truncated_is_weights(b.logp[micro], b.behaviour_logp[micro],
                                                                         cfg.vllm_is_cap, m))
            pg_loss, pg = self.policy_loss(logp, old_logp, adv, cfg.clip, m, cfg.clip_high, pg_reduce)
            ent = masked_mean(entropy, m)
            loss, stats = pg_loss, {"loss/policy_avg": pg_loss.detach(), "policy/entropy_avg": ent.detach(),
                                    "policy/approxkl_avg": pg["approx_kl"], "policy/clipfrac_avg": pg["clipfrac"],
                                    "val/ratio": pg["ratio"],
                                    **{f"clip_ratio/{k}_mean": pg[k] for k in ("low", "high", "region")}}
            if values is not None:  # GAE's critic
                v_loss, vs = value_loss(values, b.values[micro], b.ret[micro], cfg.value_clip, m, reduce=reduce)
                loss = loss + cfg.vf_coef * v_loss
                stats |= {"loss/value_avg": v_loss.detach(), "val/clipfrac_avg": vs["clipfrac"]}
            if cfg.kl_loss:  # GRPO's: beta * KL_t of the current policy, aggregated like the policy loss
                kl = kl_penalty(logp, b.ref_logp[micro], cfg.kl_estimator, m)  # 0 on padding, gradient too
                loss = loss + beta * reduce(kl, m)
                stats["kl"] = masked_mean(kl.detach(), m)
            if cfg.ent_coef:  # else entropy stays out of the graph: no (T, V) work for it in backward
                loss = loss - cfg.ent_coef * reduce(entropy, m)
            share = unit_share(self.agg.units(m), mb_units)  # the accumulated gradient is the mini-batch's loss
            # FSDP averages the ranks' gradients: x world makes that the sum, the all-reduce's
            self.precision.backward(loss * share * (self.world.size if self.sharded else 1))
        tokens = token_share(m, mb_tokens)
        return torch.cat([share * torch.stack([loss.detach(), *(stats[k] for k in self.loss_keys)]),
                          tokens * torch.stack([stats[k] for k in self.token_keys])])
