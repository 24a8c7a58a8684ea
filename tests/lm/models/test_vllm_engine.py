"""The vLLM engine's parts that need no engine: the KV cache sized from the rollout, and the one line a
missing vLLM gives (this venv has none; tests/lm/rl/test_vllm.py runs the engine, `make test-vllm`)."""

import sys

import pytest
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


def test_auto_on_cuda_with_a_vllm_that_does_not_import_falls_back_to_the_local_decoder(capsys, monkeypatch):
    """`rollout_engine: auto` picks vLLM on CUDA where it is installed; one that is installed but does not import
    (built for another torch) is an info line and the local decoder, not a failed run. Asked for by name
    (`vllm`), the same install is the one-line error above."""
    from types import SimpleNamespace

    from ppoforge.errors import UserError
    from ppoforge.lm.models.engines import LocalEngine
    from ppoforge.lm.rl import collect

    monkeypatch.setattr(collect, "vllm_version", lambda: "0.32.0")
    monkeypatch.setattr(collect, "resolve_model", lambda name: name)
    monkeypatch.setitem(sys.modules, "vllm", None)
    inputs = SimpleNamespace(device=torch.device("cuda"), layout=None, precision=SimpleNamespace(dtype=None))
    cfg = SimpleNamespace(rollout_engine="auto", fsdp=False, layout_decoder="auto", env=None, max_new_tokens=4,
                          max_prompt_tokens=8, model="m", seed=0, vllm_gpu_memory_utilization=0.3, vllm_sleep=True,
                          rollout_timeout=None, sync_timeout=None, vllm_lora_sync="auto")
    engine = collect.engine_for(cfg, inputs, 4)
    assert isinstance(engine, LocalEngine)
    assert "ppoforge: info: rollout_engine auto: rollout_engine: vllm needs vLLM" in capsys.readouterr().err
    cfg.rollout_engine = "vllm"
    with pytest.raises(UserError, match="rollout_engine: vllm needs vLLM"):
        collect.engine_for(cfg, inputs, 4)
