"""The Python API's SFT, reward-model and control trainers (src/ppoforge/api.py): step() by step() is train() —
the same metrics.jsonl rows, checkpoints, export and final weights — and past the end one line; an
already-loaded model (and tokenizer) trains exactly as its path does, and is left as it was. Tiny random models
built here (lm/models/tiny.py), CartPole for control."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from ppoforge import ControlConfig, ControlTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer, UserError
from ppoforge.lm.models.tiny import save_tiny_lm
from ppoforge.runtime.metrics import read_metrics

CHATS = [{"prompt": f"Say {w}.", "completion": f"{w.capitalize()}!"} for w in ["hi", "yes", "no", "thanks"] * 5]
PAIRS = [{"prompt": f"Rate the {w}.", "chosen": f"The {w} is lovely.", "rejected": "Bad."}
         for w in ["sea", "sky", "rain", "city", "film"] * 4]
QUIET = {"progress": False, "tensorboard": False}
TIMING = ("perf/", "charts/SPS")  # wall-clock numbers: the rest of a row is the run's own


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_tiny_lm(tmp_path_factory.mktemp("api-steps") / "tiny-lm")


def rows(run: Path) -> list[dict]:
    """metrics.jsonl without its timing numbers."""
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in read_metrics(run / "metrics.jsonl")]


def weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def sft(model, tokenizer=None, run=None, **fields) -> SFTTrainer:
    args = SFTConfig.from_preset("tiny", **{"max_steps": 3, "batch_size": 4, "micro_batch_size": 2, "eval_every": 2,
                                            "checkpoint_every": 2, "sample_prompts": 1, "sample_tokens": 4, **QUIET,
                                            **fields})
    return SFTTrainer(model=model, tokenizer=tokenizer, train_dataset=CHATS, args=args, output_dir=run)


def reward(model, tokenizer=None, run=None, **fields) -> RewardTrainer:
    args = RewardConfig.from_preset("tiny", **{"max_steps": 3, "batch_size": 4, "eval_every": 2,
                                               "checkpoint_every": 2, **QUIET, **fields})
    return RewardTrainer(model=model, tokenizer=tokenizer, train_dataset=PAIRS, args=args, output_dir=run)


@pytest.mark.parametrize("make", [sft, reward], ids=["sft", "reward"])
def test_supervised_step_by_step_is_train(make, tiny, tmp_path):
    whole = make(str(tiny), run=tmp_path / "train")
    result = whole.train()
    by_hand = make(str(tiny), run=tmp_path / "steps")
    first = by_hand.step()
    assert by_hand.loop.update == 1 and all(type(v) is float for v in first.values()) and "train/loss" in first
    assert not (tmp_path / "steps" / "checkpoint.pt").exists()  # checkpoint_every 2
    by_hand.step()
    assert torch.load(tmp_path / "steps" / "checkpoint.pt", weights_only=False)["update"] == 2
    assert not (tmp_path / "steps" / "model").exists()
    last = by_hand.step()
    assert last["train/loss"] == result["train/loss"] and any(k.startswith("eval/") for k in last)  # it evaluated
    assert rows(tmp_path / "steps") == rows(tmp_path / "train") and [r["step"] for r in rows(tmp_path / "train")] == [
        0, 1, 2, 3]
    assert_same_weights(weights(by_hand.loop.objective.model), weights(whole.loop.objective.model))
    assert torch.load(tmp_path / "steps" / "checkpoint.pt", weights_only=False)["update"] == 3
    assert (tmp_path / "steps" / "model" / "config.json").is_file() or \
        (tmp_path / "steps" / "model" / "adapter_config.json").is_file()
    assert json.loads((tmp_path / "steps" / "summary.json").read_text())["stopped_by"] is None
    with pytest.raises(UserError, match=r"^max_steps: the run has done its 3 steps; allowed: a new trainer, or a "
                                        r"larger max_steps$"):
        by_hand.step()
    with pytest.raises(UserError, match="^max_steps: the run has done its 3 steps"):
        whole.train()


def test_a_step_then_train_goes_on_from_there(tiny, tmp_path):
    straight = sft(str(tiny), run=tmp_path / "train")
    straight.train()
    mixed = sft(str(tiny), run=tmp_path / "mixed")
    mixed.step()
    assert mixed.train()["steps"] == 3
    assert rows(tmp_path / "mixed") == rows(tmp_path / "train")
    assert_same_weights(weights(mixed.loop.objective.model), weights(straight.loop.objective.model))


def test_control_step_by_step_is_train(tmp_path):
    args = ControlConfig.from_preset("cartpole", num_envs=2, num_steps=16, total_steps=96, checkpoint_every=2, **QUIET)
    whole = ControlTrainer("CartPole-v1", args=args, output_dir=tmp_path / "train")
    result = whole.train()
    by_hand = ControlTrainer("CartPole-v1", args=args, output_dir=tmp_path / "steps")
    metrics = [by_hand.step() for _ in range(3)]
    assert result.updates == by_hand.loop.update == 3 and all(type(v) is float for v in metrics[0].values())
    assert metrics[-1]["losses/value_loss"] == rows(tmp_path / "train")[-1]["losses/value_loss"]
    assert rows(tmp_path / "steps") == rows(tmp_path / "train") and len(rows(tmp_path / "train")) == 3
    assert_same_weights(weights(by_hand.loop.agent), weights(whole.loop.agent))
    assert (tmp_path / "steps" / "learning_curve.png").is_file() and (tmp_path / "steps" / "summary.json").is_file()
    assert torch.load(tmp_path / "steps" / "checkpoint.pt", weights_only=False)["update"] == 3
    with pytest.raises(UserError, match=r"^total_steps: the run has done its 3 updates; allowed: a new trainer, or a "
                                        r"larger total_steps$"):
        by_hand.step()


def test_a_loaded_causal_lm_trains_as_its_path(tiny, tmp_path):
    lm, tok = AutoModelForCausalLM.from_pretrained(tiny), AutoTokenizer.from_pretrained(tiny)
    before, side = weights(lm), tok.padding_side
    loaded = sft(lm, tok, run=tmp_path / "loaded")
    loaded.train()
    sft(str(tiny), run=tmp_path / "path").train()
    assert rows(tmp_path / "loaded") == rows(tmp_path / "path")
    assert_same_weights(weights(lm), before) and tok.padding_side == side  # yours is left as it was
    assert f"model: {tiny}" in (tmp_path / "loaded" / "config.yaml").read_text()  # its name_or_path
    assert (tmp_path / "loaded" / "model" / "adapter_config.json").is_file()


def test_a_loaded_reward_model_trains_as_its_path_and_a_wrong_one_is_one_line(tiny, tmp_path):
    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(tiny, num_labels=1)
    tok = AutoTokenizer.from_pretrained(tiny)
    rm.save_pretrained(tmp_path / "rm")  # the same weights (its new score head included) by path
    tok.save_pretrained(tmp_path / "rm")
    before = weights(rm)
    reward(rm, tok, run=tmp_path / "loaded").train()
    reward(str(tmp_path / "rm"), run=tmp_path / "path").train()
    assert rows(tmp_path / "loaded") == rows(tmp_path / "path")
    assert_same_weights(weights(rm), before)
    two = AutoModelForSequenceClassification.from_pretrained(tiny)  # num_labels 2, transformers' default
    with pytest.raises(UserError, match=r"^model: the loaded reward model has 2 labels; allowed: 1 \(a scalar"):
        reward(two, tok, run=tmp_path / "bad")
    with pytest.raises(UserError, match="^model: a Qwen2ForCausalLM is not a sequence classifier; allowed:"):
        reward(AutoModelForCausalLM.from_pretrained(tiny), tok, run=tmp_path / "bad")
    with pytest.raises(UserError, match="^model: a Linear is not a causal LM; allowed:"):
        sft(torch.nn.Linear(2, 2), tok, run=tmp_path / "bad")
    assert not (tmp_path / "bad").exists()  # refused before a run dir is made
