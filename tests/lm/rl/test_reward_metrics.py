"""Per-reward metrics as TRL logs them (issue 39): with several reward terms, each term's unweighted rewards
over the rollout as `rewards/<name>/mean` and `rewards/<name>/std`, beside the weighted total."""

import math

import pytest
import torch

from ppoforge.config import build_config
from ppoforge.lm.rl.config import RLHFConfig
from ppoforge.lm.rl.rewards import WeightedSum, build_reward, term_metrics
from ppoforge.lm.rl.trainer import train
from ppoforge.runtime.metrics import read_metrics

PROMPTS = ["Tell me about the sea.", "Write a line about cats.", "Say something kind.", "Describe a tree."]


def test_each_reward_term_is_logged_with_its_mean_and_std(tiny_lm_dir, prompts_file, tmp_path):
    cfg = build_config(RLHFConfig, dict(
        model=str(tiny_lm_dir), prompts=str(prompts_file), heldout_prompts=None, reward="length:4,eos_penalty:1",
        reward_weights="0.5,2", max_new_tokens=6, batch_size=4, mini_batch_size=4, ppo_epochs=1, total_updates=2,
        device="cpu", seed=0, torch_threads=1, progress=False, tensorboard=False, precision="fp32"))
    train(cfg, tmp_path)
    for row in read_metrics(tmp_path / "metrics.jsonl"):
        for name in ("length", "eos_penalty"):
            assert math.isfinite(row[f"rewards/{name}/mean"]) and row[f"rewards/{name}/std"] >= 0, row
        # the total is the weighted sum of the terms' means
        total = 0.5 * row["rewards/length/mean"] + 2 * row["rewards/eos_penalty/mean"]
        assert row["objective/scores"] == pytest.approx(total, abs=1e-5), row


def test_term_names_and_statistics():
    reward = build_reward("length:3,format:a{1,2},eos_penalty:1")
    assert isinstance(reward, WeightedSum) and reward.metric_names == ["length", "format", "eos_penalty"]
    total = reward(["p", "p", "p"], ["a", "bbb", "aa"], finished=[True, False, True])
    assert len(total) == 3 and set(reward.last_terms) == {"length", "format", "eos_penalty"}
    m = term_metrics({"eos_penalty": torch.tensor([0.0, -1.0, 0.0])})
    # mean -1/3; unbiased std sqrt(((1/3)^2 * 2 + (2/3)^2) / 2) = sqrt(1/3)
    assert m["rewards/eos_penalty/mean"].item() == pytest.approx(-1 / 3)
    assert m["rewards/eos_penalty/std"].item() == pytest.approx(3 ** -0.5)
    assert WeightedSum([("py:a:fn", len, 1.0), ("py:b:fn", len, 1.0)]).metric_names == ["fn", "fn_2"]
