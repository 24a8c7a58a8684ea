"""The vLLM engine's parts that need no engine: the KV cache sized from the rollout, and the one line a
missing vLLM gives (this venv has none; tests/lm/rl/test_vllm.py runs the engine, `make test-vllm`)."""

import sys

import torch
from transformers import Qwen2Config

from ppoforge.cli import main
from ppoforge.lm.models.tiny import save_tiny_lm
from ppoforge.lm.models.vllm_engine import MIN_KV_BYTES, kv_cache_bytes


def test_the_engine_kv_cache_is_sized_from_the_rollout():
    cfg = Qwen2Config(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2)
    per_token = 24 * 2 * 2 * 64 * 2  # layers x (K, V) x kv heads x head dim x bf16 bytes
    assert kv_cache_bytes(cfg, 64, 1024, torch.bfloat16) == int(64 * 1024 * per_token * 1.25)
    assert kv_cache_bytes(cfg, 1, 8, torch.bfloat16) == MIN_KV_BYTES


def test_missing_vllm_is_one_line_with_the_fix(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # what an uninstalled vLLM is to `import vllm`
    model = save_tiny_lm(tmp_path / "model")
    code = main(["train", "rlhf", "--model", str(model), "--prompts", "demo", "--heldout-prompts", "none",
                 "--rollout-engine", "vllm", "--total-updates", "1", "--batch-size", "2", "--mini-batch-size", "2",
                 "--micro-batch-size", "2", "--max-new-tokens", "3", "--max-prompt-tokens", "16", "--device", "cpu",
                 "--progress", "false", "--tensorboard", "false", "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    lines = [x for x in err.splitlines() if x.startswith("ppoforge:") and "max_prompt_tokens" not in x]
    assert code == 2 and len(lines) == 1, err
    assert "rollout_engine: vllm needs vLLM" in lines[0] and "make venv-vllm" in lines[0]
    assert not (tmp_path / "run" / "checkpoint.pt").exists()
