"""PPO for causal LMs (RLHF), top to bottom: sample -> score -> advantages -> update -> log -> checkpoint.

The recipe is Ziegler et al. 2019 as TRL's PPOTrainer implements it: per-token reward = -beta * KL to
the frozen reference on every response token plus the reward function's score on the last one; GAE
over response tokens (gamma 1, lambda 0.95); advantages whitened over the batch's real tokens; clipped
surrogate and clipped value loss; fixed or adaptive beta; old log-probs are the sampler's, as in TRL —
but only once a check on the first rollout found them bit-identical to the update's own forward
(`old_logprobs: auto`), else recomputed: a ratio that is not exactly 1 before any update is a bias.
Deliberate differences from TRL: the model layouts (`policy.py`: LoRA with the reference = adapters
off, no second copy), our own KV-cache decode loop (which also hands over the values when the value
head reads the policy's trunk), and micro-batch losses weighted by their share of the mini-batch's
tokens (`core/accumulation.py`) so that gradient accumulation gives exactly the mini-batch gradient.
Critic-free estimators (`advantage`: grpo, rloo, reinforce_pp, reinforce_pp_baseline; `lm/rl/rollout.py`,
`core/critic_free.py`) reuse the same loop without a critic: each prompt is sampled `num_generations`
times in a row, the advantages come from the whole rollout's groups before the mini-batch shuffle, no
value head exists and no value loss is computed; the KL can sit in the loss (`kl_in: loss`, GRPO's),
the loss can be aggregated per sequence (`loss_agg`, `core/accumulation.py`) and the clip can be
asymmetric (`clip_high`, DAPO's). `kl_coef: 0` skips the reference pass.
Under torchrun (`runtime/distributed.py`) each rank samples and scores its contiguous slice of the
global batch's prompts (whole groups) with its slice of the globally drawn uniforms, takes each
mini-batch's rows it owns from one global permutation, and all-reduces the gradients once per optimizer
step: any world size trains the single-process run's numbers. With `fsdp` (the full layout sharded by
FSDP2, `FullLayout.shard`) the rollout is all-gathered after the advantages and every rank trains an equal
slice of each mini-batch (FSDP's forward and backward are collectives), FSDP reduces the gradients, the
decoder reads the policy gathered whole, and checkpoints are sharded (`checkpoint/`, any world size).
Left out: reward-model training, value-head warm-up, per-token entropy
regularization beyond `ent_coef`, DAPO's dynamic sampling and overlong shaping.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ppoforge.config import config_to_dict, save_config
from ppoforge.core.accumulation import loss_aggregation, token_share, unit_share
from ppoforge.core.kl import AdaptiveKLController, FixedKLController, kl_penalty
from ppoforge.core.losses import clip_stats, policy_loss, value_loss
from ppoforge.core.stats import masked, masked_mean
from ppoforge.lm.envs.episodes import Episodes, Episodic, episode_metrics
from ppoforge.lm.models.attention import left_pad
from ppoforge.lm.models.logprobs import token_logprobs
from ppoforge.lm.models.sampler import Samples, SamplingParams, concat_samples, draw_uniforms, sample
from ppoforge.lm.rl.build import Components, build_components
from ppoforge.lm.rl.config import RLHFConfig
from ppoforge.lm.rl.passes import RolloutScoring
from ppoforge.lm.rl.rollout import ESTIMATORS, Rollout, gather_rollout, non_score_rewards, rollout_metrics
from ppoforge.runtime import distributed, runstate, trust
from ppoforge.runtime.checkpoint import resume_from, seed_everything, sharded_writer
from ppoforge.runtime.device import resolve_device
from ppoforge.runtime.metrics import MetricsLogger, NullLogger, plot_curves, truncate_metrics
from ppoforge.runtime.oom import retry_halving
from ppoforge.runtime.progress import Progress
from ppoforge.runtime.resilience import NonFiniteGuard, RunGuard, train_loop
from ppoforge.runtime.timeouts import call_with_timeout

CHECKPOINT = "checkpoint.pt"
SHARDED_CHECKPOINT = "checkpoint"  # with `fsdp`: a torch.distributed.checkpoint directory (runtime/fsdp.py)
TABLE_ROWS = 8  # completions shown in TensorBoard per logging step (all of them go to completions.jsonl)
LOSS_KEYS = ("loss/policy_avg", "loss/value_avg")  # weighted by the micro-batch's share of the loss units
TOKEN_KEYS = ("policy/entropy_avg", "policy/approxkl_avg", "policy/clipfrac_avg", "val/clipfrac_avg", "val/ratio",
              "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "kl")  # by its tokens
CRITIC_KEYS = ("loss/value_avg", "val/clipfrac_avg")


def stat_keys(cfg: RLHFConfig) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(loss keys, token keys) an update reports: no critic, no value stats; `kl` with kl_in: loss only."""
    dropped = set() if cfg.has_critic else set(CRITIC_KEYS)
    if not (cfg.kl_in == "loss" and cfg.kl_coef):
        dropped.add("kl")
    return tuple(k for k in LOSS_KEYS if k not in dropped), tuple(k for k in TOKEN_KEYS if k not in dropped)


@dataclass
class TrainResult:
    run_dir: Path
    updates: int
    episodes: int
    last_metrics: dict          # the metrics of the last update run in this call ({} if none)
    stopped_by: str | None      # a signal name when interrupted


class RLHFTrainer:
    """Holds the run's state; `run()` trains until total_updates or a stop signal."""

    def __init__(self, cfg: RLHFConfig, run_dir: Path, reward_fn=None):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        seed_everything(cfg.seed)
        self.world = distributed.init(cfg.dist_timeout, resolve_device(cfg.device))
        self.run_dir = Path(distributed.rank0_value(str(self.run_dir)))
        # this rank's prompts of each global batch; its rows (and uniforms' columns) of each rollout
        self.shard = distributed.shard(cfg.batch_size, "batch_size")
        g = cfg.num_generations
        self.rows = slice(self.shard.start * g, self.shard.stop * g)
        self.parts: Components = build_components(cfg, reward_fn)
        self.layout, self.tokenizer, self.precision = self.parts.layout, self.parts.tokenizer, self.parts.precision
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
        self.sampling = SamplingParams(cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p,
                                       self.parts.stop_ids, self.tokenizer.pad_token_id)
        where = f"{self.parts.device.type} / {self.precision.name} / {self.policy_attention()} attention"
        # One optimizer step per rollout, no critic, no KL in the rewards: the update's own forward is the
        # sampling policy, so its detached log-probs are the old ones, exactly (ratio 1; TRL's GRPO does the
        # same) and no rollout pass computes them.
        self.on_policy = (cfg.old_logprobs == "auto" and not cfg.has_critic and cfg.ppo_epochs == 1
                          and cfg.mini_batch_size == cfg.rollout_size and (cfg.kl_in == "loss" or cfg.kl_coef == 0))
        self.scoring = RolloutScoring(self.layout, cfg.old_logprobs, cfg.temperature, cfg.micro_batch_size, where,
                                      critic=cfg.has_critic, reference=cfg.kl_coef > 0, policy=not self.on_policy)
        self.estimate = ESTIMATORS[cfg.advantage]  # (rollout, KL rewards, cfg) -> (advantages, returns)
        # (reduce, units) of every loss term; seq_sum_norm's constant is the most policy tokens a row can have
        self.agg = loss_aggregation(cfg.loss_agg, cfg.max_new_tokens * cfg.max_turns)
        self.episodes = Episodic(cfg, self.tokenizer) if cfg.env else None  # multi-turn: lm/envs/episodes.py
        self.kl_loss = cfg.kl_in == "loss" and cfg.kl_coef > 0
        self.loss_keys, self.token_keys = stat_keys(cfg)
        self.gen = torch.Generator(self.parts.device).manual_seed(cfg.seed)
        self.update = 0   # completed updates
        self.cursor = 0   # prompts consumed: the data position, an epoch-wise shuffled stream
        self._order = (-1, None)  # (data epoch, its permutation), derived from (seed, epoch) on demand
        self.guard = NonFiniteGuard(cfg.nonfinite_patience, cfg.nonfinite_action)
        self.lr_scale = 1.0  # lowered by each non-finite rollback
        self.micro_batch, self.gen_batch = cfg.micro_batch_size, cfg.rollout_size  # halved on out-of-memory
        self.optimizing = False  # has the current update stepped the optimizer (see runtime/resilience.py)
        self.checkpoint = self.run_dir / (SHARDED_CHECKPOINT if cfg.fsdp else CHECKPOINT)
        self.sharded_module = self.layout.checkpoint_module() if cfg.fsdp else None  # what `checkpoint/` holds
        self.run_guard = RunGuard(self, self.checkpoint, f"ppoforge train rlhf --resume {self.run_dir}",
                                  write=sharded_writer(self.checkpoint, self.sharded_module, self.optimizer)
                                  if cfg.fsdp else None)

    # ---- checkpoint (runtime/runstate.py) ---------------------------------------------------------
    def state_dict(self) -> dict:
        """The whole state; with `fsdp` all but the weights and optimizer, which `sharded_writer` saves."""
        return {**runstate.weights_state(self.layout.named_trainable(), self.optimizer, self.cfg.fsdp),
                "precision": self.precision.state_dict(), "config": config_to_dict(self.cfg), **self.step_state()}

    def step_state(self) -> dict:
        """What an update changes besides the weights and the optimizer: the run state, the data cursor, the
        shared generator and the KL controller."""
        return {**runstate.step_state(self), "cursor": self.cursor, "generator": self.gen.get_state(),
                "kl_ctl": self.kl_ctl.state_dict()}

    def resume(self) -> None:
        """Continue from the run dir's checkpoint, whatever world size wrote it."""
        resume_from(self, self.checkpoint, self.sharded_module)

    def load(self, state: dict) -> None:
        """Restore `state_dict()`'s state (with `fsdp` the weights are already loaded: `resume_from`)."""
        runstate.load_weights(state, self.layout.named_trainable(), self.optimizer)
        self.precision.load_state_dict(state["precision"])
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        runstate.load_step_state(self, state)  # rank 0's RNGs: the other ranks reseed theirs
        distributed.reseed(self.cfg.seed + 1_000_003 * self.update)
        self.gen.set_state(state["generator"])  # the shared generator resumes on every rank
        self.cursor = state["cursor"]

    def rollback(self) -> None:
        runstate.rollback(self, [self.run_dir / "metrics.jsonl", self.run_dir / "completions.jsonl"])

    # ---- data ---------------------------------------------------------------------------------------
    def next_prompts(self) -> list[int]:
        """Row indices of the next batch: epoch e visits the prompts in a permutation seeded by (seed, e)."""
        n, out = len(self.parts.prompt_ids), []
        for i in range(self.cursor, self.cursor + self.cfg.batch_size):
            if self._order[0] != i // n:
                self._order = (i // n, np.random.default_rng([self.cfg.seed, i // n]).permutation(n))
            out.append(int(self._order[1][i % n]))
        self.cursor += self.cfg.batch_size
        return out

    # ---- rollout ------------------------------------------------------------------------------------
    def generate(self, token_rows: list[list[int]], generator: torch.Generator, n_global: int | None = None,
                 cols: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor, Samples]:
        """Left-pad the prompts and sample, `gen_batch` rows at a time (halved on out-of-memory; each row
        draws its own pre-drawn uniforms, so the split changes no draw); returns (prompt + response ids,
        prompt mask, samples). Under torchrun the rows are columns `cols` of a global batch of `n_global`:
        every rank draws the global batch's uniforms and samples with its columns (the world size changes
        no draw), and no collective runs while decoding."""
        prompt_ids, prompt_mask = left_pad(token_rows, self.tokenizer.pad_token_id, self.parts.device)
        uniforms = draw_uniforms(self.sampling, n_global or prompt_ids.shape[0], generator)[:, cols]
        # entered once, retries inside: sharded, entering gathers the policy (a collective)
        with self.layout.decoder() as decoder, self.precision.autocast():
            parts, self.gen_batch = retry_halving(
                lambda n: [sample(decoder, prompt_ids[s:s + n], prompt_mask[s:s + n], self.sampling,
                                  uniforms=uniforms[:, s:s + n]) for s in range(0, prompt_ids.shape[0], n)],
                self.gen_batch, "generation batch")
        samples = concat_samples(parts, self.sampling.pad_id)
        return torch.cat([prompt_ids, samples.response_ids], 1), prompt_mask, samples

    def sample_batch(self, rows: list[dict], token_rows: list[list[int]], seeds: list[int] | None,
                     generator: torch.Generator, n_global: int | None = None, cols: slice = slice(None)
                     ) -> tuple[torch.Tensor, torch.Tensor, Samples, list[str]]:
        """One batch's (prompt + response ids, prompt mask, samples, texts): the prompts sampled, or with an
        env, episodes played (`seeds`: each row's environment seed) — columns `cols` of a global batch of
        `n_global` under torchrun (see `generate`). Under torchrun an environment that raises on one rank
        stops every rank (`distributed.checked`); a rank with none of the rows calls `idle_batch` instead."""
        if self.episodes is None:
            ids, prompt_mask, samples = self.generate(token_rows, generator, n_global, cols)
            return ids, prompt_mask, samples, self.completions(samples)
        uniforms = self.draw_uniforms(n_global or len(rows), generator)[:, cols]

        def play():
            with self.layout.decoder() as decoder, self.precision.autocast():
                return self.episodes.play(decoder, rows, seeds, uniforms, self.sampling, self.parts.device)

        prompt_ids, prompt_mask, episodes = distributed.checked(play)
        return torch.cat([prompt_ids, episodes.response_ids], 1), prompt_mask, episodes, episodes.transcripts

    def idle_batch(self, n_global: int, generator: torch.Generator) -> None:
        """`sample_batch` on a rank that holds no row of a global batch of `n_global` (more ranks than rows):
        it draws what the others draw and joins every collective they run while sampling — sharded, the
        policy's gather on entering the decoder; with an env, the error flag of `checked` — so that the
        later collectives pair up rather than hang."""
        self.draw_uniforms(n_global, generator)

        def gather_policy():
            if self.sharded:
                with self.layout.decoder():
                    pass

        if self.episodes is None:
            gather_policy()
        else:
            distributed.checked(gather_policy)

    def draw_uniforms(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """The sampling uniforms of a batch of n rows (an episode's: one per turn, step and row)."""
        if self.episodes is None:
            return draw_uniforms(self.sampling, n, generator)
        return self.episodes.uniforms(n, generator, self.sampling)

    def batch_scores(self, rows: list[dict], texts: list[str], samples: Samples) -> torch.Tensor:
        """(B,) the reward's scores of the texts, or the environments' final scores of episodes."""
        return samples.scores if isinstance(samples, Episodes) else self.score(rows, texts, samples)

    def prompt_texts(self, rows: list[dict], samples: Samples) -> list[str]:
        """The table's prompt column: the prompt field, or an episode's first message(s)."""
        if isinstance(samples, Episodes):
            return samples.first_messages
        return [r[self.cfg.prompt_field] for r in rows]

    def completions(self, samples: Samples) -> list[str]:
        lengths = samples.response_mask.sum(1).long().tolist()
        return self.tokenizer.batch_decode([ids[:n] for ids, n in zip(samples.response_ids.tolist(), lengths,
                                                                      strict=True)], skip_special_tokens=True)

    def score(self, rows: list[dict], texts: list[str], samples: Samples) -> torch.Tensor:
        """The reward's scores (B,), under `call_timeout`; not yet checked for finiteness (the guard does)."""
        prompts = [r[self.cfg.prompt_field] for r in rows]
        with torch.inference_mode(), self.precision.autocast():
            scores = call_with_timeout(lambda: self.parts.score(prompts, texts, samples.finished.tolist(), rows),
                                       self.cfg.call_timeout, f"reward {self.cfg.reward}")
        return scores.to(self.parts.device)

    def policy_attention(self) -> str:
        return getattr(self.layout.policy_model.config, "_attn_implementation", "?")

    @torch.inference_mode()
    def logprobs_and_values(self, ids: torch.Tensor, mask: torch.Tensor, samples: Samples, scores) -> Rollout:
        """The rollout with its old log-probs and values and the reference log-probs, all fp32
        (from the sampler where that is exact: see `lm/rl/passes.py`); values None without a critic,
        reference log-probs None without a KL term."""
        with self.precision.autocast():
            logp, values, ref_logp = self.scoring(ids, mask, samples)
        self.layout.release()  # sharded: the LM heads these no-grad passes left gathered
        m = samples.response_mask
        return Rollout(ids, mask, samples.response_ids, m, _masked(logp, m), _masked(ref_logp, m), _masked(values, m),
                       scores, getattr(samples, "turn_rewards", None))

    def rollout_kl(self, b: Rollout) -> torch.Tensor:
        """(B, T) per-token KL of the sampling policy to the reference; 0 without a reference pass."""
        if b.ref_logp is None:
            return torch.zeros_like(b.logp)
        return kl_penalty(b.logp, b.ref_logp, self.cfg.kl_estimator, b.resp_mask)

    # ---- update -------------------------------------------------------------------------------------
    def ppo_update(self, b: Rollout) -> dict[str, torch.Tensor]:
        """ppo_epochs x shuffled mini-batches x accumulated micro-batches; loss-unit-weighted loss stats,
        token-weighted other stats. A step whose loss or gradient norm is not finite is skipped (the guard
        counts it)."""
        cfg, keys = self.cfg, self.loss_keys + self.token_keys
        totals, n_mini = torch.zeros(1 + len(keys), device=b.resp.device), 0
        for _epoch in range(cfg.ppo_epochs):
            order = torch.randperm(cfg.rollout_size, generator=self.gen, device=self.gen.device).to(b.resp.device)
            for mb in order.split(cfg.mini_batch_size):
                mb = self._own_rows(mb)
                sums = self._mini_batch_gradients(b, mb)  # (total loss, *stats in `keys` order)
                # one all-reduce per step (sharded: of the stats alone, FSDP reduced the gradients in backward)
                sums = (distributed.all_sum(sums) if self.sharded else
                        distributed.all_reduce_grads(self.params, sums))
                norm = self.precision.clip(self.optimizer, self.params, cfg.max_grad_norm)
                ok = self.guard.step_ok(sums[0], norm, self.precision.scaler is not None)
                self.optimizing = True
                self.precision.apply(self.optimizer, skip=not ok)
                totals += sums if ok else 0
                n_mini += ok
        return dict(zip(keys, (totals / max(n_mini, 1))[1:], strict=True))

    def _own_rows(self, mb: torch.Tensor) -> torch.Tensor:
        """The rows of global mini-batch `mb` this rank holds, as indices into its rollout (any number,
        none included: the gradient all-reduce and the global unit count make the step the global one)."""
        if self.world.size == 1:
            return mb
        if self.sharded:  # `b` is the gathered rollout; every rank takes an equal slice (FSDP's lockstep)
            return mb.tensor_split(self.world.size)[self.world.rank]
        return mb[(mb >= self.rows.start) & (mb < self.rows.stop)] - self.rows.start

    def _mini_batch_gradients(self, b: Rollout, mb: torch.Tensor) -> torch.Tensor:
        """The mini-batch's gradients in .grad, accumulated over micro-batches of `micro_batch` rows (halved
        and redone on out-of-memory: the shares keep the sum the same); its weighted loss and stats. The
        loss's normalizer (the mini-batch's tokens or sequences, `loss_agg`) is counted once, here."""
        mb_mask = b.resp_mask[mb]
        mb_units, mb_tokens = self.agg.units(mb_mask), mb_mask.sum()
        if distributed.collectives():  # all ranks' units, before any backward: the single-process loss weights
            mb_units, mb_tokens = distributed.all_sum(torch.stack([mb_units, mb_tokens]))
        def attempt(n: int) -> torch.Tensor:
            self.optimizer.zero_grad(set_to_none=True)
            if mb.numel() == 0:  # this rank holds none of the mini-batch's rows: its gradient is 0
                return b.resp_mask.new_zeros(1 + len(self.loss_keys) + len(self.token_keys))
            with self.precision.weight_cache():
                return sum(self._micro_batch(b, micro, mb_units, mb_tokens) for micro in mb.split(n))

        totals, self.micro_batch = retry_halving(attempt, self.micro_batch, "micro-batch", retry=not self.sharded)
        return totals

    def _micro_batch(self, b: Rollout, micro: torch.Tensor, mb_units: torch.Tensor, mb_tokens: torch.Tensor
                     ) -> torch.Tensor:
        """Forward/backward of rows `micro`, its loss weighted by its share of the mini-batch's loss units;
        (its weighted total loss, its weighted stats)."""
        cfg, n_resp, m, reduce = self.cfg, b.resp.shape[1], b.resp_mask[micro], self.agg.reduce
        with self.precision.autocast():
            hidden, values = self.layout.forward(b.ids[micro], b.mask[micro], n_resp)
            logits = self.layout.logits(hidden)
        with self.precision.full_precision():
            logp, entropy = token_logprobs(logits, b.resp[micro], cfg.temperature)
            old_logp, adv = (logp.detach() if self.on_policy else b.logp[micro]), b.adv[micro]
            pg_loss, pg = policy_loss(logp, old_logp, adv, cfg.clip, m, clip_high=cfg.clip_high, reduce=reduce)
            clipped = clip_stats(logp, old_logp, adv, cfg.clip, cfg.clip_high, m)
            ent = masked_mean(entropy, m)
            loss, stats = pg_loss, {"loss/policy_avg": pg_loss.detach(), "policy/entropy_avg": ent.detach(),
                                    "policy/approxkl_avg": pg["approx_kl"], "policy/clipfrac_avg": pg["clipfrac"],
                                    "val/ratio": pg["ratio"], **{f"clip_ratio/{k}_mean": v for k, v in clipped.items()}}
            if values is not None:  # GAE's critic
                v_loss, vs = value_loss(values, b.values[micro], b.ret[micro], cfg.value_clip, m, reduce=reduce)
                loss = loss + cfg.vf_coef * v_loss
                stats |= {"loss/value_avg": v_loss.detach(), "val/clipfrac_avg": vs["clipfrac"]}
            if self.kl_loss:  # GRPO's: beta * KL_t of the current policy, aggregated like the policy loss
                kl = kl_penalty(logp, b.ref_logp[micro], cfg.kl_estimator, m)  # 0 on padding, gradient too
                loss = loss + self.kl_ctl.value * reduce(kl, m)
                stats["kl"] = masked_mean(kl.detach(), m)
            if cfg.ent_coef:  # else entropy stays out of the graph: no (T, V) work for it in backward
                loss = loss - cfg.ent_coef * reduce(entropy, m)
            share = unit_share(self.agg.units(m), mb_units)  # the accumulated gradient is the mini-batch's loss
            # FSDP averages the ranks' gradients: x world makes that the sum, the all-reduce's
            self.precision.backward(loss * share * (self.world.size if self.sharded else 1))
        tokens = token_share(m, mb_tokens)
        return torch.cat([share * torch.stack([loss.detach(), *(stats[k] for k in self.loss_keys)]),
                          tokens * torch.stack([stats[k] for k in self.token_keys])])

    def train_one_update(self) -> tuple[dict, list[dict]]:
        """One PPO update; returns its metrics and the completion rows for the table."""
        cfg, start = self.cfg, time.perf_counter()
        lr = cfg.learning_rate * self.lr_scale * ((1.0 - self.update / cfg.total_updates) if cfg.anneal_lr else 1.0)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        # 1. prompts -> responses (eval mode, no grad, KV cache); each prompt num_generations times in a row
        #    (with an env: episodes played, a prompt's G with one environment seed). Under torchrun each rank
        #    takes its slice of the global batch's prompts, seeds and uniforms: every draw is the global one
        prompts = self.next_prompts()
        seeds = None
        if self.episodes is not None:
            draws = torch.randint(2**62, (len(prompts),), generator=self.gen, device=self.gen.device).tolist()
            seeds = [s for s in draws[self.shard] for _ in range(cfg.num_generations)]
        idx = [i for i in prompts[self.shard] for _ in range(cfg.num_generations)]
        rows = [self.parts.rows[i] for i in idx]
        ids, prompt_mask, samples, texts = self.sample_batch(rows, [self.parts.prompt_ids[i] for i in idx], seeds,
                                                             self.gen, cfg.rollout_size, self.rows)
        gen_s = time.perf_counter() - start
        # 2. score: reward on the decoded text (an env: its scores); reference log-probs (and what the sampler
        #    lacks) in a pass. Under torchrun: a rank whose reward raised stops every rank (`checked`); the
        #    guard sees all scores
        scores = distributed.all_gather(distributed.checked(self.batch_scores, rows, texts, samples))
        finite, scores = self.guard.rewards_ok(scores, cfg.reward_clip)
        scores = scores[self.rows] if self.world.size > 1 else scores
        mask = torch.cat([prompt_mask.float(), samples.attended], 1)
        b = self.logprobs_and_values(ids, mask, samples, scores).detached()
        # 3. advantages over the whole rollout, before PPO shuffles it: per-token rewards (-beta * KL with
        #    kl_in: reward, the score at the last token) -> GAE, or a critic-free estimator (its groups)
        beta = self.kl_ctl.value
        kl = self.rollout_kl(b)
        non_score = non_score_rewards(kl, b.resp_mask, beta if cfg.kl_in == "reward" else 0.0)
        b.adv, b.ret = self.estimate(b, non_score, cfg)
        # 4. PPO epochs over the rollout (none when a reward was not finite: the guard skips the update)
        keys = self.loss_keys + self.token_keys
        trained = gather_rollout(b, self.tokenizer.pad_token_id) if self.sharded else b
        skipped = torch.tensor(float("nan"), device=b.resp.device)
        stats = self.ppo_update(trained) if finite else dict.fromkeys(keys, skipped)
        # 5. KL controller, bookkeeping, metrics (one host sync for all of them)
        seq_kl = distributed.all_mean(kl.sum(1).mean())
        self.kl_ctl.update(float(seq_kl), cfg.rollout_size)
        self.update += 1
        objective = rollout_metrics(b, samples.finished, kl, non_score, cfg.num_generations)
        if isinstance(samples, Episodes):
            objective |= {k: torch.tensor(v, device=b.resp.device) for k, v in episode_metrics(samples).items()}
        objective = distributed.mean_metrics(objective, summed=("val/num_eos_tokens",))
        metrics = {k: v.item() for k, v in {**objective, **stats}.items()}
        elapsed, n = time.perf_counter() - start, cfg.rollout_size
        metrics.update({**self.guard.counts, "guard/micro_batch_size": self.micro_batch,
                        "guard/generation_batch_size": self.gen_batch,
                        "objective/kl_coef": beta, "lr": lr, "episode": self.update * n,
                        "perf/samples_per_s": n / elapsed,
                        "perf/tokens_per_s": metrics["objective/response_length"] * n / elapsed,
                        "perf/generation_share": gen_s / elapsed, "perf/update_s": elapsed,
                        "perf/world_size": self.world.size, "perf/rank_rollout": len(idx)})
        shown = self.prompt_texts(rows, samples)
        table = distributed.gather_rows([{"prompt": p, "completion": t, "score": s}
                                         for p, t, s in zip(shown, texts, b.returns().tolist(), strict=True)])
        return metrics, table

    # ---- held-out evaluation and the run loop -------------------------------------------------------
    def heldout_scores(self) -> tuple[float, list[dict]] | None:
        """Mean score over `heldout_samples` completions of each held-out prompt, and their table rows
        (its own generator, so training's RNG stream is untouched and every evaluation sees the same draws)."""
        if not self.parts.heldout_rows:
            return None
        gen = torch.Generator(self.parts.device).manual_seed(self.cfg.seed + 1)
        k, bs = self.cfg.heldout_samples, self.cfg.batch_size
        # each prompt k times in a row: (prompt, sample) pairs, batched like training rollouts
        pairs = [(i, j) for i in range(len(self.parts.heldout_rows)) for j in range(k)]
        table = []
        for s in range(0, len(pairs), bs):
            table += distributed.checked(self._heldout_batch, pairs[s:s + bs], gen)
        table = distributed.gather_rows(table)
        return sum(r["score"] for r in table) / len(table), table

    def _heldout_batch(self, pairs: list[tuple[int, int]], gen: torch.Generator) -> list[dict]:
        """This rank's part of one held-out batch of (prompt, sample) pairs, sampled and scored."""
        cols = distributed.uneven_shard(len(pairs))
        batch = pairs[cols]
        if not batch:  # more ranks than pairs: the others' draws and collectives, no sample
            self.idle_batch(len(pairs), gen)
            return []
        rows = [self.parts.heldout_rows[i] for i, _ in batch]
        # with an env, held-out prompt i always plays environment seed (seed, i): the same games each time
        seeds = [int(np.random.default_rng([self.cfg.seed, 1, i]).integers(2**62)) for i, _ in batch]
        _, _, samples, texts = self.sample_batch(rows, [self.parts.heldout_ids[i] for i, _ in batch], seeds, gen,
                                                 len(pairs), cols)
        scores = samples.returns() if isinstance(samples, Episodes) else self.score(rows, texts, samples)
        return [{"prompt": p, "sample": j, "completion": t, "score": x} for p, (_, j), t, x in
                zip(self.prompt_texts(rows, samples), batch, texts, scores.tolist(), strict=True)]

    def run(self) -> TrainResult:
        cfg, main = self.cfg, self.world.is_main  # rank 0 alone writes the run dir
        if main:
            save_config(cfg, self.run_dir / "config.yaml", note=distributed.describe(cfg.batch_size, "prompts"))
            if self.update == 0:
                trust.record(self.run_dir, cfg)
            for name in ("metrics.jsonl", "completions.jsonl"):
                truncate_metrics(self.run_dir / name, self.update)
        logger = MetricsLogger(self.run_dir, tensorboard=cfg.tensorboard) if main else NullLogger()
        progress = Progress(cfg.total_updates, self.update, enabled=cfg.progress and main, unit="update")
        last: dict = {}

        def after_update(result) -> None:
            metrics, table = result
            last.update(metrics)
            if self.update % cfg.log_every == 0 or self.update == cfg.total_updates:
                logger.log(self.update, metrics)
                self._log_table(logger, "train", table)
            progress.advance(1, score=metrics["objective/scores"], kl=metrics.get("objective/kl"))

        try:
            if self.update == 0:
                self._log_heldout(logger)
                if cfg.nonfinite_action == "rollback":
                    self.run_guard.save()  # a rollback needs a checkpoint to go back to
            stopped = train_loop(self, self.run_guard, cfg.total_updates, cfg.checkpoint_every, after_update)
            if self.update == cfg.total_updates and not stopped:
                self._log_heldout(logger)
                if main or self.sharded:  # sharded, every rank takes part in gathering the weights
                    self.layout.export(self.run_dir / "policy")
                if main:
                    self.tokenizer.save_pretrained(self.run_dir / "policy")
        finally:
            progress.close()
            logger.close()
        if main:
            plot_curves(self.run_dir / "metrics.jsonl", ["objective/scores", "objective/kl", "objective/rlhf_reward",
                        "eval/scores"], self.run_dir / "reward_kl.png", title=f"{curve_title(cfg)}: {cfg.model}")
        return TrainResult(self.run_dir, self.update, self.update * cfg.rollout_size, last, stopped)

    def _log_heldout(self, logger: MetricsLogger) -> None:
        result = self.heldout_scores()
        if result is not None:
            logger.log(self.update, {"eval/scores": result[0]})
            self._log_table(logger, "heldout", result[1])

    def _log_table(self, logger: MetricsLogger, split: str, table: list[dict]) -> None:
        if not self.world.is_main:
            return
        with (self.run_dir / "completions.jsonl").open("a") as f:
            for row in table:
                f.write(json.dumps({"step": self.update, "split": split, **row}) + "\n")
        lines = ["| prompt | completion | score |", "|---|---|---|"]
        lines += [f"| {_cell(r['prompt'])} | {_cell(r['completion'])} | {r['score']:.3f} |"
                  for r in table[:TABLE_ROWS]]
        logger.log_text(self.update, f"completions/{split}", "\n".join(lines))


def curve_title(cfg: RLHFConfig) -> str:
    """e.g. "PPO lora" or "GRPO lora, guess_number?hi=8 episodes"."""
    title = f"{'PPO' if cfg.advantage == 'gae' else cfg.advantage.upper()} {cfg.layout}"
    return f"{title}, {cfg.env} episodes" if cfg.env else title


def _masked(x: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor | None:
    return None if x is None else masked(x, mask)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:200]


def train(cfg: RLHFConfig, run_dir: Path, resume: bool = False, reward_fn=None) -> TrainResult:
    """Train (or, with resume, continue) an RLHF run in `run_dir`. `reward_fn` overrides cfg.reward."""
    trainer = RLHFTrainer(cfg, run_dir, reward_fn)
    if resume:
        # on CPU: generator states must be CPU tensors; optimizer state moves to its params' device itself
        trainer.resume()
    return trainer.run()
