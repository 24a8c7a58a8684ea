"""Measured: the scoring passes' peak memory is the micro-batch's, not the rollout's (peak RSS of a fresh process,
a Qwen2-shaped model large enough that one pass over a whole rollout stands out from the allocator's noise)."""

import json
import subprocess
import sys

import pytest

SCRIPT = r'''
import json, resource, sys, tempfile
from pathlib import Path
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from ppoforge.config import build_config
from ppoforge.lm.models.sampler import Samples
from ppoforge.lm.rl.config import RLHFConfig
from ppoforge.lm.rl.trainer import RLHFTrainer

model_dir, tok_dir, rows, chunk = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
cfg = build_config(RLHFConfig, dict(model=model_dir, tokenizer=tok_dir, prompts="demo", heldout_prompts="none",
    max_prompt_tokens=128, max_new_tokens=128, batch_size=8, mini_batch_size=8, micro_batch_size=8, ppo_epochs=1,
    device="cpu", torch_threads=1, progress=False, tensorboard=False, kl_coef=0.05, old_logprobs="recompute",
    attn_implementation="eager", shared_prefix="off"))
trainer = RLHFTrainer(cfg, Path(tempfile.mkdtemp()), reward_fn=lambda p, c, **k: [0.0] * len(c))
passes = trainer.passes
vocab = trainer.layout.policy_model.config.vocab_size

def run(n):
    ids = torch.randint(3, vocab, (n, 256))
    samples = Samples(ids[:, 128:], torch.ones(n, 128), torch.zeros(n, 128), torch.ones(n, dtype=torch.bool))
    with torch.inference_mode():
        return passes(ids, torch.ones(n, 256), samples)

run(8)  # every buffer of one micro-batch allocated once
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
passes.chunk_rows = chunk
run(rows)
print(json.dumps({"growth_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024}))
'''


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory, tiny_lm_dir):
    """Qwen2-shaped, hidden 256, 4 layers (the tiny tokenizer): a rollout pass's activations are ~100 MiB."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(tiny_lm_dir)
    config = Qwen2Config(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=512, vocab_size=len(tok), max_position_embeddings=512,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    path = tmp_path_factory.mktemp("wide")
    Qwen2ForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def growth(model_dir, rows: int, chunk: int) -> float:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(model_dir), str(model_dir), str(rows), str(chunk)],
                         capture_output=True, text=True, timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["growth_mib"]


def test_the_scoring_peak_stays_flat_when_the_rollout_grows_four_times(wide_model):
    chunked = growth(wide_model, 64, 8)        # 64 rows, 8 at a time: the micro-batch's peak, already reached
    whole = growth(wide_model, 64, 64)         # the same rollout in one pass, as before: the rollout's peak
    print(f"scoring peak growth, 64 rows: {chunked:.1f} MiB in chunks of 8, {whole:.1f} MiB in one pass")
    # measured 2026-12-06: 22 MiB in chunks (the allocator's noise and fragments), 256 MiB in one pass
    assert chunked < 64, chunked
    assert whole > 3 * max(chunked, 20), (whole, chunked)  # the control: the measurement sees a whole-rollout pass
