"""Prompt sets for RLHF: a local data file, a `datasets` hub name, or the built-in demo prompts.

JSON and JSON Lines files are read with the standard library, row by row, so an error names the line
(and a column whose type varies between rows is the row's problem, not the file's: pyarrow's JSON reader,
behind `datasets`' "json" builder, refuses the whole file). CSV, Parquet, hub datasets and local dataset
folders go through `datasets.load_dataset`. A prompt row is a
plain dict with at least the prompt field as a non-empty string; the trainer passes the row's other
columns to reward functions as keyword lists, so extra columns (a reference answer, a label) are how a
prompt set carries what its reward needs.

`task:NAME?KEY=VALUE&...` generates a reasoning-gym task's problems (`lm/tasks.py`), with the answers
and metadata its checker (`--reward task`) needs.

The built-in `demo` (184 prompts) and `demo-heldout` (16) sets are one shipped JSONL file with a
`split` column: short, neutral requests ("Write one sentence about rain.") whose completions can be
cheerful or gloomy, which is what a sentiment reward has to steer.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import datasets
from transformers import PreTrainedTokenizerBase

from ppoforge.errors import UserError

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
DEMO_SPLITS = {"demo": "train", "demo-heldout": "heldout"}
ALLOWED_SOURCES = ("a .jsonl, .json, .csv or .parquet file, a datasets hub name, demo / demo-heldout, or "
                   "task:NAME?KEY=VALUE (reasoning-gym)")
ALLOWED_JSON = "one JSON object per line (JSON Lines), or a .json file holding one array of objects"


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _no_rows(where: str, field: str) -> UserError:
    return UserError(f"prompts: {where} has no rows; allowed: at least one row with a {field!r} field")


def _load(where: str, field: str, *args, **kwargs) -> datasets.Dataset:
    try:
        return datasets.load_dataset(*args, **kwargs)
    except ValueError as e:
        if "corresponds to no data" in str(e):  # how datasets reports a header-only CSV
            raise _no_rows(where, field) from None
        reason = _first_line(e)
    except Exception as e:  # noqa: BLE001 - unreadable, offline, bad split: one user-facing problem
        reason = _first_line(e)
    raise UserError(f"prompts: cannot load {where} ({reason}); allowed: {ALLOWED_SOURCES}")


def read_json_rows(path: Path) -> list[tuple[int, dict]]:
    """(line number, row) of a JSON Lines file, or of a .json file holding one array of objects (line
    numbers are then 1-based array indices). Anything else is a one-line UserError naming the line."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"file {path} is not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise UserError(f"cannot read {path} ({e.strerror or e})") from None
    if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
        try:
            items = list(enumerate(json.loads(text), 1))
        except json.JSONDecodeError as e:
            raise UserError(f"file {path} is not valid JSON (line {e.lineno}: {e.msg})") from None
    else:
        items = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                items.append((lineno, json.loads(line)))
            except json.JSONDecodeError as e:
                raise UserError(f"file {path} line {lineno} is not valid JSON ({e.msg})") from None
    for lineno, row in items:
        if not isinstance(row, dict):
            raise UserError(f"file {path} line {lineno} is a JSON {type(row).__name__}, not an object")
    return items


def _read_file(path: Path, field: str) -> tuple[list[dict], list[str]]:
    """(rows, columns) of a local data file."""
    where = f"file {path}"
    if not path.is_file():
        raise UserError(f"prompts: no file {path}; allowed: {ALLOWED_SOURCES}")
    if path.stat().st_size == 0:
        raise _no_rows(where, field)
    if FILE_BUILDERS[path.suffix.lower()] == "json":
        try:
            rows = [row for _, row in read_json_rows(path)]
        except UserError as e:
            raise UserError(f"prompts: {e}; allowed: {ALLOWED_JSON}") from None
        return rows, list(dict.fromkeys(k for row in rows for k in row))
    ds = _load(where, field, FILE_BUILDERS[path.suffix.lower()], data_files=str(path), split="train")
    return ds.to_list(), ds.column_names


def _open_source(source: str, field: str, split: str) -> tuple[list[dict], list[str], str]:
    """(rows, columns, a description of where they came from for error messages)."""
    path = Path(source).expanduser()
    if path.suffix.lower() in FILE_BUILDERS:
        return *_read_file(path, field), f"file {path}"
    if path.is_file():
        raise UserError(f"prompts: {path} has an unsupported format; allowed: {ALLOWED_SOURCES}")
    where = f"dataset {source!r} split {split!r}"  # a hub name, or a local folder of data files
    ds = _load(where, field, source, split=split)
    return ds.to_list(), ds.column_names, where


def _demo_rows(split: str) -> list[dict]:
    with resources.as_file(resources.files("ppoforge") / "lm" / "data" / "demo_prompts.jsonl") as path:
        rows = [row for _, row in read_json_rows(path)]
    return [{k: v for k, v in row.items() if k != "split"} for row in rows if row["split"] == split]


def _check_rows(rows: list[dict], columns: list[str], field: str, where: str) -> None:
    if not rows:
        raise _no_rows(where, field)
    if field not in columns:
        raise UserError(f"prompts: {where} has no field {field!r}; fields present: {', '.join(columns)}")
    for i, row in enumerate(rows):
        value = row.get(field)
        if not isinstance(value, str) or not value.strip():
            raise UserError(f"prompts: {where} row {i} field {field!r} is {value!r:.60}; "
                            "allowed: a non-empty string")


def load_prompts(source: str, field: str = "prompt", split: str = "train",
                 limit: int | None = None) -> list[dict]:
    """The first `limit` rows (all if None) of `source`, each a dict with `field` a non-empty str.

    `split` applies to hub datasets and local dataset folders; a single file is its own split, and
    `demo` / `demo-heldout` name their split themselves.
    """
    if limit is not None and limit < 1:
        raise UserError(f"prompts: limit {limit} is out of range; allowed: >= 1 or None (all rows)")
    if source.startswith("task:"):  # reasoning-gym's generators (lm/tasks.py)
        from ppoforge.lm.tasks import task_rows

        rows = task_rows(source, field)[:limit]
        _check_rows(rows, list(rows[0]) if rows else [], field, f"task {source!r}")
        return rows
    if source in DEMO_SPLITS:
        rows = _demo_rows(DEMO_SPLITS[source])[:limit]
        _check_rows(rows, list(rows[0]) if rows else [], field, f"built-in prompt set {source!r}")
        return rows
    rows, columns, where = _open_source(source, field, split)
    rows = rows[:limit]
    _check_rows(rows, columns, field, where)
    return rows


def render_prompt(tokenizer: PreTrainedTokenizerBase, text: str, use_chat_template: bool = True) -> str:
    """`text` as one user turn of the tokenizer's chat template, ready for the assistant's reply.

    A tokenizer without a chat template (a base model) gets the text unchanged. The template string
    includes its special tokens, so tokenize the result with `add_special_tokens=False`.
    """
    if not use_chat_template or not tokenizer.chat_template:
        return text
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
