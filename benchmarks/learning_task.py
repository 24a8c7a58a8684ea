"""The task of learning_vs_trl.py: reasoning-gym arithmetic as the arithmetic demo sets it, for both sides.

Built by `build(out_dir, ...)` with ppoforge's venv (it reads the `arithmetic_demo` preset's prompt specs
through ppoforge's own `task:` loader); read by both learning workers, so the top level imports only the
standard library (the TRL venv needs reasoning-gym besides TRL, for the reward).

    out_dir/train.jsonl    {"prompt", "entry"}: the preset's training problems (reasoning-gym chain_sum,
                           seed 1, the preset's operand digits and terms) less every problem that is also
                           held out (`heldout_disjoint`, ppoforge's lm/data/prompts.py: without)
    out_dir/heldout.jsonl  {"prompt", "entry"}: `heldout` problems from the held-out generator seed (100000)
    out_dir/task.json      the settings, and how many training rows the held-out set removed

A prompt is the preset's plain text (no chat template): two solved examples, then the problem; the answer
is the text in the completion's last <answer> tags. `answer_reward` is the one reward of both sides and of
the evaluation: reasoning-gym's `extract_answer` and the dataset's own `score_answer` (exactly what
ppoforge's `reward: task` computes), over each row's `entry` column (the reasoning-gym entry as JSON).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

HELDOUT_SEED = 100000
SETTINGS = ("num_generations", "batch_size", "learning_rate", "temperature", "max_new_tokens")
# the adapters of both sides and of the evaluator (peft LoraConfig keywords): ppoforge's layout defaults
LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": "all-linear", "bias": "none",
        "task_type": "CAUSAL_LM"}


def spec(size: int, seed: int, digits: int, terms: int, instruction: str) -> str:
    return (f"task:chain_sum?size={size}&seed={seed}&min_terms={terms}&max_terms={terms}&min_digits=1"
            f"&max_digits={digits}&instruction={instruction}")


def build(out: Path, train: int = 500, heldout: int = 64, digits: int = 1, terms: int = 2) -> dict:
    """Write the task folder (see the module docstring); returns task.json's content."""
    from urllib.parse import quote

    from ppoforge.config import read_preset
    from ppoforge.lm.data.prompts import load_prompts, without

    preset = read_preset("arithmetic_demo", "rlhf")
    instruction = preset["prompts"].partition("&instruction=")[2]  # the preset's own few-shot header
    rows = load_prompts(spec(train, 1, digits, terms, instruction), "prompt")
    held = load_prompts(spec(heldout, HELDOUT_SEED, digits, terms, instruction), "prompt")
    kept = without(rows, held, "prompt")
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", kept), ("heldout", held)):
        with open(out / f"{name}.jsonl", "w") as f:
            for r in part:
                entry = {"question": r["question"], "answer": r["answer"], "metadata": r["metadata"]}
                f.write(json.dumps({"prompt": r["prompt"], "entry": json.dumps(entry)}) + "\n")
    info = {"task": "chain_sum", "digits": digits, "terms": terms, "train_rows": len(kept),
            "left_out": len(rows) - len(kept), "heldout_rows": len(held),
            "distinct_train_problems": len({r["prompt"] for r in kept}), "instruction": quote(instruction),
            # the preset's trainer settings, which the TRL worker (no ppoforge in its venv) reads from here
            "settings": {k: preset[k] for k in SETTINGS}}
    (out / "task.json").write_text(json.dumps(info, indent=1))
    return info


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line]


@functools.cache
def _checker(source: str):
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(source)


def answer_reward(prompts: list, completions: list, entry: list, **kwargs) -> list[float]:
    """Both sides' reward and the evaluation's score: the dataset's `score_answer` on the text in the
    completion's last <answer> tags (reasoning_gym.utils.extract_answer; none: 0), in [0, 1]."""
    from reasoning_gym.utils import extract_answer

    entries = [json.loads(e) for e in entry]
    return [float(_checker(e["metadata"]["source_dataset"])(extract_answer(text), e))
            for text, e in zip(completions, entries, strict=True)]
