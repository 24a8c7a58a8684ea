"""The `reasoning` GRPO benchmark workload: the real SmolLM2-135M-Instruct on reasoning-gym problems.

Built by `rlhf_workloads.build("reasoning", out_dir)` with ppoforge's venv (it needs ppoforge, for the cached
SmolLM2 checkpoint, and reasoning-gym); loaded by both GRPO workers, so this module's top level imports only
the standard library (the TRL venvs need only reasoning-gym besides TRL, for the reward).

    out_dir/policy/        the cached SmolLM2-135M-Instruct folder (ppoforge.lm.models.smollm2.ensure_cached):
                           its config files copied, model.safetensors a symlink (bf16 on disk; both workers
                           load it as fp32 weights)
    out_dir/tokenizer/     its tokenizer, saved in a folder of its own (as for the other workloads)
    out_dir/prompts.jsonl  {"prompt": chat-templated text, "input_ids": [...], "entry": JSON of the
                           reasoning-gym entry}; every prompt = FEW_SHOT (the same 121-token header) + one
                           problem, as one user turn of SmolLM2's chat template (its default system turn
                           included): ~155-170 tokens
    out_dir/workload.json  the Workload (prompt_len = the longest prompt)

Prompts are the text after the chat template, so both frameworks tokenize the same string the same way
(TRL: a plain-text prompt is tokenized as is; ppoforge: `use_chat_template: false`); each worker checks that
its tokenizer reproduces `input_ids`. The problems are reasoning-gym's `chain_sum` (2-4 terms of 1-2 digits,
seed 1); the header's worked examples are fixed text. `reasoning_reward` is the one reward of both sides:
the text after the completion's last "Answer:" (its first line), scored by the dataset's own
`score_answer` (reasoning_gym.get_score_answer_fn), 0 without an "Answer:".

`eos=False` (the scaling sweep's variant): the model's EOS (<|im_end|>) no longer stops a completion — the
tokenizer's and the generation config's EOS become <jupyter_output>, and the pad token <empty_output>, two
code-corpus tokens an instruct model does not emit after a chat turn — so every completion runs to the
token budget on both sides (the model writes on past its end of turn; the reward stays well defined).
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

TASK = "chain_sum"
TASK_KWARGS = {"min_terms": 2, "max_terms": 4, "min_digits": 1, "max_digits": 2}
NO_EOS, NO_EOS_PAD = "<jupyter_output>", "<empty_output>"
FEW_SHOT = """Add and subtract step by step, then write "Answer: <number>".

12 - 5 + 7 =
12 - 5 = 7
7 + 7 = 14
Answer: 14

3 + 48 - 9 =
3 + 48 = 51
51 - 9 = 42
Answer: 42

6 + 8 - 5 =
6 + 8 = 14
14 - 5 = 9
Answer: 9"""  # 121 tokens of SmolLM2's tokenizer


def problem_text(entry: dict) -> str:
    """The user turn: the header, then the problem in the examples' form."""
    return f"{FEW_SHOT}\n\n{entry['metadata']['expression']} ="


def build(w, out: Path, seed: int = 1, eos: bool = True):
    """Write the workload folder (see the module docstring); returns the Workload as written."""
    import dataclasses

    import reasoning_gym
    from transformers import AutoTokenizer, GenerationConfig

    from ppoforge.lm.models.smollm2 import ensure_cached

    src = ensure_cached()
    policy, tok_dir = out / "policy", out / "tokenizer"
    policy.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            (policy / f.name).symlink_to(f.resolve())
        elif f.name != "chat_template.jinja" and not f.name.startswith("tokenizer"):
            shutil.copy(f, policy / f.name)
    tok = AutoTokenizer.from_pretrained(src)
    if not eos:
        tok.eos_token, tok.pad_token = NO_EOS, NO_EOS_PAD
        gen = GenerationConfig.from_pretrained(policy)
        gen.eos_token_id, gen.pad_token_id = tok.eos_token_id, tok.pad_token_id
        gen.save_pretrained(policy)
        config = json.loads((policy / "config.json").read_text())
        config.update(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        (policy / "config.json").write_text(json.dumps(config, indent=2))
    tok.save_pretrained(tok_dir)
    data = reasoning_gym.create_dataset(TASK, size=w.n_prompts, seed=seed, **TASK_KWARGS)
    longest = 0
    with open(out / "prompts.jsonl", "w") as f:
        for i in range(len(data)):
            entry = data[i]
            text = tok.apply_chat_template([{"role": "user", "content": problem_text(entry)}], tokenize=False,
                                           add_generation_prompt=True)
            ids = tok(text)["input_ids"]
            longest = max(longest, len(ids))
            f.write(json.dumps({"prompt": text, "input_ids": ids, "entry": json.dumps(entry)}) + "\n")
    w = dataclasses.replace(w, prompt_len=longest, eos=eos)
    (out / "workload.json").write_text(json.dumps(dataclasses.asdict(w), indent=1))
    return w


def extract_answer(completion: str) -> str | None:
    """The first line after the last "Answer:", stripped (None without one)."""
    head, sep, tail = completion.rpartition("Answer:")
    if not sep:
        return None
    lines = tail.strip().splitlines()
    return lines[0].strip() if lines else ""


@functools.cache
def _checker(source: str):
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(source)


def reasoning_reward(prompts: list, completions: list, entry: list, **kwargs) -> list[float]:
    """Both sides' reward: reasoning-gym's `score_answer` of each completion's extracted answer, in [0, 1].
    `entry` is the prompt rows' column (TRL and ppoforge pass it per completion)."""
    entries = [json.loads(e) for e in entry]
    return [float(_checker(e["metadata"]["source_dataset"])(extract_answer(text), e))
            for text, e in zip(completions, entries, strict=True)]
