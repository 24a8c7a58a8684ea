"""Gemma 2's final logit soft-cap (cap * tanh(logits / cap)) on every path that computes logits without the
model's own forward: the policy's and the reference's log-probs equal the model's forward, in both layouts."""

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM

from ppoforge.config import build_config
from ppoforge.lm.models.logprobs import head_logprobs, token_logprobs
from ppoforge.lm.models.parts import output_head
from ppoforge.lm.models.rows import padded
from ppoforge.lm.models.tiny import tiny_tokenizer
from ppoforge.lm.rl.config import RLHFConfig
from ppoforge.lm.rl.trainer import RLHFTrainer

PROMPTS = ["rain", "the sun", "coffee today", "a good book"]


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory):
    tok = tiny_tokenizer()
    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                          sliding_window=64, max_position_embeddings=128, initializer_range=0.5,
                          final_logit_softcapping=5.0, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                          bos_token_id=None)
    path = tmp_path_factory.mktemp("gemma2")
    Gemma2ForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _own_logprobs(model, ids: torch.Tensor, n_resp: int) -> torch.Tensor:
    """The response tokens' log-probs under the model's own forward (which applies the soft-cap)."""
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    return token_logprobs(logits[:, -n_resp - 1:-1], ids[:, -n_resp:], entropy=False)[0]


@pytest.mark.parametrize("layout", ["lora", "full"])
def test_policy_and_reference_logprobs_equal_the_models_forward_with_the_soft_cap(gemma2_dir, prompts_file,
                                                                                  tmp_path, layout):
    cfg = build_config(RLHFConfig, dict(model=str(gemma2_dir), prompts=str(prompts_file), heldout_prompts=None,
                                        max_prompt_tokens=16, max_new_tokens=8, batch_size=2, mini_batch_size=2,
                                        micro_batch_size=2, ppo_epochs=1, total_updates=1, device="cpu", seed=0,
                                        torch_threads=1, progress=False, tensorboard=False, precision="fp32",
                                        layout=layout, attn_implementation="eager", kl_coef=0.05))
    trainer = RLHFTrainer(cfg, tmp_path, reward_fn=lambda p, c, **k: [0.0] * len(c))
    model, vocab = trainer.layout.policy_model, trainer.layout.policy_model.config.vocab_size
    ids = torch.randint(3, vocab, (2, 20), generator=torch.Generator().manual_seed(1))
    rows = padded(ids, torch.ones_like(ids), 8)
    want = _own_logprobs(model, ids, 8)
    with torch.no_grad():
        hidden, _ = trainer.layout.forward(rows)
        policy = head_logprobs(trainer.layout.logits, hidden, ids[:, -8:], vocab, entropy=False)[0]
        reference = head_logprobs(trainer.layout.ref_logits, trainer.layout.ref_forward(rows), ids[:, -8:], vocab,
                                  entropy=False)[0]
        uncapped = head_logprobs(model.get_output_embeddings(), hidden, ids[:, -8:], vocab, entropy=False)[0]
    torch.testing.assert_close(policy, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(reference, want, rtol=0, atol=1e-5)  # untrained: the reference is the policy
    assert (uncapped - want).abs().max() > 1.0  # the control: the output embedding alone is another model


def test_output_head_is_the_embedding_alone_without_a_cap(tiny_lm_dir):
    from ppoforge.lm.models.loading import load_causal_lm

    model = load_causal_lm(str(tiny_lm_dir))
    assert output_head(model) is model.get_output_embeddings()
