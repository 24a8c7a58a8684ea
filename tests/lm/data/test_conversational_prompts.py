"""TRL's conversational prompts (`{"prompt": [{"role": ..., "content": ...}, ...]}`): loaded as they are, rendered
by the tokenizer's chat template with the assistant's turn opened, trained on end to end; a malformed message or a
model without a chat template is one line."""

from __future__ import annotations

import json

import pytest

from ppoforge.cli import main
from ppoforge.errors import UserError
from ppoforge.lm.data.prompts import load_prompts, render_prompt, without
from ppoforge.lm.models.loading import load_tokenizer

CHATS = [[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": f"Name a {thing}."}]
         for thing in ("color", "fruit", "river", "tree", "city", "song")]


def _file(path, prompts) -> str:
    path.write_text("".join(json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate(prompts)))
    return str(path)


def test_a_conversation_is_rendered_by_the_chat_template_with_the_assistant_turn_open(tmp_path, tiny_lm_dir):
    rows = load_prompts(_file(tmp_path / "chats.jsonl", CHATS))
    assert [r["prompt"] for r in rows] == CHATS  # kept as the row has it (reward functions get the messages)
    tok = load_tokenizer(str(tiny_lm_dir))
    text = render_prompt(tok, rows[0]["prompt"])
    assert text == tok.apply_chat_template(CHATS[0], tokenize=False, add_generation_prompt=True)
    assert "Answer briefly." in text and text.endswith("<|im_start|>assistant\n")
    assert without(rows, rows[:2], "prompt") == rows[2:]  # held-out conversations left out of training


@pytest.mark.parametrize("prompt, problem", [
    ([], "the list of messages is empty"),
    (["hello"], "message 1 is 'hello', not a mapping"),
    ([{"role": "user"}], "message 1 has content None, not a string"),
    ([{"role": "user", "content": "hi"}, {"content": "x"}], "message 2 has role None, not a string"),
])
def test_a_malformed_conversation_is_one_line_naming_its_line(tmp_path, prompt, problem):
    path = _file(tmp_path / "bad.jsonl", [CHATS[0], prompt])
    with pytest.raises(UserError) as refusal:
        load_prompts(path)
    line = str(refusal.value)
    assert f"line 2 field 'prompt': {problem}; allowed: a list of" in line and "\n" not in line


def test_a_conversation_without_a_chat_template_is_one_line(tiny_llama_dir, tiny_lm_dir):
    with pytest.raises(UserError, match="needs the model's chat template, and its tokenizer has no chat template"):
        render_prompt(load_tokenizer(str(tiny_llama_dir)), CHATS[0])
    with pytest.raises(UserError, match="use_chat_template is false"):
        render_prompt(load_tokenizer(str(tiny_lm_dir)), CHATS[0], use_chat_template=False)
    assert render_prompt(load_tokenizer(str(tiny_llama_dir)), "plain text") == "plain text"


def test_rlhf_trains_on_conversational_prompts(tmp_path, tiny_lm_dir, capsys):
    prompts, held = _file(tmp_path / "chats.jsonl", CHATS[:4]), _file(tmp_path / "held.jsonl", CHATS[4:])
    code = main(["train", "rlhf", "--preset", "tiny", "--model", str(tiny_lm_dir), "--prompts", prompts,
                 "--heldout-prompts", held, "--heldout-samples", "1", "--max-prompt-tokens", "48",
                 "--reward", "length:4", "--batch-size", "2", "--mini-batch-size", "2",
                 "--total-updates", "1", "--progress", "false", "--tensorboard", "false",
                 "--run-dir", str(tmp_path / "run")])
    out, err = capsys.readouterr()
    assert code == 0 and out.startswith("done: 1 update"), err
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("objective/scores" in r for r in rows) and any("eval/scores" in r for r in rows)
