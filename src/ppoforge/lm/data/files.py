"""Data sources -> numbered rows, for prompt sets (`prompts.py`) and SFT / preference data (lm/supervised/examples.py).

A local JSON or JSON Lines file is read with the standard library, row by row, so an error names the
line (and a column whose type varies between rows is the row's problem, not the file's: pyarrow's JSON
reader, behind `datasets`' "json" builder, refuses the whole file). CSV, Parquet, local dataset folders
and hub names go through `datasets.load_dataset`, quietly (its log lines and progress bars would break
the one-line promise). When that fails, the file is looked at again to say what is wrong in its own
terms — a byte that is not UTF-8, a line with more fields than the header, a Parquet file with no rows —
rather than `datasets`' generic "An error occurred while generating the dataset" (the cause it wraps
is the fallback). Every message here is one line without the caller's prefix ("prompts:", "data:").
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import re
from pathlib import Path

from ppoforge.errors import UserError

# Characters per token no tokenizer exceeds in practice: a text longer than n x this holds more than n tokens
# (a prompt's tail this long holds its last n tokens; a row this long cannot fit n), so a huge row is cut or
# refused without tokenizing all of it (a 50 MB row is millions of token ids).
CHARS_PER_TOKEN = 64

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
ALLOWED_JSON = "one JSON object per line (JSON Lines), or a .json file holding one array of objects"
ALLOWED_CSV = "a UTF-8 CSV file with a header line and at most the header's number of fields on every line"
MAX_DEPTH = 100  # lists / objects inside a row; a real row nests a few levels (messages -> message -> ...)
# JSON's "\ud800" escape parses to a lone surrogate: a str no tokenizer can encode (UTF-8 has no such character)
SURROGATE = re.compile("[\ud800-\udfff]")


def _depth(value) -> int:
    """How deeply lists and dicts nest in `value` (without recursion: the row may be very deep)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            todo += [(child, depth + 1) for child in children] if depth <= MAX_DEPTH else []
    return deepest


def _lone_surrogate(row: dict) -> str | None:
    """The name of the first field of `row` whose text (a key or a string inside it) holds a lone surrogate."""
    for name, value in row.items():
        todo = [name, value]
        while todo:
            item = todo.pop()
            if isinstance(item, str) and SURROGATE.search(item):
                return SURROGATE.sub("?", str(name))
            todo += list(item.items()) if isinstance(item, dict) else item if isinstance(item, list | tuple) else []
    return None


def _too_deep(path: Path, lineno: int) -> UserError:
    return UserError(f"file {path} line {lineno} nests deeper than {MAX_DEPTH} levels of lists and objects; "
                     f"allowed: {ALLOWED_JSON}, each at most {MAX_DEPTH} levels deep")


def _parse(path: Path, lineno: int, text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"file {path} line {lineno} is not valid JSON ({e.msg}); allowed: {ALLOWED_JSON}") from None
    except RecursionError:  # json's C scanner recurses once per nesting level
        raise _too_deep(path, lineno) from None
    except ValueError as e:  # an integer of more than sys.get_int_max_str_digits() digits
        raise UserError(f"file {path} line {lineno} is not valid JSON ({str(e).split(':')[0]}); "
                        f"allowed: {ALLOWED_JSON}") from None


def read_json_rows(path: Path) -> list[tuple[int, dict]]:
    """(line number, row) of a JSON Lines file, or of a .json file holding one array of objects (line
    numbers are then 1-based array indices). Anything else is a one-line UserError naming the line."""
    path = Path(path)
    text = _read_text(path)
    if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
        try:
            items = list(enumerate(json.loads(text), 1))
        except json.JSONDecodeError as e:
            raise UserError(f"file {path} is not valid JSON (line {e.lineno}: {e.msg}); allowed: {ALLOWED_JSON}") \
                from None
        except RecursionError:
            raise _too_deep(path, 1) from None
        except ValueError as e:  # as in `_parse`
            raise UserError(f"file {path} is not valid JSON ({str(e).split(':')[0]}); allowed: {ALLOWED_JSON}") \
                from None
    else:
        items = [(lineno, _parse(path, lineno, line)) for lineno, line in enumerate(text.splitlines(), 1)
                 if line.strip()]
    for lineno, row in items:
        if not isinstance(row, dict):
            raise UserError(f"file {path} line {lineno} is a JSON {type(row).__name__}, not an object; "
                            f"allowed: {ALLOWED_JSON}")
        if _depth(row) > MAX_DEPTH:
            raise _too_deep(path, lineno)
        if (name := _lone_surrogate(row)) is not None:
            raise UserError(f"file {path} line {lineno}: field {name!r} is not valid Unicode text (a lone surrogate); "
                            "allowed: UTF-8 text")
    return items


def _read_text(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise UserError(f"cannot read {path} ({e.strerror or e})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise UserError(f"file {path} is not UTF-8 text (line {line}, byte {e.start}); allowed: UTF-8 text "
                        "(re-save it as UTF-8)") from None


@contextlib.contextmanager
def _quiet_datasets():
    """No log lines or progress bars from `datasets` while it loads (both restored afterwards)."""
    import datasets  # start-up: datasets (~1 s to import) loads only for the sources it reads, never for JSON

    verbosity, bars_off = datasets.logging.get_verbosity(), datasets.utils.are_progress_bars_disabled()
    datasets.logging.set_verbosity(logging.CRITICAL)  # it logs "Failed to read file ..." before raising
    datasets.utils.disable_progress_bars()
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if not bars_off:
            datasets.utils.enable_progress_bars()


def _root_cause(e: BaseException) -> BaseException:
    seen = {id(e)}
    while (e.__cause__ or e.__context__) is not None and id(e.__cause__ or e.__context__) not in seen:
        e = e.__cause__ or e.__context__
        seen.add(id(e))
    return e


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _csv_problem(path: Path) -> str | None:
    """What stops a CSV file from loading, said in its own terms (its lines), or None when it looks fine."""
    text = _read_text(path)  # raises for a byte that is not UTF-8, naming its line
    reader = csv.reader(text.splitlines(keepends=True))
    header = next(reader, None)
    for fields in reader:
        if header is not None and len(fields) > len(header):
            return (f"file {path} line {reader.line_num} has {len(fields)} fields, the header has {len(header)}; "
                    f"allowed: {ALLOWED_CSV}")
    return None


def _parquet_rows(path: Path) -> int | None:
    import pyarrow.parquet as pq  # comes with datasets: loaded only to look into a Parquet file that failed

    try:
        return pq.ParquetFile(path).metadata.num_rows
    except Exception:  # noqa: BLE001 - not Parquet at all: the loader's own error says so
        return None


def _load(where: str, allowed: str, *args, **kwargs) -> list[dict] | None:
    """`datasets.load_dataset(...).to_list()`, quietly; None when the source holds no rows."""
    import datasets  # start-up: as in `_quiet_datasets`

    try:
        with _quiet_datasets():
            return datasets.load_dataset(*args, **kwargs).to_list()
    except ValueError as e:
        if "corresponds to no data" in str(e):  # how datasets reports a header-only CSV
            return None
        cause = _root_cause(e)
    except Exception as e:  # noqa: BLE001 - unreadable, offline, bad split: one user-facing problem
        cause = _root_cause(e)
    raise UserError(f"cannot load {where} ({_first_line(cause)}); allowed: {allowed}")


def read_table_rows(path: Path, allowed: str) -> list[tuple[int, dict]]:
    """(row number from 1, row) of a CSV or Parquet file; [] when it has no rows."""
    builder = FILE_BUILDERS[path.suffix.lower()]
    if path.stat().st_size == 0:
        return []
    try:
        rows = _load(f"file {path}", allowed, builder, data_files=str(path), split="train")
    except UserError:
        if builder == "csv" and (problem := _csv_problem(path)):
            raise UserError(problem) from None
        if builder == "parquet" and _parquet_rows(path) == 0:  # datasets fails on a file without rows
            return []
        raise
    return list(enumerate(rows or [], 1))


def read_source(source: str, split: str, allowed: str) -> tuple[list[tuple[int, dict]], list[str], str]:
    """(numbered rows, column names, where they came from) of a local .jsonl/.json/.csv/.parquet file, a
    local dataset folder or a hub dataset (`split` applies to the last two)."""
    path = Path(source).expanduser()
    if path.suffix.lower() in FILE_BUILDERS:
        if not path.is_file():
            raise UserError(f"no file {path}; allowed: {allowed}")
        rows = read_json_rows(path) if FILE_BUILDERS[path.suffix.lower()] == "json" else read_table_rows(path, allowed)
        return rows, list(dict.fromkeys(k for _, row in rows for k in row)), f"file {path}"
    if path.is_file():
        raise UserError(f"{path} has an unsupported format; allowed: {allowed}")
    if not source.strip():
        raise UserError(f"an empty name {source!r} names no data; allowed: {allowed}")
    if path.is_dir() and not any(p.is_file() and not p.name.startswith(".") for p in path.rglob("*")):
        raise UserError(f"folder {path} holds no files; allowed: {allowed}")  # datasets: a resolver's repr
    where = f"dataset {source!r} split {split!r}"  # a hub name, or a local folder of data files
    rows = _load(where, allowed, source, split=split) or []
    return list(enumerate(rows, 1)), list(dict.fromkeys(k for row in rows for k in row)), where
