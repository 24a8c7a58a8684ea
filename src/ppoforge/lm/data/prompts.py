"""Prompt sets for RLHF: a local data file, a `datasets` hub name, or the built-in demo prompts.

Local files, dataset folders and hub names are read by `files.py` (one-line errors naming the file
and line). A prompt row is a plain dict with at least the prompt field: a non-empty string, or TRL's
conversational form, a list of `{"role", "content"}` messages, which the tokenizer's chat template renders
with the assistant's turn opened (`render_prompt`); reward functions get the prompt as it is in the row. The
trainer passes the row's other columns to reward functions as keyword lists, so extra columns (a
reference answer, a label) are how a prompt set carries what its reward needs.

`task:NAME?KEY=VALUE&...` generates a reasoning-gym task's problems (`lm/data/tasks.py`), with the answers
and metadata its checker (`--reward task`) needs.

The built-in `demo` (184 prompts) and `demo-heldout` (16) sets are one shipped JSONL file with a
`split` column: short, neutral requests ("Write one sentence about rain.") whose completions can be
cheerful or gloomy, which is what a sentiment reward has to steer. Any other prompt set is its own
held-out set by default: `split_heldout` draws a few of its rows, the same ones at every run and resume.
"""

from __future__ import annotations

import json
import random
import sys
from importlib import resources

from transformers import PreTrainedTokenizerBase

from ppoforge.errors import UserError
from ppoforge.lm.data.files import read_json_rows, read_source
from ppoforge.lm.data.tasks import task_rows

DEMO_SPLITS = {"demo": "train", "demo-heldout": "heldout"}
# `split_heldout`: the held-out rows of a prompt set are drawn with a fixed seed (not the run's: every seed,
# resume included, evaluates the same rows), at most SPLIT_MAX of them, none from fewer than SPLIT_MIN_ROWS rows
SPLIT_SEED, SPLIT_MAX, SPLIT_MIN_ROWS = 0, 32, 20
ALLOWED_SOURCES = ("a .jsonl, .json, .csv or .parquet file, a datasets hub name, demo / demo-heldout, or "
                   "task:NAME?KEY=VALUE (reasoning-gym)")


def _no_rows(where: str, field: str) -> UserError:
    return UserError(f"prompts: {where} has no rows; allowed: at least one row with a {field!r} field")


def _open_source(source: str, split: str) -> tuple[list[tuple[int, dict]], list[str], str]:
    """(numbered rows, columns, a description of where they came from for error messages)."""
    try:
        return read_source(source, split, ALLOWED_SOURCES)
    except UserError as e:
        raise UserError(f"prompts: {e}") from None


def _demo_rows(split: str) -> list[dict]:
    with resources.as_file(resources.files("ppoforge") / "lm" / "data" / "demo_prompts.jsonl") as path:
        rows = [row for _, row in read_json_rows(path)]
    return [{k: v for k, v in row.items() if k != "split"} for row in rows if row["split"] == split]


def _check_rows(rows: list[dict], columns: list[str], field: str, where: str, lines: list[int] | None = None) -> None:
    """Every row has `field` as a non-empty string; a refusal names the row's line (JSON files: the file's line,
    other sources: the row's number from 1, as SFT / preference data do)."""
    if not rows:
        raise _no_rows(where, field)
    if field not in columns:
        raise UserError(f"prompts: {where} has no field {field!r}; fields present: {', '.join(columns)}")
    for line, row in zip(lines or range(1, len(rows) + 1), rows, strict=True):
        value = row.get(field)
        if isinstance(value, list):
            problem = _message_problem(value)
            if problem:
                raise UserError(f"prompts: {where} line {line} field {field!r}: {problem}; allowed: a list of "
                                '{"role": str, "content": str} messages (TRL\'s conversational prompts)')
        elif not isinstance(value, str) or not value.strip():
            raise UserError(f"prompts: {where} line {line} field {field!r} is {value!r:.60}; "
                            "allowed: a non-empty string, or a list of {\"role\", \"content\"} messages")


def _message_problem(messages: list) -> str | None:
    """What is wrong with a conversational prompt (None: nothing)."""
    if not messages:
        return "the list of messages is empty"
    for i, m in enumerate(messages, 1):
        if not isinstance(m, dict):
            return f"message {i} is {m!r:.60}, not a mapping"
        for key in ("role", "content"):
            if not isinstance(m.get(key), str) or (key == "role" and not m[key]):
                return f"message {i} has {key} {m.get(key)!r:.60}, not a string"
    return None


def load_prompts(source: str, field: str = "prompt", split: str = "train",
                 limit: int | None = None) -> list[dict]:
    """The first `limit` rows (all if None) of `source`, each a dict with `field` a non-empty str.

    `split` applies to hub datasets and local dataset folders; a single file is its own split, and
    `demo` / `demo-heldout` name their split themselves.
    """
    if limit is not None and limit < 1:
        raise UserError(f"prompts: limit {limit} is out of range; allowed: >= 1 or None (all rows)")
    if source.startswith("task:"):  # reasoning-gym's generators (lm/data/tasks.py)
        rows = task_rows(source, field)[:limit]
        _check_rows(rows, list(rows[0]) if rows else [], field, f"task {source!r}")
        return rows
    if source in DEMO_SPLITS:
        rows = _demo_rows(DEMO_SPLITS[source])[:limit]
        _check_rows(rows, list(rows[0]) if rows else [], field, f"built-in prompt set {source!r}")
        return rows
    numbered, columns, where = _open_source(source, split)
    numbered = numbered[:limit]
    rows = [row for _, row in numbered]
    _check_rows(rows, columns, field, where, [line for line, _ in numbered])
    return rows


def without(rows: list[dict], held: list[dict], field: str) -> list[dict]:
    """`rows` less every row whose `field` text is also one of `held`'s: training prompts disjoint from the
    held-out ones (`heldout_disjoint`). Refused in one line when nothing would be left."""
    seen = {_key(r[field]) for r in held}
    kept = [r for r in rows if _key(r[field]) not in seen]
    if not kept:
        raise UserError(f"prompts: all {len(rows)} training prompts are also held-out prompts (heldout_disjoint); "
                        "allowed: a held-out set of other prompts, or heldout_disjoint false")
    if len(kept) < len(rows):
        print(f"ppoforge: prompts: {len(rows) - len(kept)} of {len(rows)} training prompts are also held-out "
              "prompts: left out of training (heldout_disjoint)", file=sys.stderr)
    return kept


def _key(prompt: str | list) -> str:
    """A prompt as something a set holds: its text, or a conversation as canonical JSON."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def split_heldout(rows: list[dict], fraction: float) -> tuple[list[dict], list[dict], list[int]]:
    """(training rows, held-out rows, the held-out rows' indices in `rows`): round(fraction x rows) of them, at
    least 1 and at most SPLIT_MAX, drawn with SPLIT_SEED; a set of fewer than SPLIT_MIN_ROWS rows is not split
    (no held-out rows: every row trains)."""
    if len(rows) < SPLIT_MIN_ROWS:
        return rows, [], []
    count = min(SPLIT_MAX, max(1, round(fraction * len(rows))))
    index = sorted(random.Random(SPLIT_SEED).sample(range(len(rows)), count))
    held = set(index)
    return [r for i, r in enumerate(rows) if i not in held], [rows[i] for i in index], index


def render_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str | list, use_chat_template: bool = True) -> str:
    """`prompt` as the tokenizer's chat template renders it, ready for the assistant's reply: a text as one user
    turn, a list of messages (TRL's conversational prompts) as that conversation.

    A tokenizer without a chat template (a base model) gets a text unchanged and refuses a conversation in one
    line. The template string includes its special tokens, so tokenize the result with `add_special_tokens=False`.
    """
    if isinstance(prompt, str):
        if not use_chat_template or not tokenizer.chat_template:
            return prompt
        prompt = [{"role": "user", "content": prompt}]
    elif not tokenizer.chat_template or not use_chat_template:
        why = "its tokenizer has no chat template" if use_chat_template else "use_chat_template is false"
        raise UserError(f"prompts: a conversational prompt (a list of messages) needs the model's chat template, "
                        f"and {why}; allowed: plain-text prompts, or a tokenizer with a chat template "
                        "(use_chat_template true)")
    try:
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - jinja2's TemplateError (a template's raise_exception) and its kin
        raise UserError(f"prompts: the chat template refused a conversation ({str(e)[:120]}); allowed: the roles "
                        "and order its template accepts") from None
