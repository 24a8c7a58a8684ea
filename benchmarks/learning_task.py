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


def flat(text: str) -> str:
    """A question on one line (its whitespace runs as single spaces): the few-shot lines stay one per example
    and the newline can end the answer line."""
    return " ".join(text.split())


def build_task(out: Path, name: str, kwargs: dict, max_new_tokens: int, train: int = 500, heldout: int = 32,
               shots: int = 2) -> dict:
    """A reasoning-gym task other than chain_sum, written as `build` writes chain_sum's: the header is `shots`
    solved problems of the task's own generator (seed 7, neither the training seed 1 nor the held-out seed),
    each as "Question: ... (on one line)" then "Answer: <answer>...</answer>", then the problem's question and
    "Answer:"; the training rows less
    every held-out problem. The prompt budget is the longest prompt's token count (nothing cut), in
    task.json's settings with the task's `max_new_tokens`; the rest of the settings are the preset's."""
    import reasoning_gym
    from transformers import AutoTokenizer

    from ppoforge.config import read_preset
    from ppoforge.lm.data.prompts import without
    from ppoforge.lm.models.smollm2 import ensure_cached

    def rows(size: int, seed: int) -> list[dict]:
        data = reasoning_gym.create_dataset(name, size=size, seed=seed, **kwargs)
        return [data[i] for i in range(len(data))]

    header = "\n".join(f"Question: {flat(e['question'])}\nAnswer: <answer>{e['answer']}</answer>"
                       for e in rows(shots, 7))

    def prompt_rows(entries: list[dict]) -> list[dict]:
        return [{"prompt": f"{header}\nQuestion: {flat(e['question'])}\nAnswer:",
                 "entry": json.dumps({k: e[k] for k in ("question", "answer", "metadata")})} for e in entries]

    held = prompt_rows(rows(heldout, HELDOUT_SEED))
    every = prompt_rows(rows(train, 1))
    kept = without(every, held, "prompt")
    tok = AutoTokenizer.from_pretrained(ensure_cached())
    longest = max(len(tok(r["prompt"]).input_ids) for r in kept + held)
    out.mkdir(parents=True, exist_ok=True)
    for part, part_rows in (("train", kept), ("heldout", held)):
        with open(out / f"{part}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part_rows)
    preset = read_preset("arithmetic_demo", "rlhf")
    info = {"task": name, "kwargs": kwargs, "digits": None, "train_rows": len(kept), "left_out": len(every) - len(kept),
            "heldout_rows": len(held), "distinct_train_problems": len({r["prompt"] for r in kept}), "header": header,
            "prompt_tokens": longest,
            "settings": {**{k: preset[k] for k in SETTINGS}, "max_new_tokens": max_new_tokens,
                         "max_prompt_tokens": longest}}
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
