"""The memory plan (`ppoforge plan`): exact parameter counts, the arithmetic of its pieces, a verdict and a fix
that change with the config as they should, and the CLI."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from ppoforge.cli import main
from ppoforge.lm.models import memplan

QWEN_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=4096)


def test_counts_are_the_models_own(tiny_lm_dir):
    config = AutoModelForCausalLM.from_pretrained(tiny_lm_dir).config
    model = AutoModelForCausalLM.from_pretrained(tiny_lm_dir)
    shape = memplan.model_shape(config)
    assert shape.params == sum(p.numel() for p in model.parameters())
    linears = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head")]
    assert shape.linear_params == sum(m.weight.numel() for m in linears)
    assert shape.lora_per_rank == sum(m.in_features + m.out_features for m in linears)
    only_q = memplan.model_shape(config, "q_proj")
    assert only_q.lora_per_rank == sum(m.in_features + m.out_features for n, m in model.named_modules()
                                       if n.endswith("q_proj"))


def _workload(**kw) -> memplan.Workload:
    base = dict(layout="full", compute_bytes=2, lora_r=16, micro_rows=8, tokens=1024, gen_rows=64, resp_tokens=512,
                reference=True)
    return memplan.Workload(**{**base, **kw})


def test_the_pieces_follow_their_formulas():
    shape = memplan.model_shape(Qwen2Config(**QWEN_05B))
    assert 490e6 < shape.params < 500e6  # Qwen2-0.5B: 494M
    c = memplan.components(shape, _workload())
    assert c["trained weights + grads + AdamW"] == shape.params * 16
    # KV: 2 (K and V) x layers x rows x kv heads x positions x head dim x 2 bytes
    assert c["KV cache (generation)"] == 2 * 24 * 64 * 2 * 1024 * 64 * 2
    sharded = memplan.components(shape, _workload(world=4))
    assert sharded["trained weights + grads + AdamW"] == c["trained weights + grads + AdamW"] / 4
    lora = memplan.components(shape, _workload(layout="lora", reference=False))
    assert lora["trained weights + grads + AdamW"] == shape.lora_per_rank * 16 * 16
    assert lora["frozen base (LoRA)"] == shape.params * 2 and lora["reference (frozen copy)"] == 0
    ckpt = memplan.components(shape, _workload(gradient_checkpointing=True))
    assert ckpt["training activations (micro-batch)"] < c["training activations (micro-batch)"] / 5


def test_an_8b_model_on_40gb_does_not_fit_full_and_the_fix_makes_it_fit():
    llama8b = Qwen2Config(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                          intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False)
    shape = memplan.model_shape(llama8b)
    full = memplan.plan(shape, _workload(), 40e9, "cuda (40GB)")
    assert full.fits is False and "layout lora" in full.fix and full.fix.endswith("together")
    lora = memplan.plan(shape, _workload(layout="lora", reference=False, micro_rows=1, gen_rows=8), 80e9, "cuda")
    assert lora.fits is True and lora.fix is None


def test_the_fix_is_a_smaller_micro_batch_when_activations_are_what_overflows():
    shape = memplan.model_shape(Qwen2Config(**QWEN_05B))
    work = _workload(layout="lora", reference=False, micro_rows=64, gen_rows=8)
    needed = memplan.plan(shape, work, None, "x").peak
    result = memplan.plan(shape, work, needed * 0.8 / memplan.FIT_SHARE, "cuda (target)")
    assert result.fits is False and result.fix.startswith("micro_batch_size ")
    smaller = int(result.fix.split()[1])
    assert memplan.plan(shape, work.__class__(**{**work.__dict__, "micro_rows": smaller}),
                        result.capacity, "x").fits


@pytest.mark.parametrize("device", ["cuda:80GB", "cuda:24GiB", "cpu"])
def test_capacity_targets(device):
    capacity, where = memplan.parse_capacity(device)
    assert capacity > 0 and where
    if device == "cuda:80GB":
        assert capacity == 80e9


def test_a_bad_device_is_one_line():
    with pytest.raises(Exception, match="allowed: cpu, cuda"):
        memplan.parse_capacity("tpu:8GB")


def test_the_cli_prints_the_plan_and_its_verdict(tiny_lm_dir, capsys):
    code = main(["plan", "rlhf", "--preset", "grpo", "--model", str(tiny_lm_dir), "--device", "cuda:80GB", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["fits"] is True and out["peak"] == max(out["phases"].values())
    assert set(out["phases"]) == {"generating", "scoring the rollout", "training a micro-batch"}
    code = main(["plan", "sft", "--preset", "tiny", "--model", str(tiny_lm_dir), "--data", "any.jsonl",
                 "--device", "cuda:0.001GB"])
    text = capsys.readouterr().out
    assert code == 1 and "does NOT fit" in text


def test_the_vllm_engine_is_counted_its_share_and_asleep_only_while_generating(tiny_lm_dir, capsys):
    """rollout_engine vllm: on CUDA the engine takes vllm_gpu_memory_utilization of the GPU; asleep
    (vllm_sleep) it holds it only while generating; on CPU its weights copy and KV cache, and no local KV."""
    def phases(*extra):
        assert main(["plan", "rlhf", "--preset", "grpo", "--model", str(tiny_lm_dir), "--json",
                     "--rollout-engine", "vllm", *extra]) in (0, 1)
        return json.loads(capsys.readouterr().out)

    awake = phases("--device", "cuda:80GB", "--vllm-sleep", "false", "--vllm-gpu-memory-utilization", "0.25")
    asleep = phases("--device", "cuda:80GB", "--vllm-sleep", "true", "--vllm-gpu-memory-utilization", "0.25")
    share = 0.25 * 80e9
    assert awake["components"]["vLLM engine (weights + KV cache)"] == share
    for name in ("scoring the rollout", "training a micro-batch"):
        assert awake["phases"][name] - asleep["phases"][name] == pytest.approx(share)
    assert awake["phases"]["generating"] == pytest.approx(asleep["phases"]["generating"])
    cpu = phases("--device", "cpu")
    assert 0 < cpu["components"]["vLLM engine (weights + KV cache)"] < share
    assert cpu["components"]["KV cache (generation)"] == 0
