"""Rollout collection behind one small protocol: a batch of prompt rows in, the responses and what the table
and the reward read out. Two implementations, chosen once (`collector_for`): `SingleTurn` samples each
prompt's response (`lm/models/sampler.py`); `MultiTurn` plays an episode per prompt row against an
environment (`lm/envs/episodes.py`), the environment's seed per prompt, and the environment scores it.

Every draw is the global batch's: a batch is columns `cols` of a global batch of `n_global` rows, and each
rank draws the whole batch's sampling uniforms (`draw_uniforms`, one per row, turn and decode step) and
keeps its columns, so any world size samples the single-process tokens and no collective runs while
decoding. A rank that holds none of a batch's rows calls `idle` instead: the same draws and the
collectives the others run while sampling (sharded, the policy's gather on entering the decoder; with an
environment, the error flag of `distributed.checked`), so the later collectives pair up rather than hang.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Protocol

import torch

from ppoforge.lm.envs.chat import ChatRenderer, prefix_preserving
from ppoforge.lm.envs.episodes import Budgets, episode_metrics, run_episodes, run_episodes_by_turns
from ppoforge.lm.envs.loading import load_env
from ppoforge.lm.models.attention import left_pad
from ppoforge.lm.models.engines import LocalEngine, RolloutEngine
from ppoforge.lm.models.loading import resolve_model
from ppoforge.lm.models.sampler import Samples, SamplingParams, concat_samples, draw_uniforms
from ppoforge.lm.models.vllm_engine import VLLMEngine, VLLMUnavailable, vllm_version
from ppoforge.lm.rl.build import RunInputs
from ppoforge.lm.rl.config import RLHFConfig
from ppoforge.runtime import distributed
from ppoforge.runtime.timeouts import call_with_timeout


@dataclass
class Batch:
    """One collected batch of B responses: the tokens the passes and the update read, and the texts the
    reward and the table read."""
    rows: list[dict]            # the prompt rows, one per response
    ids: torch.Tensor           # (B, P + T) prompt then response tokens
    prompt_mask: torch.Tensor   # (B, P) the prompts' real tokens, left-padded
    samples: Samples            # the responses (multi-turn: `Episodes`, every token after the prompt)
    texts: list[str]            # each response decoded (an episode: its conversation after the first messages)
    prompts: list[str]          # the table's prompt column: the prompt field, or an episode's first message(s)
    turn_rewards: torch.Tensor | None = None  # (B, T) multi-turn: each turn's reward on its last policy token

    @property
    def mask(self) -> torch.Tensor:
        """(B, P + T) float: the real prompt tokens, then every real token after the prompt."""
        return torch.cat([self.prompt_mask.float(), self.samples.attended], 1)


def take_rows(parts: list[tuple[Batch, list[int]]], pad_id: int) -> Batch:
    """Rows `idx` of each single-turn batch of `parts`, one batch in that order (dynamic sampling's refilled
    rollout, `lm/rl/dynamic.py`): prompts left-padded to the widest part's, responses right-padded to the
    longest (`concat_samples`)."""
    width = max(b.prompt_mask.shape[1] for b, _ in parts)

    def left(x: torch.Tensor, fill) -> torch.Tensor:  # (n, P) -> (n, width)
        return torch.cat([x.new_full((x.shape[0], width - x.shape[1]), fill), x], 1)

    prompts, masks, samples = [], [], []
    for b, idx in parts:
        s, n_prompt = b.samples, b.prompt_mask.shape[1]
        prompts.append(left(b.ids[idx, :n_prompt], pad_id))
        masks.append(left(b.prompt_mask[idx], 0))
        samples.append(Samples(s.response_ids[idx], s.response_mask[idx], s.logp[idx], s.finished[idx],
                               None if s.hidden is None else s.hidden[idx]))
    joined = concat_samples(samples, pad_id)

    def rows_of(name: str) -> list:
        return [getattr(b, name)[i] for b, idx in parts for i in idx]

    return Batch(rows_of("rows"), torch.cat([torch.cat(prompts), joined.response_ids], 1), torch.cat(masks),
                 joined, rows_of("texts"), rows_of("prompts"))


class Collector(Protocol):
    gen_batch: int  # rows sampled at a time: the generation batch, halved on out-of-memory

    def seeds(self, n: int, generator: torch.Generator) -> list[int]:
        """The environment seeds of a global training batch's n prompts (each prompt's G responses share
        its seed), drawn from `generator` before the batch's uniforms; single-turn: none drawn (zeros)."""

    def collect(self, rows: list[dict], prompt_ids: list[list[int]], seeds: list[int], generator: torch.Generator,
                n_global: int, cols: slice) -> Batch:
        """The rows sampled (or their episodes played: row i with environment seed seeds[i]), as columns
        `cols` of a global batch of `n_global` rows."""

    def idle(self, n_global: int, generator: torch.Generator) -> None:
        """`collect` on a rank that holds no row of a global batch of `n_global`: its draws and collectives."""

    def scores(self, batch: Batch) -> torch.Tensor:
        """(B,) the scores the advantages start from: the reward's, or the environments' final ones."""

    def returns(self, batch: Batch) -> torch.Tensor:
        """(B,) each response's whole reward (an episode's: its turn rewards plus its score)."""

    def metrics(self, batch: Batch) -> dict[str, float]:
        """The batch's own metrics (multi-turn: env/, `episode_metrics`; single-turn: none)."""


def collector_for(cfg: RLHFConfig, inputs: RunInputs) -> Collector:
    """The run's collector: episodes against `cfg.env`, else single-turn sampling."""
    return MultiTurn(cfg, inputs) if cfg.env else SingleTurn(cfg, inputs)


def engine_for(cfg: RLHFConfig, inputs: RunInputs, gen_batch: int) -> RolloutEngine:
    """The run's rollout engine, chosen once (`rollout_engine`): auto is vllm on CUDA where vLLM is installed
    (docs/benchmarks.md measured it no faster than the lean decoder on a CPU), else the layout's decoder."""
    name = cfg.rollout_engine
    if name == "auto":
        name = "vllm" if inputs.device.type == "cuda" and vllm_version() else cfg.layout_decoder
    if name != "vllm":
        return LocalEngine(inputs.layout, inputs.precision, gen_batch, "local" if name == "auto" else name)
    dtype = inputs.precision.dtype or torch.float32
    turns = cfg.episode_tokens if cfg.env else cfg.max_new_tokens
    try:
        return VLLMEngine(resolve_model(cfg.model), inputs.layout, inputs.device, dtype, gen_batch,
                          cfg.max_prompt_tokens + turns, cfg.seed, cfg.vllm_gpu_memory_utilization, cfg.vllm_sleep,
                          cfg.rollout_timeout, cfg.sync_timeout, cfg.vllm_lora_sync)
    except VLLMUnavailable as e:  # installed but not importable (built for another torch): auto falls back
        if cfg.rollout_engine != "auto":
            raise
        print(f"ppoforge: info: rollout_engine auto: {e}; sampling with the {cfg.layout_decoder} decoder instead",
              file=sys.stderr)
        return LocalEngine(inputs.layout, inputs.precision, gen_batch, "local")


def _sampling(cfg: RLHFConfig, inputs: RunInputs) -> SamplingParams:
    return SamplingParams(cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p, inputs.stop_ids,
                          inputs.tokenizer.pad_token_id)


class SingleTurn:
    """Each prompt row sampled once per response (by the run's rollout engine); the reward function scores
    the decoded completions."""

    def __init__(self, cfg: RLHFConfig, inputs: RunInputs):
        self.cfg, self.inputs, self.layout, self.precision = cfg, inputs, inputs.layout, inputs.precision
        self.sampling = _sampling(cfg, inputs)
        # the most rows sampled at once: a rollout, or a held-out batch (its prompts' samples); halved on
        # out-of-memory
        self.engine = engine_for(cfg, inputs, max(cfg.rollout_size, cfg.batch_size * cfg.heldout_samples))
        # a prompt's rows come in a row (G completions, held-out samples): prefilled once (shared_prefix off:
        # once per row, as TRL does)
        self.share_prefill = cfg.shared_prefix == "auto"

    @property
    def gen_batch(self) -> int:
        return self.engine.gen_batch

    def seeds(self, n: int, generator: torch.Generator) -> list[int]:
        return [0] * n  # no environment: nothing drawn

    def generate(self, token_rows: list[list[int]], generator: torch.Generator, n_global: int | None = None,
                 cols: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor, Samples]:
        """Left-pad the prompts and sample, `gen_batch` rows at a time (halved on out-of-memory; each row
        draws its own pre-drawn uniforms, so the split changes no draw); returns (prompt + response ids,
        prompt mask, samples). The rows are columns `cols` of a global batch of `n_global` (default: these)."""
        prompt_ids, prompt_mask = left_pad(token_rows, self.sampling.pad_id, self.inputs.device)
        uniforms = draw_uniforms(self.sampling, n_global or prompt_ids.shape[0], generator)[:, cols]
        samples = self.engine.generate(prompt_ids, prompt_mask, self.sampling, uniforms, self.share_prefill)
        return torch.cat([prompt_ids, samples.response_ids], 1), prompt_mask, samples

    def collect(self, rows: list[dict], prompt_ids: list[list[int]], seeds: list[int], generator: torch.Generator,
                n_global: int, cols: slice) -> Batch:
        ids, prompt_mask, samples = self.generate(prompt_ids, generator, n_global, cols)
        prompts = [r[self.cfg.prompt_field] for r in rows]
        return Batch(rows, ids, prompt_mask, samples, self.completions(samples), prompts)

    def idle(self, n_global: int, generator: torch.Generator) -> None:
        draw_uniforms(self.sampling, n_global, generator)
        if self.layout.sharded:
            with self.layout.decoder():
                pass

    def completions(self, samples: Samples) -> list[str]:
        lengths = samples.response_mask.sum(1).long().tolist()
        return self.inputs.tokenizer.batch_decode([ids[:n] for ids, n in zip(samples.response_ids.tolist(), lengths,
                                                                             strict=True)], skip_special_tokens=True)

    def scores(self, batch: Batch) -> torch.Tensor:
        return self.score(batch.rows, batch.texts, batch.samples)

    def returns(self, batch: Batch) -> torch.Tensor:
        return self.scores(batch)

    def score(self, rows: list[dict], texts: list[str], samples: Samples) -> torch.Tensor:
        """The reward's scores (B,), under `call_timeout`; not yet checked for finiteness (the guard does)."""
        prompts = [r[self.cfg.prompt_field] for r in rows]
        with torch.inference_mode(), self.precision.autocast():
            scores = call_with_timeout(lambda: self.inputs.score(prompts, texts, samples.finished.tolist(), rows),
                                       self.cfg.call_timeout, f"reward {self.cfg.reward}")
        return scores.to(self.inputs.device)

    def metrics(self, batch: Batch) -> dict[str, float]:
        return {}


class MultiTurn:
    """One episode per prompt row against a fresh environment (its factory, the chat renderer that turns its
    messages into tokens, the budgets); the environments score the episodes. Under torchrun an
    environment that raises on one rank stops every rank (`distributed.checked`)."""

    def __init__(self, cfg: RLHFConfig, inputs: RunInputs):
        self.cfg, self.inputs, self.layout, self.precision = cfg, inputs, inputs.layout, inputs.precision
        self.sampling = _sampling(cfg, inputs)
        # episodes decode turn-synchronously, the whole batch at once: on the layout's decoder with one KV
        # cache for the whole episode (`run_episodes`), or through an engine that takes whole sequences, a
        # turn at a time (`run_episodes_by_turns`: vLLM)
        self.engine = engine_for(cfg, inputs, cfg.rollout_size)
        self.local = isinstance(self.engine, LocalEngine)
        self.factory = load_env(cfg.env, cfg.call_timeout)
        self.renderer = ChatRenderer(inputs.tokenizer, cfg.end_check)
        self.budgets = Budgets(cfg.max_turns, cfg.episode_tokens, cfg.max_env_tokens, cfg.env_overflow)
        preserving, why = prefix_preserving(inputs.tokenizer)
        if not preserving:
            print(f"ppoforge: the chat template of {cfg.model} is not prefix-preserving ({why}): environment "
                  "tokens rendered as template diffs will not match the template's rendering of whole "
                  "conversations (end_check counts or refuses them)", file=sys.stderr)

    @property
    def gen_batch(self) -> int:
        return self.cfg.rollout_size

    def seeds(self, n: int, generator: torch.Generator) -> list[int]:
        return torch.randint(2**62, (n,), generator=generator, device=generator.device).tolist()

    def collect(self, rows: list[dict], prompt_ids: list[list[int]], seeds: list[int], generator: torch.Generator,
                n_global: int, cols: slice) -> Batch:
        """`prompt_ids` are unused: the environment's reset() gives each episode's first messages."""
        uniforms = draw_uniforms(self.sampling, n_global, generator, self.budgets.max_turns)[:, cols]

        def play():
            envs = [self.factory() for _ in rows]
            if not self.local:
                return run_episodes_by_turns(self.engine, self.renderer, envs, rows, seeds, self.sampling,
                                             self.budgets, uniforms, self.cfg.max_prompt_tokens, self.inputs.device)
            with self.layout.decoder() as decoder, self.precision.autocast():
                return run_episodes(decoder, self.renderer, envs, rows, seeds, self.sampling, self.budgets, uniforms,
                                    self.cfg.max_prompt_tokens, self.inputs.device,
                                    share_prefill=self.cfg.shared_prefix == "auto")

        prompt_ids, prompt_mask, episodes = distributed.checked(play)
        return Batch(rows, torch.cat([prompt_ids, episodes.response_ids], 1), prompt_mask, episodes,
                     episodes.transcripts, episodes.first_messages, episodes.turn_rewards)

    def idle(self, n_global: int, generator: torch.Generator) -> None:
        draw_uniforms(self.sampling, n_global, generator, self.budgets.max_turns)

        def gather_policy():
            if self.layout.sharded:
                with self.layout.decoder():
                    pass

        distributed.checked(gather_policy)

    def scores(self, batch: Batch) -> torch.Tensor:
        return batch.samples.scores

    def returns(self, batch: Batch) -> torch.Tensor:
        return batch.samples.returns()

    def metrics(self, batch: Batch) -> dict[str, float]:
        return episode_metrics(batch.samples)
