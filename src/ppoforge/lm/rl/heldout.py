"""Held-out evaluation: `heldout_samples` completions (or episodes) of every held-out prompt, scored, before and
after training (`eval/scores`, the `heldout` rows of completions.jsonl).

It draws from its own generator, seeded `seed + 1` at every evaluation, so training's RNG stream is
untouched and every evaluation sees the same draws; with an environment, held-out prompt i always plays
environment seed (seed, 1, i): the same games each time. The (prompt, sample) pairs are batched like
training rollouts (batch_size prompts, each `heldout_samples` times in a row, as a GRPO rollout has its G),
each batch split over the ranks (`uneven_shard`) and gathered.
"""

from __future__ import annotations

import numpy as np
import torch

from ppoforge.lm.rl.build import RunInputs
from ppoforge.lm.rl.collect import Collector
from ppoforge.lm.rl.config import RLHFConfig
from ppoforge.runtime import distributed


class Heldout:
    """Call it: (mean score, table rows) over the held-out prompts, or None without any."""

    def __init__(self, cfg: RLHFConfig, inputs: RunInputs, collector: Collector):
        self.cfg, self.collector = cfg, collector
        self.rows, self.prompt_ids, self.device = inputs.heldout_prompt_rows, inputs.heldout_prompt_ids, inputs.device

    def __call__(self) -> tuple[float, list[dict]] | None:
        if not self.rows:
            return None
        gen = torch.Generator(self.device).manual_seed(self.cfg.seed + 1)
        k = self.cfg.heldout_samples
        bs = self.cfg.batch_size * k  # batch_size prompts, each k times in a row: one prefill each
        pairs = [(i, j) for i in range(len(self.rows)) for j in range(k)]
        table = []
        for s in range(0, len(pairs), bs):
            table += distributed.checked(self._batch, pairs[s:s + bs], gen)
        table = distributed.gather_rows(table)
        return sum(r["score"] for r in table) / len(table), table

    def _batch(self, pairs: list[tuple[int, int]], gen: torch.Generator) -> list[dict]:
        """This rank's part of one held-out batch of (prompt, sample) pairs, sampled and scored."""
        cols = distributed.uneven_shard(len(pairs))
        batch = pairs[cols]
        if not batch:  # more ranks than pairs: the others' draws and collectives, no sample
            self.collector.idle(len(pairs), gen)
            return []
        rows = [self.rows[i] for i, _ in batch]
        seeds = [int(np.random.default_rng([self.cfg.seed, 1, i]).integers(2**62)) for i, _ in batch]
        out = self.collector.collect(rows, [self.prompt_ids[i] for i, _ in batch], seeds, gen, len(pairs), cols)
        scores = self.collector.returns(out)
        return [{"prompt": p, "sample": j, "completion": t, "score": x} for p, (_, j), t, x in
                zip(out.prompts, batch, out.texts, scores.tolist(), strict=True)]
