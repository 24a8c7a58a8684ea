"""Windowed attention (lm/models/windows.py): each model's window found; a run whose rows could outgrow it
refused in one line (RLHF: the policy and a critic; SFT packing); within the window ppoforge's log-probs
(padded and shared-prefix rows, and an RLHF rollout's) and its greedy decode equal Hugging Face's own forward
and `generate` for Gemma 3, Mistral and Qwen2 with sliding layers; past it SFT's own-mask decode still equals
`generate`, and a reward model scores long texts through the model's own masks."""

import json

import pytest
import torch
import transformers
from transformers import (
    Gemma2Config,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GenerationConfig,
    Llama4TextConfig,
    LlamaConfig,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
)

from ppoforge.cli import main
from ppoforge.config import build_config
from ppoforge.errors import UserError
from ppoforge.lm.models.decoders import HFDecoder, decoder_for
from ppoforge.lm.models.loading import load_causal_lm
from ppoforge.lm.models.logprobs import token_logprobs
from ppoforge.lm.models.parts import response_hidden
from ppoforge.lm.models.rows import padded, shared_prefix
from ppoforge.lm.models.sampler import SamplingParams, sample
from ppoforge.lm.models.tiny import tiny_tokenizer
from ppoforge.lm.models.windows import attention_window, layer_windows
from ppoforge.lm.rl.config import RLHFConfig
from ppoforge.lm.rl.rewards import RewardModelScorer
from ppoforge.lm.rl.trainer import RLHFTrainer
from ppoforge.lm.supervised.config import SFTConfig

W = 16  # every windowed test model's window
SIZE = dict(vocab_size=600, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1)
# Gemma 3's trunk: on transformers 4.56 (the floor) Gemma3ForCausalLM's base_model is the model itself, and
# ppoforge refuses it in one line (`test_a_model_with_no_base_model_is_refused_in_one_line`)
GEMMA3_TRUNK = Gemma3ForCausalLM(Gemma3TextConfig(head_dim=16, vocab_size=8, hidden_size=16, intermediate_size=16,
                                                  num_hidden_layers=1, num_attention_heads=1,
                                                  num_key_value_heads=1)).base_model.__class__.__name__ != \
    "Gemma3ForCausalLM"
WINDOWED = ("gemma3", "mistral", "qwen2") if GEMMA3_TRUNK else ("mistral", "qwen2")
LINES = {"gemma3": "model: gemma3_text attends within a sliding window of 16 positions on 1 of 2 layers",
         "mistral": "model: mistral attends within a sliding window of 16 positions on every layer",
         "qwen2": "model: qwen2 attends within a sliding window of 16 positions on 1 of 2 layers"}
PROMPTS = ["rain", "the sun", "coffee today", "a good book"]


def _model(name: str, ids: dict):
    if name == "gemma3":  # sliding_window_pattern 2: layer 0 slides, layer 1 attends to everything
        return Gemma3ForCausalLM(Gemma3TextConfig(head_dim=16, query_pre_attn_scalar=16, sliding_window=W,
                                                  sliding_window_pattern=2, **SIZE, **ids))
    if name == "mistral":  # every layer slides
        return MistralForCausalLM(MistralConfig(sliding_window=W, **SIZE, **ids))
    if name == "qwen2":  # layers from max_window_layers on slide: layer 1
        return Qwen2ForCausalLM(Qwen2Config(use_sliding_window=True, sliding_window=W, max_window_layers=1, **SIZE,
                                            **ids))
    return Qwen2ForCausalLM(Qwen2Config(**SIZE, **ids))  # "plain": full attention everywhere


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """name -> a saved tiny random checkpoint with the tiny BPE tokenizer (and its chat template)."""
    tok = tiny_tokenizer()
    ids = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    out = {}
    for seed, name in enumerate(("gemma3", "mistral", "qwen2", "plain")):
        path = tmp_path_factory.mktemp(name)
        tok.save_pretrained(path)
        torch.manual_seed(seed)
        model = _model(name, ids)
        model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        model.save_pretrained(path)
        out[name] = path
    return out


@pytest.fixture(scope="module")
def prompts_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


# ---- which models have windows -----------------------------------------------------------------------------
CONFIGS = {  # name -> (config, the smallest window or None)
    "gemma3": (Gemma3TextConfig(head_dim=16, sliding_window=16, sliding_window_pattern=2, **SIZE), 16),
    "gemma2": (Gemma2Config(head_dim=16, sliding_window=32, **SIZE), 32),
    "mistral": (MistralConfig(sliding_window=16, **SIZE), 16),
    "mistral_no_window": (MistralConfig(sliding_window=None, **SIZE), None),
    "qwen2_sliding": (Qwen2Config(use_sliding_window=True, sliding_window=16, max_window_layers=1, **SIZE), 16),
    "qwen2_window_above_every_layer": (Qwen2Config(use_sliding_window=True, sliding_window=16, max_window_layers=2,
                                                   **SIZE), None),
    "qwen2": (Qwen2Config(**SIZE), None),
    "qwen2_moe": (Qwen2MoeConfig(**SIZE), None),  # keeps sliding_window 0 with use_sliding_window off
    "llama": (LlamaConfig(**SIZE), None),
    "llama4_chunked": (Llama4TextConfig(attention_chunk_size=8, **SIZE), 8),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_attention_window_is_the_smallest_window_any_layer_uses(name):
    config, window = CONFIGS[name]
    assert attention_window(config) == window
    kinds = [w[0] for w in layer_windows(config) if w is not None]
    assert bool(kinds) == (window is not None)


# ---- refused: rows past the window ---------------------------------------------------------------------------
def _rlhf(checkpoints, prompts_path, model="qwen2", **overrides):
    values = dict(model=str(checkpoints[model]), prompts=str(prompts_path), heldout_prompts=None,
                  max_prompt_tokens=8, max_new_tokens=8, batch_size=2, mini_batch_size=2, micro_batch_size=2,
                  ppo_epochs=1, total_updates=1, device="cpu", seed=0, torch_threads=1, progress=False,
                  tensorboard=False, precision="fp32")
    return build_config(RLHFConfig, {**values, **overrides})


def _reward(prompts, completions, **kw):
    return [float(len(c)) for c in completions]


@pytest.mark.parametrize("name", WINDOWED)
def test_rlhf_rows_past_the_window_are_refused_in_one_line(checkpoints, prompts_path, tmp_path, name):
    cfg = _rlhf(checkpoints, prompts_path, name, max_prompt_tokens=16, max_new_tokens=8)
    with pytest.raises(UserError) as refusal:
        RLHFTrainer(cfg, tmp_path, reward_fn=_reward)
    line = str(refusal.value)
    assert line.startswith(LINES[name] + ", and this run's rows reach 24 positions (max_prompt_tokens 16 + "
                           "max_new_tokens 8); allowed: rows within the window (max_prompt_tokens + max_new_tokens "
                           "<= 16), or a model whose layers all attend to every position"), line
    assert "\n" not in line


def test_a_model_with_no_base_model_is_refused_in_one_line(checkpoints, prompts_path, tmp_path, capsys):
    if GEMMA3_TRUNK:
        pytest.skip(f"transformers {transformers.__version__}: Gemma 3 has its base model (the floor's has not)")
    code = main(["train", "rlhf", "--model", str(checkpoints["gemma3"]), "--prompts", str(prompts_path),
                 "--heldout-prompts", "none", "--reward", "length:4", "--max-prompt-tokens", "8",
                 "--max-new-tokens", "4", "--device", "cpu", "--progress", "false", "--tensorboard", "false",
                 "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("ppoforge: error:")]
    assert code == 2 and len(errors) == 1 and "names no base model" in errors[0], err


def test_rlhf_refusal_through_the_cli_is_exit_2(checkpoints, prompts_path, tmp_path, capsys):
    name = "gemma3" if GEMMA3_TRUNK else "qwen2"
    code = main(["train", "rlhf", "--model", str(checkpoints[name]), "--prompts", str(prompts_path),
                 "--heldout-prompts", "none", "--reward", "length:4", "--max-prompt-tokens", "12",
                 "--max-new-tokens", "5", "--batch-size", "2", "--mini-batch-size", "2", "--micro-batch-size", "2",
                 "--total-updates", "1", "--device", "cpu", "--progress", "false", "--tensorboard", "false",
                 "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("ppoforge: error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].startswith(f"ppoforge: error: {LINES[name]}, and this run's rows reach 17 positions"), err


def test_rlhf_critic_model_with_a_window_is_checked_too(checkpoints, prompts_path, tmp_path):
    cfg = _rlhf(checkpoints, prompts_path, "plain", layout="full", critic_model=str(checkpoints["qwen2"]),
                max_prompt_tokens=12, max_new_tokens=8)
    with pytest.raises(UserError, match=r"^critic_model: qwen2 attends within a sliding window of 16 positions on "
                                        r"1 of 2 layers, and this run's rows reach 20 positions"):
        RLHFTrainer(cfg, tmp_path, reward_fn=_reward)


def test_sft_packing_past_the_window_is_refused(checkpoints, tmp_path):
    from ppoforge.lm.supervised.sft import SFTObjective

    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"tell me about {p}", "completion": "it is good"}) + "\n"
                            for p in PROMPTS * 2))
    cfg = build_config(SFTConfig, dict(model=str(checkpoints["mistral"]), data=str(data), packing=True,
                                       max_length=40, device="cpu", progress=False, tensorboard=False))
    with pytest.raises(UserError, match=r"^packing: mistral attends within a sliding window of 16 positions on every "
                                        r"layer, and this run's rows reach 40 positions .* allowed: packing false"):
        SFTObjective(cfg, tmp_path / "run")


# ---- within the window: Hugging Face's numbers ----------------------------------------------------------------
def _sequences(vocab: int, lengths: list[tuple[int, int]], seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """(prompt, response) token lists; rows 2i and 2i + 1 share their prompt (a shared-prefix unit of 2)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (p, n) in enumerate(lengths):
        prompt = out[-1][0] if i % 2 else torch.randint(3, vocab, (p,), generator=g).tolist()
        out.append((prompt, torch.randint(3, vocab, (n,), generator=g).tolist()))
    return out


def _batch(seqs, pad: int):
    """Left-padded prompts + right-padded responses: ids (B, P + T), mask, responses (B, T), response mask."""
    width_p, width_t = max(len(p) for p, _ in seqs), max(len(r) for _, r in seqs)
    ids = torch.full((len(seqs), width_p + width_t), pad)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(seqs):
        ids[i, width_p - len(p):width_p + len(r)] = torch.tensor(p + r)
        mask[i, width_p - len(p):width_p + len(r)] = 1
    return ids, mask, ids[:, width_p:], mask[:, width_p:]


def _hf_logprobs(model, seqs, temperature: float = 1.0) -> list[torch.Tensor]:
    """Each sequence alone through the model's own forward: the log-probs of its response tokens."""
    out = []
    for p, r in seqs:
        logits = model(input_ids=torch.tensor([p + r])).logits[0].float() / temperature
        out.append(logits.log_softmax(-1)[len(p) - 1:-1].gather(1, torch.tensor(r)[:, None])[:, 0])
    return out


def _ours(model, rows, resp):
    hidden = response_hidden(model.base_model, rows)
    return token_logprobs(model.get_output_embeddings()(hidden), resp, entropy=False)[0]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", WINDOWED)
@torch.no_grad()
def test_logprobs_within_the_window_equal_the_models_own_forward(checkpoints, name, attn):
    model = load_causal_lm(str(checkpoints[name]), attn_implementation=attn)
    seqs = _sequences(model.config.vocab_size, [(6, 10), (6, 7), (4, 12), (4, 3)])  # 16, 13, 16, 7 tokens <= W
    ids, mask, resp, resp_mask = _batch(seqs, model.config.pad_token_id)
    expected = _hf_logprobs(model, seqs)
    for rows in (padded(ids, mask, resp.shape[1]), shared_prefix(ids, mask, resp.shape[1], 2)):
        logp = _ours(model, rows, resp)
        for i, want in enumerate(expected):
            got = logp[i, :int(resp_mask[i].sum())]
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", WINDOWED)
@torch.no_grad()
def test_past_the_window_one_mask_for_every_layer_is_another_model(checkpoints, name):
    """Why the runs above are refused: a 24-token sequence through the run's 4D mask is not the model."""
    model = load_causal_lm(str(checkpoints[name]), attn_implementation="eager")
    seqs = _sequences(model.config.vocab_size, [(8, 16)])
    ids, mask, resp, _ = _batch(seqs, model.config.pad_token_id)
    gap = (_ours(model, padded(ids, mask, resp.shape[1]), resp)[0] - _hf_logprobs(model, seqs)[0]).abs()
    assert gap[:W - 8].max() < 1e-5 and gap[W - 8:].max() > 1e-4  # the same model up to the window, then not


def _greedy(model, prompts: list[list[int]], n: int, decoder=None):
    """Our sampler with top_k 1 and HF's generate(do_sample=False) on the same left-padded prompts."""
    pad = model.config.pad_token_id
    ids, mask, _, _ = _batch([(p, []) for p in prompts], pad)
    ours = sample(decoder or decoder_for(model), ids, mask, SamplingParams(n, top_k=1, pad_id=pad)).response_ids
    config = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=0, eos_token_id=None, pad_token_id=pad)
    theirs = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, ids.shape[1]:]
    return ours, theirs


@pytest.mark.parametrize("name", WINDOWED)
@torch.no_grad()
def test_greedy_decode_within_the_window_equals_generate(checkpoints, name):
    model = load_causal_lm(str(checkpoints[name]), attn_implementation="eager")
    prompts = [p for p, _ in _sequences(model.config.vocab_size, [(6, 0), (0, 0), (4, 0)])][::2]
    ours, theirs = _greedy(model, prompts, W - 6)  # the longest row: 6 + 10 = 16 positions
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("name", WINDOWED)
@torch.no_grad()
def test_own_mask_decode_past_the_window_equals_generate(checkpoints, name):
    """SFT's samples (HFDecoder(own_masks=True)): the model builds each layer's mask and cache, as generate."""
    model = load_causal_lm(str(checkpoints[name]), attn_implementation="eager")
    prompts = [p for p, _ in _sequences(model.config.vocab_size, [(6, 0), (0, 0), (4, 0)])][::2]
    ours, theirs = _greedy(model, prompts, 3 * W, HFDecoder(model, own_masks=True))  # 6 + 48 positions
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("name", WINDOWED)
@torch.no_grad()
def test_turns_with_holes_decode_exactly_while_their_real_tokens_fit_the_window(checkpoints, name):
    """An episode's chunks (`extend`) leave holes in the cache: 6 + 12 + 1 slots for 6 + 5 + 1 real tokens. The
    run's decoder keeps every slot (a sliding layer's own cache kept its last 15 and no longer matched the
    mask), and its logits are the model's own on the real tokens alone."""
    model = load_causal_lm(str(checkpoints[name]), attn_implementation="eager")
    prompt, chunk = _sequences(model.config.vocab_size, [(6, 12)])[0]
    ids, mask, _, _ = _batch([(prompt, [])], model.config.pad_token_id)
    decoder = decoder_for(model)
    decoder.prefill(ids, mask, 13)
    decoder.extend(torch.tensor([chunk]), torch.tensor([[True] * 5 + [False] * 7]))
    logits, _ = decoder.extend(torch.tensor([[7]]), torch.tensor([[True]]))
    want = model(input_ids=torch.tensor([prompt + chunk[:5] + [7]])).logits[0, -1]
    torch.testing.assert_close(logits[0].float(), want.float(), rtol=0, atol=1e-5)


def test_sft_samples_past_the_window_decode_through_the_models_own_masks(checkpoints, tmp_path):
    from ppoforge.lm.supervised.sft import SFTObjective

    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"tell me about {p}", "completion": "it is good"}) + "\n"
                            for p in PROMPTS * 2))
    cfg = build_config(SFTConfig, dict(model=str(checkpoints["mistral"]), data=str(data), max_length=40,
                                       sample_prompts=2, sample_tokens=2 * W, eval_fraction=0.5, device="cpu",
                                       precision="fp32", progress=False, tensorboard=False))
    objective = SFTObjective(cfg, tmp_path / "run")  # unpacked: the model's own masks, any max_length
    objective._write_samples()  # prompt + 32 new tokens, past the window of 16
    assert len((tmp_path / "run" / "samples.jsonl").read_text().splitlines()) == 2


def test_a_reward_model_shares_prefixes_only_within_its_window(checkpoints, tmp_path):
    from ppoforge.lm.supervised.config import RewardConfig
    from ppoforge.lm.supervised.reward_model import RewardObjective

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "chosen": "it is good", "rejected": "it is bad"}) + "\n"
                            for p in PROMPTS * 2))
    for model, branched in (("plain", True), ("qwen2", False)):  # pairs of up to 64 tokens: past qwen2's 16
        cfg = build_config(RewardConfig, dict(model=str(checkpoints[model]), data=str(data), max_length=64,
                                              device="cpu", progress=False, tensorboard=False))
        assert RewardObjective(cfg, tmp_path / model).branched is branched


@pytest.mark.parametrize("name", WINDOWED)
def test_an_rlhf_rollout_within_the_window_scores_as_the_models_own_forward(checkpoints, prompts_path, tmp_path,
                                                                             name):
    """max_prompt_tokens + max_new_tokens = the window: the run is allowed, and its sampler's and recomputed
    log-probs (GRPO, shared-prefix rows where they pay) are the model's own forward of each sequence; one
    update trains."""
    cfg = _rlhf(checkpoints, prompts_path, name, advantage="grpo", num_generations=2, batch_size=2,
                mini_batch_size=4, micro_batch_size=4, old_logprobs="recompute")
    trainer = RLHFTrainer(cfg, tmp_path, reward_fn=_reward)
    batch = trainer.collect(trainer.next_prompts())
    rollout = trainer.logprobs_and_values(batch, torch.zeros(cfg.rollout_size))
    width_p = batch.ids.shape[1] - batch.samples.response_ids.shape[1]
    seqs = []
    for i in range(batch.ids.shape[0]):
        real = batch.mask[i].bool()
        p = batch.ids[i, :width_p][real[:width_p]].tolist()
        seqs.append((p, batch.samples.response_ids[i][batch.samples.response_mask[i].bool()].tolist()))
    with torch.no_grad():
        expected = _hf_logprobs(trainer.layout.policy_model, seqs, cfg.temperature)
    for i, want in enumerate(expected):
        n = len(seqs[i][1])
        torch.testing.assert_close(rollout.logp[i, :n], want, rtol=0, atol=1e-5)
        torch.testing.assert_close(batch.samples.logp[i, :n], want, rtol=0, atol=1e-5)
    metrics, _ = trainer.train_one_update()
    assert all(torch.isfinite(torch.tensor(float(v))) for k, v in metrics.items() if k.startswith("loss/"))


def test_a_reward_model_scores_texts_past_its_window_through_its_own_masks(checkpoints):
    """Shared-prefix scoring needs every text within the window; longer texts go right-padded (the model's
    own per-layer masks), which scores each as it scores alone."""
    scorer = RewardModelScorer(str(checkpoints["qwen2"]), batch_size=2, share_prefix=True)
    assert scorer.window == W and scorer.group_size([[5] * 30, [5] * 28 + [6, 7]]) == 1
    prompts, completions = ["the sun " * 12] * 2, ["is good", "is bad"]
    together = scorer(prompts, completions)
    alone = [scorer([p], [c])[0] for p, c in zip(prompts, completions, strict=True)]
    torch.testing.assert_close(torch.tensor(together), torch.tensor(alone), rtol=0, atol=1e-5)
