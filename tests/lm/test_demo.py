"""End to end on the real SmolLM2-135M-Instruct: `ppoforge demo` trains, reports, and exports a policy."""

import pytest
import torch

from ppoforge.cli import main
from ppoforge.lm.models import load_causal_lm, load_tokenizer

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
    # The export is a plain transformers checkpoint (LoRA merged) that loads and generates.
    tok = load_tokenizer(str(run / "policy"))
    model = load_causal_lm(str(run / "policy"), tokenizer=tok)
    batch = tok(["Hello"], return_tensors="pt")
    out_ids = model.generate(**batch, max_new_tokens=3, do_sample=False)
    assert out_ids.shape[1] == batch.input_ids.shape[1] + 3
    assert not any("lora" in name for name, _ in model.named_parameters())
    assert all(torch.isfinite(p).all() for p in model.parameters())
