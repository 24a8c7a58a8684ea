"""Prompt loading from jsonl/json/csv/parquet through `datasets.load_dataset`, the built-in demo sets,
one-line user errors, and chat-template rendering."""

from __future__ import annotations

import json
import time

import pandas as pd
import pytest

from ppoforge.errors import UserError
from ppoforge.lm.data.prompts import load_prompts, render_prompt, without
from ppoforge.lm.models.loading import load_tokenizer

ROWS = [{"prompt": "Write one sentence about rain.", "topic": "weather"},
        {"prompt": "Describe your morning.", "topic": "day"},
        {"prompt": "Review a coffee shop.", "topic": "review"}]


def write(path, rows, fmt):
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "csv":
        pd.DataFrame(rows).to_csv(path, index=False)
    else:
        pd.DataFrame(rows).to_parquet(path)
    return str(path)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet"])
def test_every_file_format_gives_the_same_rows(tmp_path, fmt):
    source = write(tmp_path / f"prompts.{fmt}", ROWS, fmt)
    assert load_prompts(source) == ROWS
    assert load_prompts(source, limit=2) == ROWS[:2]
    assert load_prompts(source, field="topic", limit=10) == ROWS


def test_missing_field_lists_fields_present(tmp_path):
    source = write(tmp_path / "p.jsonl", ROWS, "jsonl")
    with pytest.raises(UserError, match=r"^prompts: file .*p\.jsonl has no field 'text'; "
                                        r"fields present: prompt, topic$"):
        load_prompts(source, field="text")


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_empty_file(tmp_path, fmt):
    path = tmp_path / f"empty.{fmt}"
    path.write_text("")
    with pytest.raises(UserError, match=rf"^prompts: file .*empty\.{fmt} has no rows; allowed: at least one "
                                        r"row with a 'text' field$"):
        load_prompts(str(path), field="text")


def test_header_only_csv_has_no_rows(tmp_path):
    path = tmp_path / "header.csv"
    path.write_text("prompt,topic\n")
    with pytest.raises(UserError, match=r"header\.csv has no rows; allowed: at least one row with"):
        load_prompts(str(path))


@pytest.mark.parametrize("bad", [None, "", "   ", 3])
def test_non_string_or_empty_prompt(tmp_path, bad):
    rows = [{"prompt": "fine"}, {"prompt": bad}]
    source = write(tmp_path / "p.jsonl", rows, "jsonl")
    with pytest.raises(UserError, match=r"p\.jsonl line 2 field 'prompt' is .*; allowed: a non-empty string, or a list "
                       r"of \{\"role\", \"content\"\} messages$"):
        load_prompts(source)  # the file's line, as every other message about a row says (it was "row 1")
    (tmp_path / "q.jsonl").write_text("\n" + json.dumps({"prompt": bad}) + "\n")  # a blank line, then the bad row
    with pytest.raises(UserError, match=r"q\.jsonl line 2 field 'prompt' is "):
        load_prompts(str(tmp_path / "q.jsonl"))


def test_unreadable_file(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "ok"}\n{not json\n')
    with pytest.raises(UserError, match=r"^prompts: file .*broken\.jsonl line 2 is not valid JSON \(.*\); "
                                        r"allowed: one JSON object per line") as e:
        load_prompts(str(path))
    assert "\n" not in str(e.value)
    path.write_text('{"prompt": "ok"}\n["a", "list"]\n')
    with pytest.raises(UserError, match=r"broken\.jsonl line 2 is a JSON list, not an object"):
        load_prompts(str(path))
    path.write_bytes(b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(UserError, match=r"broken\.jsonl is not UTF-8 text \(line 1, byte 15\); allowed: UTF-8"):
        load_prompts(str(path))


def test_missing_file_and_unsupported_format(tmp_path):
    with pytest.raises(UserError, match=r"^prompts: no file .*nope\.jsonl; allowed: a \.jsonl, \.json"):
        load_prompts(str(tmp_path / "nope.jsonl"))
    (tmp_path / "p.txt").write_text("hello\n")
    with pytest.raises(UserError, match=r"p\.txt has an unsupported format; allowed: a \.jsonl"):
        load_prompts(str(tmp_path / "p.txt"))


def test_bad_limit():
    with pytest.raises(UserError, match=r"limit 0 is out of range"):
        load_prompts("demo", limit=0)


def test_hub_name_offline_is_one_line_user_error():
    start = time.perf_counter()
    with pytest.raises(UserError, match=r"^prompts: cannot load dataset 'no-such-org/no-such-data' "
                                        r"split 'train' \(.*\); allowed: ") as e:
        load_prompts("no-such-org/no-such-data")
    assert "\n" not in str(e.value) and time.perf_counter() - start < 10


def test_local_dataset_folder_uses_split(tmp_path):
    write(tmp_path / "train.jsonl", ROWS[:2], "jsonl")
    write(tmp_path / "test.jsonl", ROWS[2:], "jsonl")
    assert load_prompts(str(tmp_path), split="test") == ROWS[2:]


def test_demo_sets_are_disjoint_and_clean():
    train, heldout = load_prompts("demo"), load_prompts("demo-heldout")
    assert len(train) == 184 and len(heldout) == 16
    assert all(set(row) == {"prompt"} for row in train + heldout)
    texts = [row["prompt"] for row in train + heldout]
    assert len(set(texts)) == 200 and max(len(t.split()) for t in texts) <= 16
    assert load_prompts("demo", limit=5) == train[:5]


def test_render_prompt_uses_chat_template_when_present(tiny_lm_dir, tiny_llama_dir):
    tok = load_tokenizer(str(tiny_lm_dir))
    assert render_prompt(tok, "Hello") == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    assert render_prompt(tok, "Hello", use_chat_template=False) == "Hello"
    assert render_prompt(load_tokenizer(str(tiny_llama_dir)), "Hello") == "Hello"  # no template


@pytest.mark.parametrize("name", ["deep.jsonl", "deep.json", "ragged.csv", "latin.csv", "empty.csv", "zero.parquet",
                                  "surrogate.jsonl", "surrogate.json", "digits.jsonl"])
def test_a_broken_file_is_one_line_naming_it_what_is_wrong_and_what_is_allowed(bad_data_files, name, capfd):
    path, match = bad_data_files[name]
    with pytest.raises(UserError, match=rf"^prompts: file .*{match}.*; allowed: ") as e:
        load_prompts(str(path))
    assert "\n" not in str(e.value) and "DatasetGenerationError" not in str(e.value)
    assert capfd.readouterr().err == ""  # no library log lines or progress bars besides the one line


@pytest.mark.parametrize("source, match", [("", r"an empty name '' names no data"),
                                           ("{empty}", r"folder .*empty holds no files")])
def test_an_empty_source_name_or_folder_is_one_line(tmp_path, source, match):
    """`--prompts ''` was datasets' IndexError, an empty folder its resolver's functools.partial repr."""
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    with pytest.raises(UserError, match=rf"^prompts: {match}; allowed: a .jsonl") as e:
        load_prompts(source.format(empty=tmp_path / "empty"))
    assert "partial" not in str(e.value) and "\n" not in str(e.value)


def test_without_leaves_out_the_held_out_prompts_and_refuses_when_none_is_left(capsys):
    rows = [{"prompt": p, "i": i} for i, p in enumerate(["a", "b", "a", "c"])]
    assert without(rows, [{"prompt": "a"}, {"prompt": "z"}], "prompt") == [rows[1], rows[3]]
    assert "2 of 4 training prompts are also held-out prompts" in capsys.readouterr().err
    assert without(rows, [{"prompt": "z"}], "prompt") == rows and not capsys.readouterr().err
    with pytest.raises(UserError, match=r"^prompts: all 4 training prompts are also held-out prompts"):
        without(rows, rows, "prompt")
