"""Model layouts: the LoRA policy decoded through merged weights equals the adapter forward, and the
merge never touches the frozen base."""

import pytest
import torch

from ppoforge.lm.models.decoders import HFDecoder, LlamaDecoder
from ppoforge.lm.models.layouts import build_lora
from ppoforge.lm.models.loading import load_causal_lm
from ppoforge.lm.models.parts import merged_lora
from ppoforge.lm.models.rows import padded


def _trained_lora(tiny_lm_dir, **load_kwargs):
    layout = build_lora(load_causal_lm(str(tiny_lm_dir), **load_kwargs), 4, 8.0, "all-linear", False)
    torch.manual_seed(0)
    with torch.no_grad():  # B starts at 0 (adapter = identity): give it a real delta
        for name, p in layout.named_trainable():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    return layout


def test_both_lora_decoders_equal_the_adapter_forward(tiny_lm_dir):
    layout = _trained_lora(tiny_lm_dir)
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.inference_mode():
        # forward(..., n=1) gives the logits that predict the last token: append one to see the prompt's end
        plus_one = torch.cat([ids, torch.full((2, 1), 3)], 1)
        plus_mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1).float()
        hidden, _ = layout.forward(padded(plus_one, plus_mask, 1))
        logits = layout.logits(hidden)
        lean = layout.decoder().__enter__()
        assert isinstance(lean, LlamaDecoder)
        lean_logits, lean_hidden = lean.prefill(ids, mask, 2)
        torch.testing.assert_close(lean_logits, logits[:, -1], atol=1e-5, rtol=1e-5)
        # the hidden state the lean decoder hands the sampler is the one the value head reads
        torch.testing.assert_close(lean_hidden, hidden[:, -1], atol=1e-5, rtol=1e-5)
        with merged_lora(layout.peft):
            hf_logits, hf_hidden = HFDecoder(layout.policy_model).prefill(ids, mask, 2)
        torch.testing.assert_close(hf_logits, logits[:, -1], atol=1e-5, rtol=1e-5)
        assert hf_hidden is None


def test_the_lean_decoder_frees_its_kv_cache_when_the_rollout_ends(tiny_lm_dir):
    layout = _trained_lora(tiny_lm_dir)
    ids, mask = torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.long)
    for _ in range(2):  # a second rollout builds a new cache
        with torch.inference_mode(), layout.decoder() as lean:
            first, _ = lean.prefill(ids, mask, 4)
            assert len(lean.caches) == len(lean.layers)
            lean.step(torch.tensor([8]), 0)
        assert lean.caches is None  # no quarter GiB living on through the training passes
    torch.testing.assert_close(first, layout.logits(layout.forward(padded(torch.cat([ids, ids[:, :1]], 1),
                                                                            torch.ones(1, 4), 1))[0])[:, -1],
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("alpha", [8.0, 6.0])  # scaling alpha / r = 2 (folded into B by the lean decoder), 1.5
def test_decoders_over_a_bf16_base_apply_the_adapter_unmerged(tiny_lm_dir, alpha):
    """A bf16 merge would round W + s * B @ A and lose small deltas: both decoders keep the adapter
    separate, and their log-probs equal the adapter forward's under autocast bit for bit."""
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    plus_one = torch.cat([ids, torch.full((2, 1), 3)], 1)
    for decoder, kind in (("lean", LlamaDecoder), ("hf", HFDecoder)):
        base = load_causal_lm(str(tiny_lm_dir), dtype=torch.bfloat16)
        layout = build_lora(base, 4, alpha, "all-linear", decoder=decoder)
        torch.manual_seed(0)
        with torch.no_grad():
            for name, p in layout.named_trainable():
                if "lora_B" in name:
                    p.normal_(0, 0.02)  # a real delta (merging it in bf16 would change the logits)
        q = layout.peft.base_model.model.model.layers[0].self_attn.q_proj
        base_weight = q.base_layer.weight
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            plus_mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1).float()
            hidden, _ = layout.forward(padded(plus_one, plus_mask, 1))
            want = layout.logits(hidden)[:, -1]
            with layout.decoder() as dec:
                assert isinstance(dec, kind) and q.base_layer.weight is base_weight and not q.disable_adapters
                assert torch.equal(dec.prefill(ids, mask, 2)[0], want), decoder


def test_merged_lora_restores_the_same_base_weight_objects(tiny_lm_dir):
    layout = _trained_lora(tiny_lm_dir)
    q = layout.peft.base_model.model.model.layers[0].self_attn.q_proj
    original, snapshot = q.base_layer.weight, q.base_layer.weight.detach().clone()
    with merged_lora(layout.peft):
        assert q.base_layer.weight is not original
        assert not torch.equal(q.base_layer.weight, snapshot)  # the merged weight is in use
    assert q.base_layer.weight is original and torch.equal(original, snapshot)
    assert not q.disable_adapters  # adapters are back on


def _young_bf16_lora(tiny_lm_dir):
    layout = build_lora(load_causal_lm(str(tiny_lm_dir), dtype=torch.bfloat16), 4, 8.0, "all-linear", False)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in layout.named_trainable():
            if "lora_B" in name:
                p.normal_(0, 1e-4)  # a young adapter: a delta near the base weights' bf16 spacing
    return layout


def _merged_q(layout):
    q = layout.peft.base_model.model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        return q, q.base_layer.weight.float() + q.scaling["default"] * q.lora_B["default"].weight @ q.lora_A[
            "default"].weight


def test_merged_export_in_fp32_keeps_the_small_delta_a_bf16_merge_loses(tiny_lm_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    layout = _young_bf16_lora(tiny_lm_dir)
    q, want = _merged_q(layout)
    delta = want - q.base_layer.weight.float()
    rounded = want.bfloat16().float() - q.base_layer.weight.float()
    assert (rounded - delta).norm() > 0.3 * delta.norm()  # the premise: a bf16 merge would lose much of it
    layout.export(tmp_path / "model", "merged", torch.float32)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "model").model.layers[0].self_attn.q_proj.weight
    assert exported.dtype == torch.float32
    torch.testing.assert_close(exported, want, atol=1e-6, rtol=1e-6)
    assert q.base_layer.weight.dtype == torch.bfloat16  # the live model is untouched
    # dtype None: the base's own (bf16), the merge computed in fp32 then rounded once
    layout.export(tmp_path / "bf16", "merged")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype="auto").model.layers[0]
    assert exported.self_attn.q_proj.weight.dtype == torch.bfloat16
    torch.testing.assert_close(exported.self_attn.q_proj.weight, want.bfloat16(), atol=0, rtol=0)


def test_adapter_export_is_peft_format_and_loads_onto_the_base(tiny_lm_dir, tmp_path):
    """`export` kind adapter: the adapter alone, which `PeftModel.from_pretrained(base, path)` loads
    (the lora-critic layout's critic adapter left out); `both` adds the merged model in path/merged."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    layout = build_lora(load_causal_lm(str(tiny_lm_dir)), 4, 8.0, "all-linear", True)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in layout.named_trainable():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    _, want = _merged_q(layout)
    layout.export(tmp_path / "model", "both")
    files = {f.name for f in (tmp_path / "model").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "merged"} <= files
    assert "model.safetensors" not in files and "critic" not in files
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_lm_dir), tmp_path / "model")
    got = loaded.merge_and_unload().model.layers[0].self_attn.q_proj.weight
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "model" / "merged").model.layers[0]
    torch.testing.assert_close(merged.self_attn.q_proj.weight, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("precision", ["fp32", "bf16-eager", "bf16-sdpa"])
def test_lean_reference_pass_equals_the_disabled_adapter_forward(tiny_lm_dir, precision):
    """The LoRA layout's reference pass runs the frozen base through the lean decoder's prepared weights:
    the same hidden states as peft's forward with adapters off (bit for bit under eager bf16), not the
    policy's, with left padding and a response that ends early (masked tail)."""
    from ppoforge.lm.models.parts import response_hidden

    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    attn = "sdpa" if precision.endswith("sdpa") else "eager"
    layout = _trained_lora(tiny_lm_dir, dtype=dtype, attn_implementation=attn)
    ids = torch.tensor([[0, 0, 5, 6, 7, 20, 21, 1, 1], [8, 9, 10, 11, 12, 22, 23, 24, 25]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1]]).float()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
    with torch.inference_mode(), autocast:
        got = layout.fast_ref_forward(padded(ids, mask, 4))  # the lean decoder's
        want = layout.ref_forward(padded(ids, mask, 4))  # peft's, adapters off
        policy = response_hidden(layout.backbone, padded(ids, mask, 4))
    assert got.shape == want.shape == (2, 4, want.shape[-1]) and got.dtype == want.dtype
    real = mask[:, -5:-1].bool()  # positions that predict real response tokens
    if precision == "bf16-eager":
        assert torch.equal(got[real], want[real])
    else:
        torch.testing.assert_close(got[real], want[real], **({"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32
                                                           else {"atol": 0.05, "rtol": 0.02}))
    assert (got[real] - policy[real]).abs().max() > 0.1  # the adapters were really off


def test_a_critic_from_a_reward_model_starts_as_the_whole_reward_model(tiny_lm_dir, tiny_reward_model_dir):
    """TRL's value model is the reward model, score head included: at the last token the critic's value
    equals the reward model's score (and it is not the zero head of a fresh critic)."""
    from ppoforge.lm.models.layouts import build_full
    from ppoforge.lm.models.loading import load_reward_model

    layout = build_full(load_causal_lm(str(tiny_lm_dir)), load_causal_lm(str(tiny_lm_dir)),
                        load_reward_model(str(tiny_reward_model_dir)))
    rm = load_reward_model(str(tiny_reward_model_dir))
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    mask = torch.ones(2, 6)
    with torch.no_grad():
        values = layout.values(padded(ids, mask, 5))  # (B, 5): V before each of the last 5 tokens
        scores = rm(input_ids=ids[:, :-1]).logits[:, 0]  # the RM's score of the prefix ending at token 5
    assert values.abs().max() > 0
    torch.testing.assert_close(values[:, -1], scores, atol=1e-5, rtol=1e-5)


def test_a_critic_model_without_a_score_head_is_refused(tiny_lm_dir):
    from ppoforge.errors import UserError
    from ppoforge.lm.models.layouts import build_full

    with pytest.raises(UserError, match=r"^critic_model: its sequence-classification head is not"):
        build_full(load_causal_lm(str(tiny_lm_dir)), load_causal_lm(str(tiny_lm_dir)),
                   load_causal_lm(str(tiny_lm_dir)))  # a plain LM: no score head
