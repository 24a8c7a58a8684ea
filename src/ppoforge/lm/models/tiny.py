"""A tiny random-init causal LM with a real tokenizer, saved as an ordinary HF checkpoint directory.

For evidence that the RLHF stack runs on a device (`ppoforge doctor`'s LM smoke run) without any
download: the tokenizer is a byte-level BPE trained in ~0.1 s on the shipped demo prompts, so any text
round-trips and the chat template works; the model is Qwen2-shaped and a few hundred KB. Byte-level
because transformers 5 rebuilds every qwen2 checkpoint's tokenizer as a `Qwen2Tokenizer` from the
vocab and merges of tokenizer.json — another tokenizer model would silently map words to <unk>.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Qwen2's pre-tokenization pattern: words, numbers, punctuation and whitespace runs.
PRETOKENIZE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _corpus() -> list[str]:
    text = (resources.files("ppoforge") / "lm" / "data" / "demo_prompts.jsonl").read_text()
    return [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]


def bpe_tokenizer(corpus: list[str], specials: list[str], vocab_size: int, **special_roles):
    """A byte-level BPE with Qwen2's pre-tokenizer, trained on `corpus` (any text round-trips)."""
    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **special_roles)


def tiny_tokenizer(vocab_size: int = 512):
    tok = bpe_tokenizer(_corpus(), SPECIALS, vocab_size, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def save_tiny_lm(out_dir: Path, hidden: int = 32, layers: int = 2, seed: int = 0) -> Path:
    """Write a random-init Qwen2ForCausalLM and its tokenizer into `out_dir`; returns it."""
    out = Path(out_dir)
    tok = tiny_tokenizer()
    tok.save_pretrained(out)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(out)
    return out
