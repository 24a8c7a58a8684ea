"""End to end: `ppoforge demo` on the real SmolLM2-135M-Instruct trains, reports, and exports a policy;
`--task arithmetic` on the tiny LM trains in resumed chunks and reports held-out accuracy and its curve."""

import importlib.util
import json

import pytest
import torch

from ppoforge.cli import main
from ppoforge.lm.models.loading import load_causal_lm, load_tokenizer

SMALL = ["--total-updates", "2", "--batch-size", "4", "--mini-batch-size", "4", "--micro-batch-size", "4",
         "--max-new-tokens", "8", "--ppo-epochs", "1", "--heldout-samples", "1", "--progress", "false",
         "--tensorboard", "false"]


@pytest.mark.slow
def test_demo_runs_end_to_end_on_smollm2(smollm2_cache, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("PPOFORGE_CACHE", str(smollm2_cache))
    run = tmp_path / "demo"
    assert main(["demo", *SMALL, "--run-dir", str(run)]) == 0
    out = capsys.readouterr().out
    assert "held-out mean VADER score" in out and "KL to the reference" in out and "before" in out
    for name in ("checkpoint.pt", "config.yaml", "metrics.jsonl", "completions.jsonl", "reward_kl.png"):
        assert (run / name).is_file(), name
    # The export is the LoRA adapter (PEFT format, `export: adapter`); the loaders take it as base + adapter merged.
    tok = load_tokenizer(str(run / "model"))
    model = load_causal_lm(str(run / "model"), tokenizer=tok)
    batch = tok(["Hello"], return_tensors="pt")
    out_ids = model.generate(**batch, max_new_tokens=3, do_sample=False)
    assert out_ids.shape[1] == batch.input_ids.shape[1] + 3
    assert not any("lora" in name for name, _ in model.named_parameters())
    assert all(torch.isfinite(p).all() for p in model.parameters())


needs_reasoning_gym = pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None,
                                         reason="reasoning-gym is not installed (pip install 'ppoforge[tasks]')")
TINY_GRPO = ["--total-updates", "2", "--batch-size", "2", "--num-generations", "4", "--mini-batch-size", "8",
             "--micro-batch-size", "8", "--max-new-tokens", "6", "--heldout-samples", "1", "--progress", "false",
             "--tensorboard", "false", "--precision", "fp32",
             "--heldout-prompts", "task:chain_sum?size=3&seed=100000&min_terms=2&max_terms=2&max_digits=1"]


@needs_reasoning_gym
def test_arithmetic_demo_reports_accuracy_and_writes_its_curve(tiny_lm_dir, tmp_path, capsys):
    run = tmp_path / "arith"
    assert main(["demo", "--task", "arithmetic", "--model", str(tiny_lm_dir), *TINY_GRPO, "--run-dir", str(run)]) == 0
    out = capsys.readouterr().out
    assert "GRPO teaches" in out and "held-out accuracy (exact answer; 3 completions of 3 problems never trained " \
        "on; 95 % Wilson intervals over completions): " in out
    assert "held-out accuracy by update: 0: " in out and ", 1: " in out and ", 2: " in out  # chunked, resumed
    assert "% [0.0%, " in out or "100.0%]" in out  # each accuracy with its interval
    for name in ("checkpoint.pt", "metrics.jsonl", "completions.jsonl", "accuracy.jsonl", "accuracy.png"):
        assert (run / name).is_file(), name
    curve = [json.loads(line) for line in (run / "accuracy.jsonl").read_text().splitlines()]
    assert [p["step"] for p in curve] == [0, 1, 2] and all("objective/accuracy" in p for p in curve[1:])
    assert [p["step"] for p in curve if "eval/accuracy" in p] == [0, 1, 2]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "objective/scores" in m] == [1, 2]  # the resume repeated no update


def test_arithmetic_demo_refuses_an_annealed_learning_rate(tiny_lm_dir, tmp_path, capsys):
    assert main(["demo", "--task", "arithmetic", "--anneal-lr", "true", "--run-dir", str(tmp_path / "a")]) == 2
    assert "anneal_lr: the arithmetic demo trains in chunks" in capsys.readouterr().err
