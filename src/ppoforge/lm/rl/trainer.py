"""PPO for causal LMs (RLHF), top to bottom: collect -> score -> advantages -> update -> log -> checkpoint.

The recipe is Ziegler et al. 2019 as TRL's PPOTrainer implements it: per-token reward = -beta * KL to
the frozen reference on every response token plus the reward function's score on the last one; GAE
over response tokens (gamma 1, lambda 0.95); advantages whitened over the batch's real tokens; clipped
surrogate and clipped value loss; fixed or adaptive beta; old log-probs are the sampler's, as in TRL —
but only once a check on the first rollout found them bit-identical to the update's own forward
(`old_logprobs: auto`, `lm/rl/passes.py`), else recomputed: a ratio that is not exactly 1 before any
update is a bias. Deliberate differences from TRL: the model layouts (`lm/models/layouts.py`: LoRA with
the reference = adapters off, no second copy), our own KV-cache decode loop (which also hands over the
values when the value head reads the policy's trunk), and micro-batch losses weighted by their share of
the mini-batch's tokens (`core/accumulation.py`, `lm/rl/update.py`) so that gradient accumulation gives
exactly the mini-batch gradient.
The trainer composes the pieces, each chosen once at construction: the collector (`lm/rl/collect.py`:
single-turn sampling, or multi-turn episodes against an environment), the estimator (`lm/rl/estimators.py`:
GAE, or a critic-free one — grpo, rloo, reinforce_pp, reinforce_pp_baseline — that samples each prompt
`num_generations` times in a row, computes the advantages from the whole rollout's groups before the
mini-batch shuffle and has no value head and no value loss), the rollout's passes (`lm/rl/passes.py`) and
the PPO update (`lm/rl/update.py`: the KL in the loss with `kl_in: loss`, GRPO's; `loss_agg`; DAPO's
`clip_high`) and the rollout's rounds (`lm/rl/dynamic.py`: one, or DAPO's dynamic sampling, which refills
the batch's groups whose scores all agree); DAPO's overlong shaping and filtering are `core/dapo.py`'s.
`kl_coef: 0` skips the reference pass. Held-out evaluation: `lm/rl/heldout.py`.
Under torchrun (`runtime/distributed.py`) each rank samples and scores its contiguous slice of the
global batch's prompts (whole groups) with its slice of the globally drawn uniforms, takes each
mini-batch's rows it owns from one global permutation, and all-reduces the gradients once per optimizer
step: any world size trains the single-process run's numbers. With `fsdp` (the full layout sharded by
FSDP2, `FullLayout.shard`) the rollout is all-gathered after the advantages and every rank trains an equal
slice of each mini-batch (FSDP's forward and backward are collectives), FSDP reduces the gradients, the
decoder reads the policy gathered whole, and checkpoints are sharded (`checkpoint/`, any world size).
Left out: reward-model training, value-head warm-up, per-token entropy
regularization beyond `ent_coef`, dynamic sampling under torchrun.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from ppoforge.config import config_to_dict
from ppoforge.core.dapo import finished_mask, overlong_penalty
from ppoforge.core.kl import AdaptiveKLController, FixedKLController
from ppoforge.core.stats import masked
from ppoforge.errors import UserError
from ppoforge.lm.models.rows import RowPlan, attention_cost
from ppoforge.lm.rl.build import RunInputs, build_inputs
from ppoforge.lm.rl.collect import Batch, collector_for
from ppoforge.lm.rl.config import RLHFConfig
from ppoforge.lm.rl.dynamic import Drawn, rounds_for
from ppoforge.lm.rl.heldout import Heldout
from ppoforge.lm.rl.passes import RolloutPasses
from ppoforge.lm.rl.rewards import WeightedSum, term_metrics
from ppoforge.lm.rl.rollout import Rollout, gather_rollout, non_score_rewards, rollout_kl, rollout_metrics
from ppoforge.lm.rl.runlog import RunLog, TrainResult
from ppoforge.lm.rl.update import PPOUpdate
from ppoforge.runtime import distributed, rundir, runloop, runstate, trust
from ppoforge.runtime.checkpoint import resume_from, seed_everything, sharded_writer
from ppoforge.runtime.device import resolve_device
from ppoforge.runtime.resilience import CollapseGuard, NonFiniteGuard, RunGuard

CHECKPOINT = "checkpoint.pt"
SHARDED_CHECKPOINT = "checkpoint"  # with `fsdp`: a torch.distributed.checkpoint directory (runtime/fsdp.py)


class RLHFTrainer(RunLog):
    """Holds the run's state; `run()` trains until total_updates or a stop signal. Its run dir (logs,
    held-out evaluation, export, summary) is `RunLog`'s (lm/rl/runlog.py)."""

    def __init__(self, cfg: RLHFConfig, run_dir: Path, reward_fn=None, model=None, tokenizer=None):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        seed_everything(cfg.seed)
        self.world = distributed.init(cfg.dist_timeout, resolve_device(cfg.device))
        self.run_dir = Path(distributed.rank0_value(str(self.run_dir)))
        # this rank's prompts of each global batch; its rows (and uniforms' columns) of each rollout
        self.my_prompts = distributed.shard(cfg.batch_size, "batch_size")
        g = cfg.num_generations
        self.my_rows = slice(self.my_prompts.start * g, self.my_prompts.stop * g)
        self.inputs: RunInputs = build_inputs(cfg, reward_fn, model, tokenizer)  # model: the API's, loaded
        self.layout, self.tokenizer, self.precision = self.inputs.layout, self.inputs.tokenizer, self.inputs.precision
        self.params = [p for _, p in self.layout.named_trainable()]
        # FSDP2 (`fsdp` under torchrun): the trained weights are shards and FSDP reduces their gradients;
        # every rank runs every mini-batch's forward/backward (its equal slice of the gathered rollout)
        self.sharded = self.layout.sharded
        if self.sharded:
            distributed.shard(cfg.mini_batch_size, "mini_batch_size")
        else:
            distributed.broadcast_params(self.params)
        distributed.reseed(cfg.seed)
        # fused: one kernel for all tensors (~6x faster than the default on CPU for LoRA's many small ones)
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.learning_rate, eps=1e-8, weight_decay=0.0, fused=True)
        self.kl_ctl = (AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon) if cfg.kl_target
                       else FixedKLController(cfg.kl_coef))
        # the rows every forward over a rollout runs: a prompt's completions as shared-prefix units, or padded
        self.plan = RowPlan(cfg.prefix_sizes(self.world.size, self.sharded),
                            attention_cost(self.layout.policy_model.config))
        self.collector = collector_for(cfg, self.inputs)  # single-turn sampling, or episodes with an env
        self.engine = self.collector.engine  # what samples: the layout's decoder, or vLLM (synced weights)
        self.passes = self._passes(self.plan)
        self.rounds = rounds_for(cfg, self.tokenizer.pad_token_id, self.world.size)  # one, or dynamic sampling
        self.heldout = Heldout(cfg, self.inputs, self.collector)
        self.gen = torch.Generator(self.inputs.device).manual_seed(cfg.seed)
        self.update = 0   # completed updates
        self.cursor = 0   # prompts consumed: the data position, an epoch-wise shuffled stream
        self._order = (-1, None)  # (data epoch, its permutation), derived from (seed, epoch) on demand
        self.guard = NonFiniteGuard(cfg.nonfinite_patience, cfg.nonfinite_action)
        self.collapse = CollapseGuard(cfg.collapse_patience, cfg.collapse_action)
        self.lr_scale = 1.0  # lowered by each non-finite rollback
        self.optimizing = False  # has the current update stepped the optimizer (see runtime/resilience.py)
        self.checkpoint = self.run_dir / (SHARDED_CHECKPOINT if cfg.fsdp else CHECKPOINT)
        self.sharded_module = self.layout.checkpoint_module() if cfg.fsdp else None  # what `checkpoint/` holds
        self.run_guard = RunGuard(self, self.checkpoint, trust.resume_command("rlhf", self.run_dir, cfg),
                                  write=sharded_writer(self.checkpoint, self.sharded_module, self.optimizer)
                                  if cfg.fsdp else None)
        self.ppo = PPOUpdate(cfg, self.layout, self.precision, self.params, self.guard, self.gen, self.my_rows,
                             on_step=self._mark_optimizing, plan=self.plan)

    def _passes(self, plan: RowPlan) -> RolloutPasses:
        """The rollout's no-grad passes; with `cfg.on_policy` (one optimizer step per rollout) the update's
        own forward gives the old log-probs, so no policy pass."""
        cfg, exact = self.cfg, self.engine.exact
        where = f"{self.inputs.device.type} / {self.precision.name} / {self.policy_attention()} attention"
        # an engine that is never exact (vLLM): the old log-probs always from the training forward, which
        # also measures the engine's gap (rollout/logprob_mismatch_*) and feeds vllm_is_correction
        return RolloutPasses(self.layout, cfg.old_logprobs if exact else "recompute", cfg.temperature,
                             cfg.micro_batch_size, where, critic=cfg.has_critic, reference=cfg.kl_coef > 0,
                             policy=not cfg.on_policy or not exact, rows_for=plan.rows, unit=lambda: plan.k)

    # ---- checkpoint (runtime/runstate.py) ---------------------------------------------------------
    def state_dict(self) -> dict:
        """The whole state; with `fsdp` all but the weights and optimizer, which `sharded_writer` saves."""
        return {**runstate.weights_state(self.layout.named_trainable(), self.optimizer, self.cfg.fsdp),
                "precision": self.precision.state_dict(), "config": config_to_dict(self.cfg), **self.step_state()}

    def step_state(self) -> dict:
        """What an update changes besides the weights and the optimizer: the run state, the data cursor, the
        shared generator and the KL controller."""
        return {**runstate.step_state(self), "cursor": self.cursor, "generator": self.gen.get_state(),
                "kl_ctl": self.kl_ctl.state_dict(), "collapse": self.collapse.state_dict(),
                "left_out": self.inputs.left_out}

    def resume(self) -> None:
        """Continue from the run dir's checkpoint, whatever world size wrote it."""
        resume_from(self, self.checkpoint, self.sharded_module)

    def load(self, state: dict) -> None:
        """Restore `state_dict()`'s state (with `fsdp` the weights are already loaded: `resume_from`)."""
        if state.get("left_out", self.inputs.left_out) != self.inputs.left_out:
            raise UserError(f"heldout_prompts: this held-out set leaves {self.inputs.left_out} training prompts out "
                            f"of training where the run left out {state['left_out']} (heldout_disjoint); allowed on "
                            "resume: the run's own held-out set")
        runstate.load_weights(state, self.layout.named_trainable(), self.optimizer)
        self.precision.load_state_dict(state["precision"])
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        if "collapse" in state:  # checkpoints from before the collapse guard start it afresh
            self.collapse.load_state_dict(state["collapse"])
        runstate.load_step_state(self, state)  # rank 0's RNGs: the other ranks reseed theirs
        distributed.reseed(self.cfg.seed + 1_000_003 * self.update)
        self.gen.set_state(state["generator"])  # the shared generator resumes on every rank
        self.cursor = state["cursor"]
        self.engine.weights_changed()

    def rollback(self) -> None:
        runstate.rollback(self, [self.run_dir / "metrics.jsonl", self.run_dir / "completions.jsonl"])

    # ---- data ---------------------------------------------------------------------------------------
    def next_prompts(self) -> list[int]:
        """Row indices of the next batch: epoch e visits the prompts in a permutation seeded by (seed, e)."""
        n, out = len(self.inputs.prompt_ids), []
        for i in range(self.cursor, self.cursor + self.cfg.batch_size):
            if self._order[0] != i // n:
                self._order = (i // n, np.random.default_rng([self.cfg.seed, i // n]).permutation(n))
            out.append(int(self._order[1][i % n]))
        self.cursor += self.cfg.batch_size
        return out

    # ---- one update ---------------------------------------------------------------------------------
    def train_one_update(self) -> tuple[dict, list[dict]]:
        """One PPO update; returns its metrics and the completion rows for the table."""
        cfg, start, lr = self.cfg, time.perf_counter(), self.set_learning_rate()
        # 1-2. collect and score (`draw`); with dynamic_sampling, groups whose scores all agree are dropped
        #    and fresh prompts drawn in their place (lm/rl/dynamic.py). DAPO's overlong penalty, after the
        #    guard's clip (0 with overlong_buffer 0); old log-probs, values and reference log-probs in passes
        (batch, all_scores, finite, gen_s, terms), dynamic = self.rounds(self.draw)
        overlong = overlong_penalty(batch.samples.attended.sum(1), cfg.episode_tokens, cfg.overlong_buffer,
                                    cfg.overlong_penalty)
        all_scores = all_scores + distributed.all_gather(overlong)
        scores = all_scores[self.my_rows] if self.world.size > 1 else all_scores
        b = self.logprobs_and_values(batch, scores).detached()
        # 3. advantages over the whole rollout, before PPO shuffles it: per-token rewards (-beta * KL with
        #    kl_in: reward, the score at the last token) -> GAE, or a critic-free estimator (its groups)
        beta = self.kl_ctl.value
        kl = rollout_kl(b, cfg.kl_estimator)
        non_score = non_score_rewards(kl, b.resp_mask, beta if cfg.kl_in == "reward" else 0.0)
        b.adv, b.ret = cfg.estimator.estimate(b, non_score, cfg)
        # 4. PPO epochs over the rollout (none when a reward was not finite: the guard skips the update);
        #    with mask_truncated no loss on truncated responses, whose scores still made their group's baseline
        trained = replace(b, resp_mask=finished_mask(b.resp_mask, batch.samples.finished, cfg.mask_truncated))
        flat = self.flat_rollout(trained)  # the advantages the loss sees: after mask_truncated
        trained = gather_rollout(trained, self.tokenizer.pad_token_id) if self.sharded else trained
        skipped = torch.tensor(float("nan"), device=b.resp.device)
        stats = self.ppo_update(trained) if finite and not flat else dict.fromkeys(self.ppo.stat_names, skipped)
        # 5. KL controller, bookkeeping, metrics (one host sync for all of them)
        seq_kl = distributed.all_mean(kl.sum(1).mean())
        self.kl_ctl.update(float(seq_kl), cfg.rollout_size)
        self.update += 1
        objective = rollout_metrics(b, batch.samples.finished, kl, non_score, cfg.num_generations)
        objective |= {k: torch.tensor(v, device=b.resp.device) for k, v in self.collector.metrics(batch).items()}
        objective |= term_metrics(terms or {})  # rewards/<name>/mean and /std, TRL's (global: gathered in draw)
        objective |= {"objective/score_min": all_scores.min(), "objective/score_max": all_scores.max(),  # global
                      "objective/overlong_penalty": overlong.mean()}
        objective = distributed.mean_metrics(objective, summed=("val/num_eos_tokens",))
        metrics = {k: v.item() for k, v in {**objective, **stats}.items()}
        elapsed, n = time.perf_counter() - start, cfg.rollout_size
        metrics.update({**self.guard.counts, **dynamic, "guard/micro_batch_size": self.ppo.micro_batch,
                        "guard/flat_rollout_skipped": float(flat), "guard/flat_steps_skipped": self.ppo.flat_steps,
                        "perf/shared_prefix_unit": self.ppo.unit,
                        "guard/generation_batch_size": self.collector.gen_batch,
                        "objective/kl_coef": beta, "lr": lr, "episode": self.update * n,
                        "perf/samples_per_s": n / elapsed,
                        "perf/tokens_per_s": metrics["objective/response_length"] * n / elapsed,
                        "perf/generation_share": gen_s / elapsed, "perf/update_s": elapsed,
                        "perf/world_size": self.world.size, "perf/rank_rollout": len(batch.rows),
                        **engine_metrics(self.engine, b)})
        self.check_collapse(metrics, all_scores)  # 6. a degenerating policy is named and stopped, not trained on
        return metrics, _table(batch, b)

    def set_learning_rate(self) -> float:
        """This update's learning rate, set on the optimizer: the configured one, lowered by each non-finite
        rollback (`lr_scale`) and, with `anneal_lr`, linearly to 0 over the run."""
        cfg = self.cfg
        lr = cfg.learning_rate * self.lr_scale * ((1.0 - self.update / cfg.total_updates) if cfg.anneal_lr else 1.0)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def check_collapse(self, metrics: dict, scores: torch.Tensor) -> None:
        """The collapse guard on this update's rollout: token entropy, share at the budget, scores (the global
        rollout's, each prompt's num_generations in a row)."""
        groups = scores.view(-1, self.cfg.num_generations)
        # a group's own signal: critic-free estimators only (a critic's advantages need no spread in a group)
        worsts = groups.amin(1).tolist() if self.cfg.num_generations > 1 and not self.cfg.has_critic else None
        self.collapse.check(self.update, metrics["objective/entropy"] / max(metrics["objective/response_length"], 1),
                            metrics["completions/clipped_ratio"], metrics["objective/scores"],
                            metrics["objective/score_min"], metrics["objective/score_max"], groups.amax(1).tolist(),
                            worsts)
        metrics["guard/collapse_streak"] = self.collapse.streak

    def draw(self) -> Drawn:
        """The next batch_size prompts collected and scored. Collect: prompts -> responses (eval mode, no
        grad, KV cache), or with an env episodes played; each prompt num_generations times in a row. Score:
        the reward on the decoded text (an env: its scores). Under torchrun each rank takes its slice of the
        global batch's prompts, seeds and uniforms (every draw is the global one), a rank whose reward raised
        stops every rank (`checked`), and the guard sees all scores."""
        start = time.perf_counter()
        batch = self.collect(self.next_prompts())
        gen_s = time.perf_counter() - start
        scores = distributed.all_gather(distributed.checked(self.collector.scores, batch))
        finite, all_scores = self.guard.rewards_ok(scores, self.cfg.reward_clip)
        reward = self.inputs.reward_fn  # its terms' values: the rewards/<name>/ metrics
        terms = ({k: distributed.all_gather(torch.tensor(v, device=scores.device))
                  for k, v in reward.last_terms.items()} if isinstance(reward, WeightedSum) else None)
        return Drawn(batch, all_scores, finite, gen_s, terms)

    def collect(self, prompts: list[int]) -> Batch:
        """This rank's part of the rollout of the global batch's `prompts` (row indices), each prompt
        num_generations times in a row with its environment seed."""
        g = self.cfg.num_generations
        seeds = self.collector.seeds(len(prompts), self.gen)
        idx = [i for i in prompts[self.my_prompts] for _ in range(g)]
        seeds = [s for s in seeds[self.my_prompts] for _ in range(g)]
        rows, prompt_ids = [self.inputs.prompt_rows[i] for i in idx], [self.inputs.prompt_ids[i] for i in idx]
        return self.collector.collect(rows, prompt_ids, seeds, self.gen, self.cfg.rollout_size, self.my_rows)

    @torch.inference_mode()
    def logprobs_and_values(self, batch: Batch, scores: torch.Tensor) -> Rollout:
        """The rollout with its old log-probs and values and the reference log-probs, all fp32
        (from the sampler where that is exact: see `lm/rl/passes.py`); values None without a critic,
        reference log-probs None without a KL term."""
        samples, mask = batch.samples, batch.mask
        self.plan.choose(batch.ids, mask, samples.response_ids.shape[1])  # every forward's rows from here on
        with self.precision.autocast():
            logp, values, ref_logp = self.passes(batch.ids, mask, samples)
        self.layout.release()  # sharded: the LM heads these no-grad passes left gathered
        m = samples.response_mask
        behaviour = None if self.engine.exact else _masked(samples.logp, m)
        return Rollout(batch.ids, mask, samples.response_ids, m, _masked(logp, m), _masked(ref_logp, m),
                       _masked(values, m), scores, batch.turn_rewards, behaviour)

    def flat_rollout(self, b: Rollout) -> bool:
        """`skip_flat_rollouts`: is there nothing to learn from this rollout? Every advantage 0, over all ranks,
        and a loss with no other term: its gradient is 0, and a step would only replay Adam's momentum (an
        earlier rollout's direction, at up to ~10x one step in all over the next updates). On the harder
        arithmetic variant (docs/benchmarks.md) 11 such steps, right after a rollout that scored, pinned a
        policy to a confident wrong answer. The metrics report the NaN of an update that did not train."""
        if not (self.cfg.skip_flat_rollouts and self.cfg.loss_is_policy_gradient_only):
            return False
        return not bool(distributed.all_sum((b.adv * b.resp_mask).abs().sum()).item())

    def ppo_update(self, b: Rollout) -> dict[str, torch.Tensor]:
        """The PPO epochs over rollout `b` (lm/rl/update.py): its mean loss and stats."""
        return self.ppo(b, self.optimizer, self.kl_ctl.value)

    def _mark_optimizing(self) -> None:
        """Before each optimizer step (PPOUpdate's on_step): the update is optimizing, and an engine holding its
        own copy of the weights (vLLM) must sync them before it samples again."""
        self.optimizing = True
        self.engine.weights_changed()

    def policy_attention(self) -> str:
        return getattr(self.layout.policy_model.config, "_attn_implementation", "?")

    # ---- the run loop -------------------------------------------------------------------------------
    def run(self) -> TrainResult:
        """Train until total_updates or a stop signal (`runtime/runloop.py`: the pieces below, as the Python
        API's `step()` runs them one update at a time), then the curves."""
        result = runloop.run(self, self.cfg.total_updates, self.cfg.checkpoint_every)
        self.plot()
        return result

def _table(batch: Batch, b: Rollout) -> list[dict]:
    """The update's completions table: every rank's (prompt, completion, score) rows, gathered."""
    return distributed.gather_rows([{"prompt": p, "completion": t, "score": s} for p, t, s in
                                    zip(batch.prompts, batch.texts, b.returns().tolist(), strict=True)])


def engine_metrics(engine, b: Rollout) -> dict[str, float]:
    """perf/weight_sync_s; where an inexact engine (vLLM) sampled, rollout/logprob_mismatch_mean and _max:
    |engine log-prob - training forward's| over the policy's tokens of all ranks."""
    out = {"perf/weight_sync_s": engine.take_sync_seconds()}
    if b.behaviour_logp is None:
        return out
    gap = (b.behaviour_logp - b.logp).abs() * b.resp_mask
    total = distributed.all_sum(torch.stack([gap.sum(), b.resp_mask.sum()]))
    return out | {"rollout/logprob_mismatch_mean": float(total[0] / total[1].clamp(min=1)),
                  "rollout/logprob_mismatch_max": float(distributed.all_gather(gap.max().reshape(1)).max())}


def _masked(x: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor | None:
    return None if x is None else masked(x, mask)


def train(cfg: RLHFConfig, run_dir: Path, resume: bool = False, reward_fn=None) -> TrainResult:
    """Train (or, with resume, continue) an RLHF run in `run_dir`. `reward_fn` overrides cfg.reward."""
    with rundir.hold(run_dir):  # one run at a time in a run dir
        trainer = RLHFTrainer(cfg, run_dir, reward_fn)
        if resume:
            # on CPU: generator states must be CPU tensors; optimizer state moves to its params' device itself
            trainer.resume()
        return trainer.run()
