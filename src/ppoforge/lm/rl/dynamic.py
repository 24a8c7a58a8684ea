"""DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476, section 3.2, eq. 11; verl's `filter_groups`,
verl/trainer/ppo/ray_trainer.py): a group whose G scores all agree has advantage 0 under a group baseline,
so it is dropped and fresh prompts are drawn until the batch holds `batch_size` groups that disagree.

One call, two implementations chosen once (`rounds_for`): `OneRound` draws the rollout once (the plain
loop), `DynamicSampling` draws whole batches of `batch_size` fresh prompts, at most `dynamic_sampling_tries`
more than the first, and keeps the first `batch_size` informative groups in draw order (verl also keeps
the first and discards the surplus of the last round). Deliberate difference from verl, which raises when
its `max_num_gen_batches` run out: the batch is topped up with the first dropped groups, so the rollout
keeps its size (mini-batches, the loss normalizers and the resume state all assume it) and a hard patch of
data slows the run instead of killing it; a group that agrees adds no policy gradient under grpo or
rloo, so a topped-up batch trains what the plain loop would. Every round advances the data cursor
(`next_prompts`) and the shared generator, both in the checkpoint: a resumed run draws the same rounds.
Groups are judged on the reward's scores, before overlong shaping (DAPO filters on accuracy). Single
process only: the refilled rollout takes groups from whichever rank sampled them, and moving them would
be a second data path; under torchrun `dynamic_sampling` is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from ppoforge.core.dapo import informative_groups
from ppoforge.errors import UserError
from ppoforge.lm.rl.collect import Batch, take_rows
from ppoforge.lm.rl.config import RLHFConfig


class Drawn(NamedTuple):
    """One collected and scored batch of prompts."""
    batch: Batch           # this rank's responses
    scores: torch.Tensor   # (B,) the global batch's scores as the guard passed them (clipped)
    finite: bool           # every score finite (else the guard skips the update)
    gen_s: float           # seconds spent sampling
    terms: dict[str, torch.Tensor] | None = None  # (B,) each reward term's global unweighted rewards, by name


Draw = Callable[[], Drawn]  # the trainer's: the next batch_size prompts collected and scored


class OneRound:
    """The plain rollout: one draw, nothing filtered, no metrics."""

    def __call__(self, draw: Draw) -> tuple[Drawn, dict[str, float]]:
        return draw(), {}


def fill_groups(informative: list[list[bool]], n_groups: int) -> list[tuple[int, int]]:
    """The (round, group) pairs a batch of `n_groups` trains, in draw order: the first `n_groups`
    informative groups, topped up with the first uninformative ones when the rounds had fewer."""
    pairs = [(r, k) for r, row in enumerate(informative) for k in range(len(row))]
    kept = [(r, k) for r, k in pairs if informative[r][k]][:n_groups]
    filler = [(r, k) for r, k in pairs if not informative[r][k]][:n_groups - len(kept)]
    return sorted(kept + filler)


class DynamicSampling:
    """Draws until `n_groups` informative groups of `group_size` are in hand, or `tries` extra rounds are
    spent; returns the refilled draw and its `dynamic/` metrics."""

    def __init__(self, n_groups: int, group_size: int, tries: int, pad_id: int):
        self.n_groups, self.group_size, self.tries, self.pad_id = n_groups, group_size, tries, pad_id

    def __call__(self, draw: Draw) -> tuple[Drawn, dict[str, float]]:
        rounds: list[Drawn] = []
        informative: list[list[bool]] = []
        while len(rounds) <= self.tries and sum(map(sum, informative)) < self.n_groups:
            rounds.append(draw())
            if not rounds[-1].finite:  # the guard skips this update: it keeps the round whole, draws no more
                return rounds[-1]._replace(gen_s=sum(d.gen_s for d in rounds)), self._metrics(rounds, informative, [])
            informative.append(informative_groups(rounds[-1].scores, self.group_size).tolist())
        chosen = fill_groups(informative, self.n_groups)
        parts = [(d, self._rows(chosen, r)) for r, d in enumerate(rounds)]
        parts = [(d, rows) for d, rows in parts if rows]
        batch = take_rows([(d.batch, rows) for d, rows in parts], self.pad_id)
        scores = torch.cat([d.scores[rows] for d, rows in parts])
        terms = {k: torch.cat([d.terms[k][rows] for d, rows in parts]) for k in parts[0][0].terms or {}}
        drawn = Drawn(batch, scores, True, sum(d.gen_s for d in rounds), terms)
        return drawn, self._metrics(rounds, informative, chosen)

    def _rows(self, chosen: list[tuple[int, int]], r: int) -> list[int]:
        """The rows of round r's chosen groups (each group's G rows are contiguous)."""
        g = self.group_size
        return [k * g + j for rr, k in chosen if rr == r for j in range(g)]

    @staticmethod
    def _metrics(rounds: list[Drawn], informative: list[list[bool]], chosen: list[tuple[int, int]]
                 ) -> dict[str, float]:
        filled = sum(not informative[r][k] for r, k in chosen)
        uninformative = sum(not x for row in informative for x in row)
        return {"dynamic/generation_rounds": float(len(rounds)),
                "dynamic/dropped_groups": float(uninformative - filled), "dynamic/filled_groups": float(filled)}


def rounds_for(cfg: RLHFConfig, pad_id: int, world_size: int) -> OneRound | DynamicSampling:
    """The run's rollout rounds: `DynamicSampling` with `dynamic_sampling`, else `OneRound`."""
    if not cfg.dynamic_sampling:
        return OneRound()
    if world_size > 1:
        raise UserError(f"dynamic_sampling: refills the rollout in one process (a refill takes groups from "
                        f"whichever rank sampled them); allowed under torchrun (world {world_size}): false")
    return DynamicSampling(cfg.batch_size, cfg.num_generations, cfg.dynamic_sampling_tries, pad_id)
