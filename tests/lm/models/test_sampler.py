"""The KV-cache sampler: stop-token masks, padding, positions, log-prob consistency, sampling law."""

from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from ppoforge.lm.models.attention import causal_mask, position_ids
from ppoforge.lm.models.decoders import HFDecoder, LlamaDecoder
from ppoforge.lm.models.logprobs import token_logprobs
from ppoforge.lm.models.sampler import SamplingParams, draw_tokens, draw_uniforms, filter_logits, sample

EOS, PAD, VOCAB = 2, 0, 16
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=256, max_position_embeddings=256)


class Scripted(torch.nn.Module):
    """A stand-in causal LM whose step-s logits make token script[b][s] (almost) certain."""

    def __init__(self, script):
        super().__init__()
        self.config = Qwen2Config(vocab_size=VOCAB, **SMALL)
        self.script = torch.tensor(script)
        self.calls = 0

    def forward(self, input_ids, attention_mask, position_ids, use_cache, logits_to_keep, **cache):
        logits = torch.full((input_ids.shape[0], 1, VOCAB), -30.0)
        logits[torch.arange(input_ids.shape[0]), 0, self.script[:, self.calls]] = 30.0
        self.calls += 1
        return SimpleNamespace(logits=logits)


def _prompts(batch=4, width=3):
    return torch.full((batch, width), 7), torch.ones(batch, width, dtype=torch.long)


def test_stop_masks_eos_first_never_and_mid_batch():
    script = [[EOS, 5, 5, 5, 5, 5], [5, 6, 7, 8, 9, 10], [5, 6, EOS, 9, 9, 9], [5, EOS, EOS, 9, 9, 9]]
    out = sample(HFDecoder(Scripted(script)), *_prompts(), SamplingParams(6, stop_ids=(EOS,), pad_id=PAD))
    assert out.response_ids.tolist() == [[EOS, PAD, PAD, PAD, PAD, PAD], [5, 6, 7, 8, 9, 10],
                                         [5, 6, EOS, PAD, PAD, PAD], [5, EOS, PAD, PAD, PAD, PAD]]
    assert out.response_mask.tolist() == [[1, 0, 0, 0, 0, 0], [1] * 6, [1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]]
    assert out.finished.tolist() == [True, False, True, True]
    assert out.logp.dtype == torch.float32
    assert (out.logp[out.response_mask == 0] == 0).all()           # padding carries no log-prob
    assert out.logp[out.response_mask == 1].abs().max() < 1e-20 + 1e-6  # the scripted token is certain


def test_stops_early_once_every_row_stopped_and_extra_stop_ids():
    script = [[5, EOS, 5, 5, 5, 5], [11, 5, 5, 5, 5, 5]]
    model = Scripted(script)
    out = sample(HFDecoder(model), *_prompts(2), SamplingParams(6, stop_ids=(EOS, 11), pad_id=PAD))
    assert out.response_ids.tolist() == [[5, EOS], [11, PAD]]
    assert out.finished.tolist() == [True, True]
    assert model.calls == 2  # prefill + one decode step; no forward after the last token


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=97, **SMALL)).eval()


def _left_padded(rows, pad=PAD):
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def _recompute(model, ids, mask, resp, resp_mask, tau):
    """Log-probs of the responses from one full forward, as the trainer computes them."""
    full, full_mask = torch.cat([ids, resp], 1), torch.cat([mask.float(), resp_mask], 1)
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=causal_mask(full_mask),
                       position_ids=position_ids(full_mask)).logits[:, ids.shape[1] - 1:-1]
    return token_logprobs(logits, resp, tau, entropy=False)[0] * resp_mask


def test_position_ids_count_real_tokens_only():
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]])
    assert position_ids(mask).tolist() == [[0, 0, 0, 1, 2, 3, 3], [0, 1, 2, 3, 4, 5, 6]]


def test_sampler_logprobs_equal_recomputation_and_prompts_alone(tiny_model):
    rows = [[5, 9, 13, 17, 21, 25, 29], [40, 41], [60, 61, 62, 63]]
    ids, mask = _left_padded(rows)
    params = SamplingParams(10, temperature=0.7, stop_ids=(EOS,), pad_id=PAD)
    out = sample(tiny_model, ids, mask, params, torch.Generator().manual_seed(3))
    batched = _recompute(tiny_model, ids, mask, out.response_ids, out.response_mask, 0.7)
    torch.testing.assert_close(out.logp, batched, atol=1e-5, rtol=0)  # fp32: KV-cache decode == full forward
    for i, row in enumerate(rows):  # left padding changes nothing: same log-probs as each prompt alone
        alone = _recompute(tiny_model, torch.tensor([row]), torch.ones(1, len(row), dtype=torch.long),
                           out.response_ids[i:i + 1], out.response_mask[i:i + 1], 0.7)
        torch.testing.assert_close(batched[i:i + 1], alone, atol=1e-5, rtol=0)


def test_bf16_sampler_logprobs_close_to_recomputation(tiny_model):
    ids, mask = _left_padded([[5, 9, 13, 17], [40, 41]])
    params = SamplingParams(12, temperature=1.0, stop_ids=(EOS,), pad_id=PAD)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = sample(tiny_model, ids, mask, params, torch.Generator().manual_seed(0))
        again = _recompute(tiny_model, ids, mask, out.response_ids, out.response_mask, 1.0)
    # bf16 rounds the one-token decode steps and the full pass differently; measured max |diff| 1-2e-3
    assert (out.logp - again).abs().max() < 1e-2


def test_same_generator_seed_same_samples(tiny_model):
    ids, mask = _left_padded([[5, 6, 7], [8, 9]])
    params = SamplingParams(8, stop_ids=(EOS,), pad_id=PAD)
    a = sample(tiny_model, ids, mask, params, torch.Generator().manual_seed(1))
    b = sample(tiny_model, ids, mask, params, torch.Generator().manual_seed(1))
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logp, b.logp)


def test_filter_top_k_and_top_p_by_hand():
    z = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isfinite(filter_logits(z, 2, 1.0)).tolist() == [[True, True, False, False]]
    # mass before each token in rank order: 0, .5, .8, .95 -> with top_p .7 keep the first two
    assert torch.isfinite(filter_logits(z, 0, 0.7)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(filter_logits(z, 0, 0.85)).tolist() == [[True, True, True, False]]
    assert torch.isfinite(filter_logits(z, 1, 1.0)).tolist() == [[True, False, False, False]]


def test_draws_follow_the_temperature_scaled_softmax():
    n, tau = 40_000, 0.5
    logits = torch.log(torch.tensor([0.1, 0.2, 0.7])).repeat(n, 1)
    u = torch.rand(n, generator=torch.Generator().manual_seed(0))
    tok, logp = draw_tokens(logits, SamplingParams(1, temperature=tau), u)
    expected = torch.softmax(logits[0] / tau, -1)  # (0.1^2, 0.2^2, 0.7^2) / 0.54
    freq = torch.bincount(tok, minlength=3).float() / n
    torch.testing.assert_close(freq, expected, atol=0.01, rtol=0)
    torch.testing.assert_close(logp, expected.log()[tok], atol=1e-6, rtol=0)
    top1, _ = draw_tokens(logits[:100], SamplingParams(1, temperature=tau, top_k=1), u[:100])
    assert (top1 == 2).all()


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("family", ["qwen2", "llama-with-biases"])
def test_lean_llama_decoder_matches_hf_forward(monkeypatch, family, packing):
    """fp32: with its weights prepacked for oneDNN (on CPU, where torch has it; then oneDNN's kernels, not
    MKL's, so to rounding only) and with plain F.linear."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ppoforge.lm.models import prepared

    if packing and not prepared.onednn_packing(torch.float32):
        pytest.skip("this torch cannot prepack fp32 weights for oneDNN")
    monkeypatch.setattr(prepared, "onednn_packing", lambda dtype: packing)
    torch.manual_seed(0)
    if family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=97, **SMALL)).eval()
    else:
        cfg = LlamaConfig(vocab_size=97, attention_bias=True, mlp_bias=True, tie_word_embeddings=True, **SMALL)
        model = LlamaForCausalLM(cfg).eval()
        with torch.no_grad():  # biases are zero-initialized: make them count
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.1)
    ids, mask = _left_padded([[5, 9, 13, 17, 21], [40, 41], [60, 61, 62]])
    lean, hf = LlamaDecoder(model), HFDecoder(model)
    with torch.inference_mode():
        torch.testing.assert_close(lean.prefill(ids, mask, 4)[0], hf.prefill(ids, mask, 4)[0], atol=1e-5, rtol=1e-5)
        assert lean.linear is (prepared.packed_linear if packing else prepared.parts_linear)  # unpacked: in place
        for t, tok in enumerate([[3, 4, 5], [6, 7, 8], [9, 10, 11]]):
            tok = torch.tensor(tok)
            torch.testing.assert_close(lean.step(tok, t)[0], hf.step(tok, t)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("weights", ["fp32-autocast", "bf16"])
def test_bf16_decode_with_prepacked_weights_is_bit_identical(monkeypatch, weights):
    from ppoforge.lm.models import prepared

    if not prepared.onednn_packing():
        pytest.skip("this CPU cannot prepack bf16 weights for oneDNN (needs AVX-512 bw/vl/dq or AVX-NE-CONVERT)")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=97, **SMALL)).eval()
    if weights == "bf16":
        model = model.to(torch.bfloat16)
    ids, mask = _left_padded([[5, 9, 13, 17, 21], [40, 41], [60, 61, 62]])

    def decode(packing: bool) -> tuple[list[torch.Tensor], object]:
        monkeypatch.setattr(prepared, "onednn_packing", lambda dtype: packing)
        dec = LlamaDecoder(model)
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            out = [*dec.prefill(ids, mask, 3)] + [x for i, t in enumerate([[3, 4, 5], [6, 7, 8]])
                                                   for x in dec.step(torch.tensor(t), i)]
        return out, dec.linear

    plain, plain_linear = decode(False)
    packed, packed_linear = decode(True)
    # bf16 weights unpacked are read in place (no stacked copy); fp32 ones under autocast are cast and stacked
    assert plain_linear is (prepared.parts_linear if weights == "bf16" else torch.nn.functional.linear)
    assert packed_linear is prepared.packed_linear
    assert plain[0].dtype == torch.bfloat16  # the logits: bf16 matmuls
    for a, b in zip(plain, packed, strict=True):  # logits and final hidden states, per call
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("kind", ["hf", "lean"])
def test_runs_of_one_prompt_prefill_it_once_and_sample_as_if_each_had_its_own(tiny_model, kind):
    """`share_prefill`: rows in runs of equal prompts (GRPO's completions) prefill one copy of each prompt and
    repeat its KV cache; with the same uniforms the completions and log-probs are those of the plain
    batch (fp32: to rounding). Rows that are not in runs fall back to the plain prefill."""
    ids, mask = _left_padded([[5, 9, 13, 17], [5, 9, 13, 17], [5, 9, 13, 17], [40, 41], [40, 41], [40, 41]])
    params = SamplingParams(8, temperature=1.0, stop_ids=(EOS,), pad_id=PAD)
    u = torch.rand(8, 6, generator=torch.Generator().manual_seed(2))
    decoder = (LlamaDecoder if kind == "lean" else HFDecoder)(tiny_model)
    prefilled, prefill = [], decoder.prefill
    decoder.prefill = lambda i, m, n: prefilled.append(i.shape[0]) or prefill(i, m, n)
    shared = sample(decoder, ids, mask, params, uniforms=u, share_prefill=True)
    plain = sample(decoder, ids, mask, params, uniforms=u)
    assert prefilled == [2, 6]
    assert torch.equal(shared.response_ids, plain.response_ids)
    assert len(set(map(tuple, plain.response_ids.tolist()))) > 2  # the copies sampled different completions
    torch.testing.assert_close(shared.logp, plain.logp, atol=1e-5, rtol=0)
    sample(decoder, ids[[0, 3, 1, 4, 2, 5]], mask, params, uniforms=u, share_prefill=True)  # not in runs
    sample(decoder, ids[[0, 1, 2, 3, 4]], mask[:5], params, uniforms=u[:, :5], share_prefill=True)  # runs of 3, 2
    assert prefilled == [2, 6, 6, 5]


def test_run_length_is_the_length_of_equal_runs_of_rows():
    from ppoforge.lm.models.sampler import run_length

    ids, mask = _left_padded([[5, 9], [5, 9], [7], [7], [8], [8]])
    assert run_length(ids, mask) == 2
    assert run_length(ids[:5], mask[:5]) == 1  # runs of 2, 2, 1
    assert run_length(ids[[0, 2, 4]], mask[[0, 2, 4]]) == 1
    assert run_length(ids[:2], mask[:2]) == 2


def test_lm_head_fp32_under_bf16_lean_and_hf_decoders_agree_and_approach_fp32():
    """`lm_head_fp32` (parts.head_in_fp32): under bf16 autocast both decoders return fp32 logits, the fp32
    product of the final hidden state and the head (to fp32 rounding: oneDNN's kernel or MKL's), and the
    log-probs move toward the fp32 model's. The head is scaled so the logits are as large as a trained
    model's (tens), where bf16's 8 significant bits round each by up to ~0.06."""
    from ppoforge.lm.models.parts import head_in_fp32

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=97, attn_implementation="eager", **SMALL)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    ids, mask = _left_padded([[5, 9, 13, 17, 21], [40, 41], [60, 61, 62]])

    def run(decoder, bf16: bool):
        dec = decoder(model)
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = [dec.prefill(ids, mask, 3)]
            out += [dec.step(torch.tensor(t), i) for i, t in enumerate([[3, 4, 5], [6, 7, 8]])]
        return torch.stack([o[0] for o in out]), out

    exact, _ = run(LlamaDecoder, bf16=False)
    rounded, _ = run(LlamaDecoder, bf16=True)
    assert rounded.dtype == torch.bfloat16
    head_in_fp32(model)
    lean, calls = run(LlamaDecoder, bf16=True)
    hf, _ = run(HFDecoder, bf16=True)
    assert lean.dtype == hf.dtype == torch.float32
    torch.testing.assert_close(lean, hf, atol=1e-4, rtol=1e-5)  # the bf16 bodies are bit-identical (eager)
    for logits, hidden in calls:
        torch.testing.assert_close(logits, hidden.float() @ model.lm_head.weight.detach().T, atol=1e-4, rtol=1e-5)
    err = lambda z: (torch.log_softmax(z.float(), -1) - torch.log_softmax(exact, -1)).abs().mean()  # noqa: E731
    assert err(lean) < 0.8 * err(rounded)  # 0.021 against 0.033 nats here: the bf16 body stays


def _rare_token_logits(vocab: int, rare: int, p_rare: float, tail: int | None = None) -> torch.Tensor:
    """(1, vocab) logits: token 0 holds 0.7 (the CDF passes 0.5 at once), token `rare` p_rare, the tokens
    from `tail` on 1e-9 each (less than p_rare: a top-k can keep it), the rest share what is left evenly."""
    tail = vocab if tail is None else tail
    probs = torch.full((vocab,), 1e-9, dtype=torch.float64)
    probs[:tail] = (0.3 - p_rare - 1e-9 * (vocab - tail)) / (tail - 2)
    probs[0], probs[rare] = 0.7, p_rare
    return probs.log().float()[None]


@pytest.mark.parametrize("params", [SamplingParams(1), SamplingParams(1, top_k=150_000)])
def test_a_token_below_half_an_fp32_ulp_of_the_cdf_is_drawn(params):
    """p = 2e-8 past the 0.5 mark, where an fp32 CDF's step is 6e-8: in an fp32 cumsum the token's share
    (the difference of two sums) is 0 and the draw falls to a neighbour. A uniform inside its float64
    share draws it, with its fp32 log-prob. top_k keeps it (it filters the 50k rarer tokens of the tail)."""
    vocab, rare = 200_000, 100_000
    logits = _rare_token_logits(vocab, rare, 2e-8, tail=150_000)
    logp_all = torch.log_softmax(logits, -1)  # the law draw_tokens inverts: these fp32 probabilities
    probs = torch.softmax(filter_logits(logp_all, params.top_k, 1.0), -1) if params.top_k else logp_all.exp()
    assert probs[0, rare] > 0
    fp32_cdf = probs.cumsum(-1)[0]
    assert fp32_cdf[rare] == fp32_cdf[rare - 1], "in fp32 the token has no share of the CDF"
    cdf = probs.double().cumsum(-1)[0]
    for inside in (0.01, 0.5, 0.99):  # where in its share of the CDF the uniform lands
        u = (cdf[rare - 1] + inside * probs[0, rare].double()) / cdf[-1]
        tok, logp = draw_tokens(logits, params, u.reshape(1))
        assert int(tok) == rare
        assert float(logp) == float(logp_all[0, rare])
        assert int(draw_tokens(logits, params, (cdf[rare - 1] / cdf[-1] * (1 - 1e-12)).reshape(1))[0]) == rare - 1


def test_a_uniform_at_the_top_of_the_cdf_draws_the_last_token_with_mass():
    """u * total can round up to the total (u within 2^-53 of 1): the draw is the last token with mass, not
    a filtered one after it."""
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    top = torch.tensor([1 - 2**-53], dtype=torch.float64)
    assert int(draw_tokens(logits, SamplingParams(1), top)[0]) == 3
    assert int(draw_tokens(logits, SamplingParams(1, top_k=3), top)[0]) == 2


def test_a_rare_token_past_the_middle_of_the_cdf_is_drawn_at_its_rate():
    """A token of p = 1e-3 after the 0.5 mark, 200k seeded draws (draw_uniforms' uniforms): its count
    within 5 sigma of 200."""
    vocab, rare, n, p = 4096, 3000, 200_000, 1e-3
    logits = _rare_token_logits(vocab, rare, p)
    u = draw_uniforms(SamplingParams(1), n, torch.Generator().manual_seed(0))[0]
    assert u.shape == (n,)
    hits = sum(int((draw_tokens(logits.expand(len(part), -1), SamplingParams(1), part)[0] == rare).sum())
               for part in u.split(20_000))
    assert abs(hits - n * p) < 5 * (n * p * (1 - p)) ** 0.5


def test_a_token_of_p_1e_8_past_the_middle_of_the_cdf_is_drawn_at_its_rate():
    """Issue 37: p = 1e-8 past the 0.5 mark is drawn at its rate. Of draw_uniforms' uniforms only those in a
    window of 2e-6 around the token's place can reach it, so the test draws those alone: uniform on the
    window at the resolution of draw_uniforms' dtype (fp32's 2^-24 grid has ~33 points there, at most one
    inside the token's 1e-8: a rate of 0 or 6e-8; float64's 2^-53 grid gives it its share). 100k seeded
    draws in the window, expected 100k x 1e-8 / 2e-6 = 500 hits: within 5 sigma (fp32 uniforms: 0)."""
    vocab, rare, p, n, width = 4096, 3000, 1e-8, 100_000, 2e-6
    logits = _rare_token_logits(vocab, rare, p)
    probs = torch.log_softmax(logits, -1).exp()
    cdf = probs.double().cumsum(-1)[0] / probs.double().sum()
    assert 0.5 < cdf[rare - 1] < cdf[rare] < 1
    start = float(cdf[rare - 1] + cdf[rare]) / 2 - width / 2  # the window, centred on the token's share
    generator = torch.Generator().manual_seed(0)
    dtype = draw_uniforms(SamplingParams(1), 1, generator).dtype
    step = 2.0 ** -{torch.float32: 24, torch.float64: 53}[dtype]  # torch.rand's grid in that dtype
    v = torch.rand(n, generator=generator, dtype=torch.float64)
    u = torch.floor((start + width * v) / step) * step  # uniform on the window's points of that grid
    hits = sum(int((draw_tokens(logits.expand(len(part), -1), SamplingParams(1), part)[0] == rare).sum())
               for part in u.split(20_000))
    share = float(probs[0, rare].double() / probs.double().sum()) / width
    assert abs(hits - n * share) < 5 * (n * share * (1 - share)) ** 0.5, (hits, n * share, dtype)
