"""SFT and preference rows -> tokens and masks: assistant-only loss at the template's boundaries, plain
prompt/completion for base models, implicit prompts, and every dropped row counted by its reason."""

import json
import math

import pytest
import torch

from ppoforge.errors import UserError
from ppoforge.lm.models.loading import load_tokenizer
from ppoforge.lm.supervised.examples import (
    preference_pairs,
    read_rows,
    render_turns,
    reward_input_ids,
    sft_example,
    sft_examples,
    split_prompt,
)
from ppoforge.lm.supervised.packing import collate, pack


@pytest.fixture(scope="module")
def chat_tok(tiny_lm_dir):
    return load_tokenizer(str(tiny_lm_dir))


@pytest.fixture(scope="module")
def base_tok(tiny_llama_dir):
    return load_tokenizer(str(tiny_llama_dir))


def _masked_text(tok, example):
    return tok.decode([t for t, m in zip(example.ids, example.loss_mask, strict=True) if m])


def test_loss_covers_every_assistant_turn_and_nothing_else(chat_tok):
    messages = [{"role": "system", "content": "be nice"}, {"role": "user", "content": "hello"},
                {"role": "assistant", "content": "good day"}, {"role": "user", "content": "thanks"},
                {"role": "assistant", "content": "you are welcome"}]
    ex = render_turns(chat_tok, messages)
    assert chat_tok.decode(ex.ids) == chat_tok.apply_chat_template(messages, tokenize=False)
    # the template's assistant header belongs to the prompt; the content and its end-of-turn are learned
    assert _masked_text(chat_tok, ex) == "good day<|im_end|>\nyou are welcome<|im_end|>\n"
    first = ex.loss_mask.index(1)
    assert chat_tok.decode(ex.ids[:first]).endswith("<|im_start|>assistant\n")


def test_prompt_completion_rows_use_the_template_or_eos(chat_tok, base_tok):
    ex = sft_example({"prompt": "hello", "completion": "good day"}, chat_tok, 512)
    assert _masked_text(chat_tok, ex) == "good day<|im_end|>\n"
    plain = sft_example({"prompt": "hello", "completion": " good day"}, base_tok, 512)
    assert base_tok.decode(plain.ids[plain.loss_mask.index(1):]) == " good day</s>"
    assert plain.loss_mask[0] == 0


def test_a_template_that_is_not_prefix_preserving_is_refused_for_that_row(tmp_path, tiny_lm_dir):
    tok = load_tokenizer(str(tiny_lm_dir))
    # renders the last message differently from the others: a prefix rendering cannot match
    tok.chat_template = ("{% for m in messages %}{% if loop.last %}<|im_start|>LAST {{ m['content'] }}{% else %}"
                         "<|im_start|>{{ m['role'] }} {{ m['content'] }}{% endif %}<|im_end|>{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}")
    rows = [(1, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]})]
    examples, drops = sft_examples(rows, "file x", tok, 512, strict=False)
    assert not examples and drops.counts == {"template_not_prefix": 1}


def test_bad_rows_are_counted_by_reason_and_strict_names_the_line(tmp_path, chat_tok):
    rows = [{"prompt": "hello", "completion": "good day"}, {"prompt": "hello"}, {"prompt": 3, "completion": "x"},
            {"prompt": "a " * 400, "completion": "b"}, {"messages": [{"role": "user", "content": "hi"}]},
            {"messages": "not a list"}, {"prompt": "hi", "completion": "   "}]
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    loaded, where = read_rows(str(path))
    examples, drops = sft_examples(loaded, where, chat_tok, 64, strict=False)
    assert len(examples) == 1
    assert drops.counts == {"missing_field": 1, "not_text": 1, "too_long": 1, "no_assistant_turn": 1,
                            "not_messages": 1, "empty": 1}
    assert drops.first["too_long"][0] == 4  # the line in the file
    summary = drops.summary(1)
    assert "1 rows used, 6 left out" in summary and "too_long (first: line 4" in summary
    with pytest.raises(UserError, match=r"^data: file .*sft\.jsonl line 2: .*\(missing_field\); allowed: fix the row"):
        sft_examples(loaded, where, chat_tok, 64, strict=True)


def test_implicit_prompts_are_the_common_prefix():
    assert split_prompt({"chosen": "Q: rain? A: lovely", "rejected": "Q: rain? A: awful"}) == (
        "Q: rain? A: ", "lovely", "awful")
    chat = [{"role": "user", "content": "q"}]
    prompt, c, r = split_prompt({"chosen": chat + [{"role": "assistant", "content": "a"}],
                                 "rejected": chat + [{"role": "assistant", "content": "b"}]})
    assert prompt == chat and c[0]["content"] == "a" and r[0]["content"] == "b"
    assert split_prompt({"prompt": "p", "chosen": "a", "rejected": "b"}) == ("p", "a", "b")


def test_preference_rows_by_reason(chat_tok):
    rows = list(enumerate([{"prompt": "p", "chosen": "good", "rejected": "bad", "margin": 1.5},
                           {"prompt": "p", "chosen": "same", "rejected": "same"},
                           {"chosen": "good"}, {"prompt": "p", "chosen": "a", "rejected": "b", "margin": "big"},
                           {"chosen": "x", "rejected": "y"}], 1))
    pairs, drops = preference_pairs(rows, "data", chat_tok, 512, strict=False)
    assert len(pairs) == 1 and pairs[0].margin == 1.5
    assert drops.counts == {"identical": 1, "missing_field": 1, "bad_margin": 1, "no_common_prompt": 1}
    # the reward model reads a pair as the scorer will at PPO time
    assert pairs[0].chosen == reward_input_ids(chat_tok, "p", "good")


def test_packed_rows_keep_positions_and_masks_per_example(chat_tok):
    exs = [sft_example({"prompt": p, "completion": c}, chat_tok, 512)
           for p, c in [("hello", "good day"), ("rain", "lovely weather today"), ("coffee", "yes")]]
    rows = pack(exs, max_length=sum(len(e.ids) for e in exs[:2]))
    assert [len(r) for r in rows] == [2, 1]
    batch = collate(rows, chat_tok.pad_token_id, "cpu")
    n0 = len(exs[0].ids)
    assert batch.segments[0, :n0].eq(1).all() and batch.segments[0, n0:n0 + len(exs[1].ids)].eq(2).all()
    assert batch.positions()[0, n0].item() == 0  # restarts with the second example
    assert batch.loss_mask[0, n0] == 0  # its first token has nothing in its own segment to predict it
    mask = batch.attention()[0, 0]
    assert not mask[n0 + 1, :n0].any() and mask[n0 + 1, n0:n0 + 2].all()  # no attention across examples
    assert int(batch.loss_tokens) == sum(sum(e.loss_mask[1:]) for e in exs)


def test_a_packed_example_has_the_logits_it_has_alone(tiny_lm_dir, chat_tok):
    from ppoforge.lm.models.attention import as_attention_bias
    from ppoforge.lm.models.loading import load_causal_lm

    model = load_causal_lm(str(tiny_lm_dir), tokenizer=chat_tok)
    exs = [sft_example({"prompt": p, "completion": c}, chat_tok, 512)
           for p, c in [("hello", "good day"), ("rain", "lovely weather today")]]

    def logits(rows):
        b = collate(rows, chat_tok.pad_token_id, "cpu")
        with torch.no_grad():
            return model(input_ids=b.ids, attention_mask=as_attention_bias(b.attention(), model),
                         position_ids=b.positions()).logits

    packed, alone = logits([exs]), logits([[exs[1]]])
    n0, n1 = len(exs[0].ids), len(exs[1].ids)
    torch.testing.assert_close(packed[0, n0:n0 + n1], alone[0, :n1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["deep.jsonl", "deep.json", "ragged.csv", "latin.csv", "empty.csv", "zero.parquet",
                                  "surrogate.jsonl", "surrogate.json", "digits.jsonl"])
def test_a_broken_sft_or_preference_file_is_one_line_naming_it(bad_data_files, name):
    path, match = bad_data_files[name]
    with pytest.raises(UserError, match=rf"^data: file .*{match}.*; allowed: ") as e:
        read_rows(str(path))
    assert "\n" not in str(e.value) and "DatasetGenerationError" not in str(e.value)


def test_identical_message_lists_are_counted_as_identical(chat_tok):
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    rows = [(1, {"chosen": chat, "rejected": [dict(m) for m in chat]}), (2, {"chosen": "same", "rejected": "same"}),
            (3, {"prompt": chat[:1], "chosen": chat[1:], "rejected": chat[1:]})]
    pairs, drops = preference_pairs(rows, "data", chat_tok, 512, strict=False)
    assert not pairs and drops.counts == {"identical": 3}


def test_an_unknown_role_is_refused_for_that_row_and_strict_names_it(chat_tok):
    rows = [(1, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}),
            (2, {"messages": [{"role": "human", "content": "hi"}, {"role": "assistant", "content": "hello"}]}),
            (3, {"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "gpt", "content": "x"}]})]
    examples, drops = sft_examples(rows, "file x.jsonl", chat_tok, 512, strict=False)
    assert len(examples) == 1 and drops.counts == {"bad_role": 2}
    detail = drops.first["bad_role"][1]
    assert "role 'human'" in detail and "system, user, assistant, tool" in detail
    with pytest.raises(UserError, match=r"^data: file x\.jsonl line 2: messages message 0 has role 'human'; "
                                        r"allowed: .*\(bad_role\)"):
        sft_examples(rows, "file x.jsonl", chat_tok, 512, strict=True)
    pairs, drops = preference_pairs([(1, {"prompt": [{"role": "usr", "content": "q"}], "chosen": "a",
                                          "rejected": "b"})], "data", chat_tok, 512, strict=False)
    assert not pairs and drops.counts == {"bad_role": 1}


@pytest.mark.parametrize("margin", [math.inf, -math.inf, 1e308, -4e38, pytest.param(10**400, id="400-digits"),
                                    pytest.param(-(10**400), id="-400-digits")])
def test_a_margin_float32_cannot_hold_is_refused(chat_tok, margin):
    """Finite as a Python float is not enough: the loss takes margins as float32, where 1e308 is inf and
    every step of its batch would be skipped as non-finite."""
    rows = [(1, {"prompt": "p", "chosen": "good", "rejected": "bad", "margin": margin}),
            (2, {"prompt": "p", "chosen": "good", "rejected": "bad", "margin": 3e38})]
    pairs, drops = preference_pairs(rows, "data", chat_tok, 512, strict=False)
    assert [p.margin for p in pairs] == [3e38] and drops.counts == {"bad_margin": 1}
    with pytest.raises(UserError, match=r"^data: data line 1: margin is .*; allowed: a finite number \(within float32"):
        preference_pairs(rows, "data", chat_tok, 512, strict=True)


def test_a_huge_row_is_too_long_before_it_is_tokenized(chat_tok, monkeypatch):
    """Issue 37: a 50 MB SFT completion took 12.4 GB and 141 s to be left out as too long. A row with more
    characters than max_length tokens can hold is refused without tokenizing it (the tokenizer is never called)."""
    from ppoforge.lm.data.files import CHARS_PER_TOKEN
    from ppoforge.lm.supervised import examples

    huge = "word " * (64 * CHARS_PER_TOKEN)
    calls = []
    monkeypatch.setattr(examples, "_encode", lambda *a: calls.append(a) or [])
    with pytest.raises(examples.RowError, match="characters, more than max_length 64 tokens hold"):
        examples.sft_example({"prompt": "p", "completion": huge}, chat_tok, 64)
    with pytest.raises(examples.RowError, match="characters, more than max_length 64 tokens hold"):
        examples.preference_pair({"prompt": "p", "chosen": huge, "rejected": "b"}, chat_tok, 64)
    assert calls == []
