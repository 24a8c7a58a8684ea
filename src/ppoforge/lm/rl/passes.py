"""A rollout's old log-probs, values and reference log-probs: fast where that is exact, else recomputed.

The fast path reuses what sampling already produced — the sampler's log-probs of its tokens and, when
the value head reads the policy's trunk, its hidden states — and runs the LoRA reference through the
lean decoder's prepared weights. The plain path runs the training forward (Hugging Face modules) for
the policy and the reference. PPO's ratio at the first mini-batch must be exactly 1 and the KL of an
untrained policy exactly 0, so the fast path is used only where it is bit-identical to the plain one:
with `old_logprobs: auto` the first rollout computes both, keeps the plain numbers, and decides for the
rollouts of its shape class (rows, length bucket, chunk size), separately for the policy and the reference;
a rollout of another class checks again, and a path found inexact is recomputed for the rest of the run.
Whether they agree depends on kernels, not on the code: measured on CPU, bf16 with eager attention is
exact on torch 2.6 and 2.13; fp32 is not (an fp32 GEMM of the decode's B rows rounds differently from the
forward's B * T rows, ~5e-7), nor is SDPA; GPUs are another set of kernels again.

Every pass runs over `chunk_rows` rows of the rollout at a time (the training micro-batch, whole shared-prefix
units), halved on out-of-memory: memory is bounded by the micro-batch, not by the rollout's size.

Without a critic (the critic-free estimators) there are no values: None, and no critic pass; without
a KL term (`kl_coef: 0`) there is no reference pass: its log-probs are None. With `policy=False` (a
rollout trained in one optimizer step, see `RLHFTrainer`) nothing needs the old log-probs before the
update, which takes them from its own forward: the sampler's stand in for the rollout's KL metric.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from ppoforge.lm.models.layouts import Layout
from ppoforge.lm.models.logprobs import head_logprobs
from ppoforge.lm.models.parts import head_size
from ppoforge.lm.models.rows import TokenRows, padded
from ppoforge.lm.models.sampler import Samples
from ppoforge.runtime import distributed
from ppoforge.runtime.oom import retry_halving


class RolloutPasses:
    """Call it on a rollout: (old logp, values, ref logp), (B, T) fp32 each, under the caller's autocast;
    values None without a critic, ref logp None without a reference (`reference=False`)."""

    def __init__(self, layout: Layout, mode: str, temperature: float, chunk_rows: int, where: str,
                 critic: bool = True, reference: bool = True, policy: bool = True,
                 rows_for: Callable[[torch.Tensor, torch.Tensor, int], TokenRows] = padded,
                 unit: Callable[[], int] = lambda: 1):
        self.layout, self.temperature, self.chunk_rows, self.where = layout, temperature, chunk_rows, where
        self.vocab = head_size(layout.policy_model)
        self.rows_for = rows_for  # the rollout -> the rows its forwards run (lm/models/rows.py)
        self.unit = unit  # the rows rows_for keeps together (a shared-prefix unit): chunks hold whole units
        self.critic, self.reference = critic, reference
        trust = {"sampler": True, "recompute": False, "auto": None}[mode]
        self.fast_policy = trust if policy else True  # None: decided on the first rollout
        self.fast_reference = trust if layout.fast_ref_forward is not None else False
        # `auto`'s decisions hold for one shape class: kernels change with the row count, the length and the
        # chunk (cuBLAS heuristics, oneDNN blocking, a chunk halved after an out-of-memory)
        self.recheck = {"policy": mode == "auto" and policy,
                        "reference": mode == "auto" and self.fast_reference is None}
        self.shape_class: tuple | None = None

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor, samples: Samples):
        """Every pass in chunks of `chunk_rows` rollout rows (whole units), halved and redone on out-of-memory:
        the peak is one chunk's, whatever the rollout's size."""
        self._recheck_on_new_shape(ids)
        parts, self.chunk_rows = retry_halving(lambda n: [self._chunk(ids[c], mask[c], _rows_of(samples, c))
                                                          for c in self._chunks(ids.shape[0], n)],
                                               self.chunk_rows, "scoring chunk", retry=not self.layout.sharded)
        out = {k: None if parts[0][k] is None else torch.cat([p[k] for p in parts]) for k in parts[0]}
        m = samples.response_mask
        if self.fast_policy is None:  # decided on the whole rollout: the ranks and chunks decide alike
            self.fast_policy = self._same("policy", (out["logp"], out["values"]),
                                          (out["fast_logp"], out["fast_values"]), m, ("log-probs", "values"))
        if out.get("fast_ref") is not None and self.fast_reference is None:
            self.fast_reference = self._same("reference", (out["ref"],), (out["fast_ref"],), m, ("log-probs",))
        return out["logp"], out["values"], out["ref"]

    def _recheck_on_new_shape(self, ids: torch.Tensor) -> None:
        """With `auto`, a fast path found exact is checked again when the rollout's shape class changes: its
        rows, its length (bucketed to a power of 2) or the chunk size."""
        shape_class = (ids.shape[0], 1 << max(ids.shape[1] - 1, 0).bit_length(), self.chunk_rows)
        if shape_class != self.shape_class and self.shape_class is not None:
            if self.recheck["policy"] and self.fast_policy is True:
                self.fast_policy = None
            if self.recheck["reference"] and self.fast_reference is True:
                self.fast_reference = None
        self.shape_class = shape_class

    def _chunks(self, n_rows: int, chunk: int) -> list[slice]:
        k = max(self.unit(), 1)
        step = max(k, chunk // k * k)
        return [slice(s, min(s + step, n_rows)) for s in range(0, n_rows, step)]

    def _chunk(self, ids: torch.Tensor, mask: torch.Tensor, samples: Samples) -> dict:
        """One chunk's logp, values and ref (None where there is no such pass); while a fast path is still
        undecided, also its fast_logp / fast_values / fast_ref, for `_same` on the whole rollout."""
        out, rows = {"fast_logp": None, "fast_values": None, "fast_ref": None, "ref": None}, None
        if self.fast_policy is not True or self.critic or self.reference:  # a pass will run
            rows = self.rows_for(ids, mask, samples.response_ids.shape[1])
        if self.fast_policy is None:
            out["logp"], out["values"] = self._policy_plain(rows, samples)
            out["fast_logp"], out["fast_values"] = self._policy_fast(rows, samples)
        else:
            out["logp"], out["values"] = (self._policy_fast if self.fast_policy else self._policy_plain)(rows, samples)
        if not self.reference:
            return out
        if self.fast_reference is None:
            out["ref"] = self._reference(rows, samples, self.layout.ref_forward)
            out["fast_ref"] = self._reference(rows, samples, self.layout.fast_ref_forward)
        else:
            forward = self.layout.fast_ref_forward if self.fast_reference else self.layout.ref_forward
            out["ref"] = self._reference(rows, samples, forward)
        return out

    def _logprobs(self, head, hidden: torch.Tensor, resp: torch.Tensor) -> torch.Tensor:
        """fp32 log-probs of resp (B, T) from hidden (B, T, H), `chunk_rows` rows at a time: the training
        micro-batch's rows, chunked as `head_logprobs` chunks them there (the same numbers)."""
        step = self.chunk_rows
        return torch.cat([head_logprobs(head, hidden[s:s + step], resp[s:s + step], self.vocab, self.temperature,
                                        entropy=False)[0] for s in range(0, resp.shape[0], step)])

    def _policy_plain(self, rows: TokenRows, samples: Samples):
        """Log-probs and values from one training forward of the policy (and the critic)."""
        hidden, values = self.layout.forward(rows)
        return self._logprobs(self.layout.logits, hidden, samples.response_ids), values

    def _policy_fast(self, rows: TokenRows | None, samples: Samples):
        """The sampler's log-probs; values from its hidden states where the value head reads the policy's
        trunk, else from the critic's own pass (none without a critic)."""
        if not self.critic:
            return samples.logp, None
        values = None if samples.hidden is None else self.layout.sampled_values(samples.hidden)
        if values is None:
            values = self.layout.values(rows)
        return samples.logp, values

    def _reference(self, rows: TokenRows, samples: Samples, forward) -> torch.Tensor:
        hidden = forward(rows)
        return self._logprobs(self.layout.ref_logits, hidden, samples.response_ids)

    def _same(self, what: str, plain, fast, m: torch.Tensor, names: tuple[str, ...]) -> bool:
        """Bit for bit on real tokens (values None: no critic)? If not, one info line on stderr says what the
        run does about it (recompute): not a fault, the exactness rule working (in bf16 the sampler's kernels
        round differently from the training forward's; a ratio not exactly 1 before any update is a bias).
        A path found inexact is never checked again, so the line comes once per path and run."""
        gaps = {name: float(((p - f) * m).abs().max()) for name, p, f in zip(names, plain, fast, strict=True)
                if p is not None}
        if not distributed.any_true(any(g != 0 for g in gaps.values())):  # the ranks decide alike
            return True
        diff = ", ".join(f"{name} by up to {gap:.2g}" for name, gap in gaps.items() if gap) or "on another rank"
        line = (f"the sampler's log-probs are not bit-identical to the training forward's ({diff}), so ppoforge "
                "is recomputing old log-probs with the training forward (one more forward per update; PPO's "
                "ratio starts at exactly 1)" if what == "policy" else
                f"the fast reference pass is not bit-identical to the training forward ({diff}), so the "
                "reference runs through Hugging Face's forward")
        if distributed.is_main():  # the ranks decided alike: one line
            print(f"ppoforge: info: on {self.where} {line}", file=sys.stderr)
        return False


def _rows_of(samples: Samples, rows: slice) -> Samples:
    """Rows `rows` of a rollout's samples."""
    def part(x):
        return None if x is None else x[rows]
    return Samples(samples.response_ids[rows], samples.response_mask[rows], samples.logp[rows],
                   samples.finished[rows], part(samples.hidden), part(samples.token_mask))
