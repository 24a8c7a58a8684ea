"""The rollout engine: what turns a batch of prompt token ids into sampled responses, behind one protocol.

Two implementations, chosen once per run (`lm/rl/collect.py: engine_for`): `LocalEngine` decodes with the
layout's own decoder (`decoder: lean | hf`, `lm/models/sampler.py`) under the run's autocast; `VLLMEngine`
(`lm/models/vllm_engine.py`) hands the token ids to an in-process vLLM engine. The collectors, the held-out
evaluation and the trainer see only this protocol: token ids in, `Samples` out, and a note when the
trained weights changed (`weights_changed`), which an engine holding its own copy of them (vLLM) syncs
before its next generation.

`exact` says whether the engine's log-probs are the training forward's to the bit where the exactness check
(`lm/rl/passes.py`) finds them so; an engine that is never exact (vLLM: other kernels, another
precision path) has its old log-probs recomputed by the training forward every rollout.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ppoforge.lm.models.sampler import Samples, SamplingParams, concat_samples, sample
from ppoforge.runtime.oom import retry_halving


class RolloutEngine(Protocol):
    name: str     # lean, hf or vllm: what the run's metrics and messages call it
    exact: bool   # can its log-probs stand in for the training forward's (checked) or never
    gen_batch: int  # rows sampled at a time, halved on out-of-memory

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams,
                 uniforms: torch.Tensor, share_prefill: bool = False) -> Samples:
        """Sample each left-padded prompt (B, P) once; `uniforms` (max_new_tokens, B) are the rows' draws
        (`draw_uniforms`): an engine that draws its own derives each row's seed from them."""

    def weights_changed(self) -> None:
        """The trained weights changed (an optimizer step, a resume, a rollback)."""

    def take_sync_seconds(self) -> float:
        """Seconds spent syncing weights into the engine since the last call (0 for the local engines)."""

    def close(self) -> None: ...


class LocalEngine:
    """The layout's own decoder (lean or HF) in this process: it reads the trained weights themselves, so
    there is nothing to sync."""

    exact = True

    def __init__(self, layout, precision, gen_batch: int, name: str):
        self.layout, self.precision, self.gen_batch, self.name = layout, precision, gen_batch, name

    def generate(self, prompt_ids, prompt_mask, params, uniforms, share_prefill=False) -> Samples:
        # entered once, retries inside: sharded, entering gathers the policy (a collective)
        with self.layout.decoder() as decoder, self.precision.autocast():
            parts, self.gen_batch = retry_halving(
                lambda n: [sample(decoder, prompt_ids[s:s + n], prompt_mask[s:s + n], params,
                                  uniforms=uniforms[:, s:s + n], share_prefill=share_prefill)
                           for s in range(0, prompt_ids.shape[0], n)],
                self.gen_batch, "generation batch")
        return concat_samples(parts, params.pad_id)

    def weights_changed(self) -> None:
        pass

    def take_sync_seconds(self) -> float:
        return 0.0

    def close(self) -> None:
        pass
