"""benchmarks/ppoforge_rlhf_worker.py: ppoforge's side of the GRPO timings does TRL's work every step."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import ppoforge_rlhf_worker  # noqa: E402
import rlhf_workloads  # noqa: E402


def test_the_grpo_timing_trains_on_a_flat_rollout_as_trl_does(tmp_path):
    # the `reasoning` workload's shape (beta 0: the loss is the policy gradient alone) on tiny's models
    wdir = rlhf_workloads.build("tiny", tmp_path / "w")
    w = dataclasses.replace(rlhf_workloads.load_workload(wdir), beta=0.0)
    args = ppoforge_rlhf_worker.worker_args(grpo=True, prompts=2, generations=4, new_tokens=8, micro=4, threads=1)
    cfg = ppoforge_rlhf_worker.rlhf_config(w, wdir, args, wdir / "prompts.jsonl")
    assert cfg.loss_is_policy_gradient_only  # so the trainer's default would skip a flat rollout's update
    assert cfg.skip_flat_rollouts is False
