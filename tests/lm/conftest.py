"""Tiny random-init causal LMs, a reward model and a word-level tokenizer, saved as real HF checkpoints.

Session-scoped (built once, ~1 s) and read-only by convention: tests that need to change a checkpoint
copy it first. The tokenizer is a ~630-token byte-level BPE (any text encodes and decodes exactly) in
which ~100 words — including clear VADER sentiment words (" great", " terrible") — are single tokens,
so even a random policy emits text a sentiment reward can tell apart.

- `tiny_lm_dir`: Qwen2-shaped LM (hidden 64, 2 layers, 4 heads / 2 KV heads, intermediate 256), chat
  template, eos `<|im_end|>`, pad `<|endoftext|>` (distinct from EOS, as in Qwen2-Instruct).
- `tiny_llama_dir`: Llama-shaped LM of the same size, no chat template, eos `</s>` and no pad or unk
  token, so `load_tokenizer` must add `<|pad|>` and `load_causal_lm` must grow the embeddings.
- `tiny_reward_model_dir`: Qwen2ForSequenceClassification (1 label) with `tiny_lm_dir`'s tokenizer.
- `make_tiny_tokenizer(specials, **roles)`: the word-level tokenizer builder itself, for variants.
"""

from __future__ import annotations

import json
import random
import shutil

import datasets
import huggingface_hub.constants
import pytest
import torch
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForSequenceClassification,
)

from ppoforge.lm.models.tiny import bpe_tokenizer

WORDS = """\
the a an i you we it my your this that is was are be and but or so very not no yes of to in on at
for with about today day morning night weather food movie book review sentence one write describe tell
story place city home work train coffee rain sun people friend time good great happy love wonderful
excellent nice fun amazing best beautiful enjoy glad perfect bad terrible sad awful hate boring horrible
worst angry ugly poor broken late ok fine just really quite user assistant system hello thanks
. , ! ?""".split()  # noqa: SIM905 - a word list reads better as text
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SIZE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=256, max_position_embeddings=512)


def make_tokenizer(specials: list[str], **special_roles) -> PreTrainedTokenizerFast:
    """A byte-level BPE (Qwen2's pre-tokenizer) trained on shuffled WORDS: each word is one token.

    Byte-level because transformers 5 rebuilds any qwen2 checkpoint's tokenizer as a `Qwen2Tokenizer`
    from tokenizer.json's vocab and merges; any other tokenizer model would silently break there.
    """
    rng = random.Random(0)
    corpus = [" ".join(rng.sample(WORDS, len(WORDS))) for _ in range(20)] + [w.capitalize() for w in WORDS]
    return bpe_tokenizer(corpus, specials, 1000, **special_roles)


def _split_checkpoint(src, dest):
    """Copy a checkpoint into dest/model (weights and configs only) and dest/tokenizer (tokenizer only)."""
    for sub, keep in (("model", lambda n: "token" not in n and "chat" not in n), ("tokenizer", lambda n: not
                      n.endswith((".safetensors", "config.json")) or n == "tokenizer_config.json")):
        (dest / sub).mkdir(parents=True)
        for f in src.iterdir():
            if keep(f.name):
                shutil.copy(f, dest / sub / f.name)
    return dest / "model", dest / "tokenizer"


@pytest.fixture
def split_checkpoint():
    """(src, dest) -> (dest/model, dest/tokenizer): a checkpoint split into bare weights and tokenizer."""
    return _split_checkpoint


@pytest.fixture
def make_tiny_tokenizer():
    return make_tokenizer


@pytest.fixture(autouse=True)
def _offline_hub(monkeypatch):
    """No test may reach the Hugging Face hub: a hub id fails at once instead of retrying for ~25 s."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):  # datasets < 2.20 has only the second one
        if hasattr(datasets.config, name):
            monkeypatch.setattr(datasets.config, name, True)


@pytest.fixture(scope="session")
def tiny_lm_dir(tmp_path_factory):
    """A saved Qwen2-shaped causal LM + tokenizer with a chat template; pad != eos."""
    path = tmp_path_factory.mktemp("tiny_qwen2")
    tokenizer = make_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                               eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    config = Qwen2Config(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, attention_dropout=0.1, **SIZE)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A saved Llama-shaped causal LM whose tokenizer has no pad, no unk and no chat template."""
    path = tmp_path_factory.mktemp("tiny_llama")
    tokenizer = make_tokenizer(["<unk>", "<s>", "</s>"], bos_token="<s>", eos_token="</s>")
    tokenizer.save_pretrained(path)
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, attention_dropout=0.1, **SIZE)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_reward_model_dir(tmp_path_factory, tiny_lm_dir):
    """A saved Qwen2ForSequenceClassification with one label, sharing tiny_lm_dir's tokenizer."""
    path = tmp_path_factory.mktemp("tiny_reward")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_lm_dir)
    tokenizer.save_pretrained(path)
    config = Qwen2Config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, num_labels=1,
                         attention_dropout=0.1, **SIZE)
    torch.manual_seed(1)
    Qwen2ForSequenceClassification(config).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory):
    """The built-in SmolLM2 checkpoint, built once per session into a temporary PPOFORGE_CACHE root."""
    from ppoforge.lm.models import smollm2

    root = tmp_path_factory.mktemp("ppoforge-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PPOFORGE_CACHE", str(root))
        smollm2.ensure_cached()
    return root



@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory, request):
    """The test module's PROMPTS as a prompts .jsonl file ({"prompt": ...} per line)."""
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in request.module.PROMPTS))
    return path


@pytest.fixture
def bad_data_files(tmp_path) -> dict:
    """Each kind of broken data file a new user meets: (path, what the one line must say)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = {"deep.jsonl": ('{"prompt": "x", "meta": ' + "[" * 100_000 + "]" * 100_000 + "}\n",
                            r"deep\.jsonl line 1 nests deeper than"),
             "deep.json": ('[{"prompt": "x", "meta": ' + "[" * 100_000 + "]" * 100_000 + "}]",
                           r"deep\.json line 1 nests deeper than"),
             "ragged.csv": ("prompt,topic\nhello,rain\nworld,sun,extra\n",
                            r"ragged\.csv line 3 has 3 fields, the header has 2"),
             "latin.csv": ("prompt\nhello\ncaf\xe9\n".encode("latin-1"), r"latin\.csv is not UTF-8 text \(line 3"),
             "empty.csv": ("", r"empty\.csv has no rows"),
             "zero.parquet": (None, r"zero\.parquet has no rows"),
             # JSON's \ud800 escape: a str no tokenizer can encode (it reached the tokenizer as an internal error)
             "surrogate.jsonl": ('{"prompt": "ok", "chosen": "a", "rejected": "b"}\n{"prompt": "hi \\ud800"}\n',
                                 r"surrogate\.jsonl line 2: field 'prompt' is not valid Unicode text \(a lone "
                                 r"surrogate\)"),
             "surrogate.json": ('[{"prompt": "x", "meta": [{"k": "\\udfff"}]}]',
                                r"surrogate\.json line 1: field 'meta' is not valid Unicode text"),
             "digits.jsonl": ('{"prompt": "x", "n": ' + "9" * 5000 + "}\n",
                              r"digits\.jsonl line 1 is not valid JSON \(Exceeds the limit \(4300 digits\)")}
    out = {}
    for name, (content, match) in files.items():
        path = tmp_path / name
        if content is None:
            pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), path)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
        out[name] = (path, match)
    return out

