"""Rows of SFT and preference data -> token ids with loss masks; every row not used is counted by reason.

Formats (one row each; JSON Lines, JSON, CSV, Parquet, or a `datasets` name / folder):
- SFT: `{"prompt": ..., "completion": ...}` (strings, or lists of chat messages) or `{"messages": [...]}`.
  The loss covers the completion, or every assistant turn, and nothing else.
- Preferences: `{"chosen": ..., "rejected": ...}` with an explicit `"prompt"`, or without one: the
  prompt is then their common prefix (of messages for conversations, of text for strings); optional
  `"margin"` (a finite number float32 can hold).

A rendered conversation is tokenized once and each assistant turn located by rendering the prefix up to
that turn (with the generation prompt): the turn's tokens are what the full rendering adds. That needs
a prefix-preserving chat template; a row where the prefix does not match is dropped with that reason
rather than trained with a wrong mask. Rows are never truncated silently: too long is a reason too.
`--strict` turns the first dropped row into a UserError naming its line and reason.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from importlib import resources

from ppoforge.config import FLOAT32_MAX, float32_finite
from ppoforge.errors import UserError
from ppoforge.lm.data.files import CHARS_PER_TOKEN, read_json_rows, read_source

Conversation = list[dict]
ROLES = ("system", "user", "assistant", "tool")  # the chat-template roles; ShareGPT's human/gpt are not


@dataclass
class Example:
    ids: list[int]
    loss_mask: list[int]  # 1 where the token is a training target (completion / assistant tokens)


@dataclass
class Pair:
    chosen: list[int]
    rejected: list[int]
    margin: float = 0.0


class RowError(ValueError):
    """Why one row cannot be used; `reason` is the short name it is counted under."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(detail or reason)
        self.reason = reason


@dataclass
class Drops:
    """Rows left out, by reason, with the first one's place for the message."""

    where: str
    counts: Counter = field(default_factory=Counter)
    first: dict = field(default_factory=dict)  # reason -> (line, detail)

    def add(self, line: int, e: RowError, strict: bool) -> None:
        if strict:
            raise UserError(f"data: {self.where} line {line}: {e} ({e.reason}); allowed: fix the row, or drop "
                            "--strict to skip such rows (they are counted)")
        self.counts[e.reason] += 1
        self.first.setdefault(e.reason, (line, str(e)))

    def summary(self, used: int) -> str:
        if not self.counts:
            return f"{self.where}: {used} rows used"
        parts = ", ".join(f"{n} {reason} (first: line {self.first[reason][0]}, {self.first[reason][1]})"
                          for reason, n in self.counts.most_common())
        return f"{self.where}: {used} rows used, {sum(self.counts.values())} left out: {parts}"


ALLOWED_SOURCES = "a .jsonl/.json/.csv/.parquet file or a datasets name"
ALLOWED_ROWS = "messages, or prompt and completion, for SFT; chosen and rejected (and prompt) for preferences"
BUILTIN = {"demo-pairs": "train", "demo-pairs-heldout": "heldout", "demo-sft": "train", "demo-sft-heldout": "heldout"}


def _builtin_rows(source: str) -> list[tuple[int, dict]]:
    """The demo's preference pairs (`tools/make_demo_pairs.py`) or, as SFT data, their chosen completions."""
    with resources.as_file(resources.files("ppoforge") / "lm" / "data" / "demo_pairs.jsonl") as path:
        rows = [(line, row) for line, row in read_json_rows(path) if row["split"] == BUILTIN[source]]
    if source.startswith("demo-sft"):
        return [(line, {"prompt": r["prompt"], "completion": r["chosen"]}) for line, r in rows]
    return [(line, {k: v for k, v in r.items() if k != "split"}) for line, r in rows]


def read_rows(source: str, split: str = "train") -> tuple[list[tuple[int, dict]], str]:
    """(line number, row) pairs of a data source and a description of it; JSON files keep their line
    numbers, other sources number their rows from 1. Built-in: demo-pairs[-heldout], demo-sft[-heldout]."""
    if source in BUILTIN:
        return _builtin_rows(source), f"built-in {source}"
    try:
        rows, _, where = read_source(source, split, ALLOWED_SOURCES)
    except UserError as e:
        raise UserError(f"data: {e}") from None
    if not rows:
        raise UserError(f"data: {where} has no rows; allowed: at least one row ({ALLOWED_ROWS})")
    return rows, where


# ---- rendering -------------------------------------------------------------------------------------

def _text(value, name: str) -> str:
    if not isinstance(value, str):
        raise RowError("not_text", f"{name} is {type(value).__name__}, not a string or a list of messages")
    if not value.strip():
        raise RowError("empty", f"{name} is empty")
    return value


def _messages(value, name: str) -> Conversation:
    if not isinstance(value, list) or not value:
        raise RowError("not_messages", f"{name} is not a non-empty list of messages")
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise RowError("bad_message", f"{name} holds {str(m)[:60]!r}; allowed: {{'role': ..., 'content': ...}}")
        if m["role"] not in ROLES:  # a template renders any role: "human" would train as context, silently
            raise RowError("bad_role", f"{name} message {i} has role {m['role'][:30]!r}; allowed: {', '.join(ROLES)}")
    return value


def _conversation(prompt, completion, check: bool = True) -> Conversation:
    """prompt + completion as one conversation (each a string or a list of messages); `check=False`
    takes an empty completion (a sampled one may be)."""
    text = _text if check else (lambda value, name: value)
    head = (_messages(prompt, "prompt") if isinstance(prompt, list)
            else [{"role": "user", "content": text(prompt, "prompt")}])
    tail = (_messages(completion, "completion") if isinstance(completion, list)
            else [{"role": "assistant", "content": text(completion, "completion")}])
    return head + tail


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def render_turns(tokenizer, messages: Conversation) -> Example:
    """The conversation's tokens, with the loss on every assistant turn (see the module docstring)."""
    ids = _encode(tokenizer, tokenizer.apply_chat_template(messages, tokenize=False))
    mask = [0] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _encode(tokenizer, tokenizer.apply_chat_template(messages[:i], tokenize=False,
                                                                  add_generation_prompt=True)) if i else []
        upto = _encode(tokenizer, tokenizer.apply_chat_template(messages[:i + 1], tokenize=False))
        if ids[:len(before)] != before or ids[:len(upto)] != upto:
            raise RowError("template_not_prefix", f"the chat template renders turn {i} differently inside the "
                           "conversation than on its own")
        mask[len(before):len(upto)] = [1] * (len(upto) - len(before))
    if not any(mask):
        raise RowError("no_assistant_turn", "no assistant message to learn")
    return Example(ids, mask)


def render_plain(tokenizer, prompt: str, completion: str) -> Example:
    """A base model's prompt + completion + EOS (no chat template), loss on completion and EOS."""
    head = tokenizer(_text(prompt, "prompt"))["input_ids"]  # BOS where the tokenizer adds one
    tail = _encode(tokenizer, _text(completion, "completion")) + [tokenizer.eos_token_id]
    return Example(head + tail, [0] * len(head) + [1] * len(tail))


def _chars(value) -> int:
    """Characters of a text, or of a message list's contents (what tokenizing them would read)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(len(m.get("content", "")) if isinstance(m, dict) and isinstance(m.get("content"), str) else 0
                   for m in value)
    return 0


def _refuse_huge(max_length: int, *values) -> None:
    """A row longer than max_length tokens can hold (CHARS_PER_TOKEN) is too long before it is tokenized."""
    chars = sum(_chars(v) for v in values)
    if chars > max_length * CHARS_PER_TOKEN:
        raise RowError("too_long", f"{chars} characters, more than max_length {max_length} tokens hold")


def sft_example(row: dict, tokenizer, max_length: int) -> Example:
    _refuse_huge(max_length, row.get("messages"), row.get("prompt"), row.get("completion"))
    if "messages" in row:
        example = render_turns(tokenizer, _messages(row["messages"], "messages"))
    elif "prompt" in row and "completion" in row:
        if tokenizer.chat_template:
            example = render_turns(tokenizer, _conversation(row["prompt"], row["completion"]))
        else:
            example = render_plain(tokenizer, row["prompt"], row["completion"])
    else:
        raise RowError("missing_field", f"fields {sorted(row)}; allowed: messages, or prompt and completion")
    if len(example.ids) > max_length:
        raise RowError("too_long", f"{len(example.ids)} tokens > max_length {max_length}")
    return example


def convert_rows(make, rows: list[tuple[int, dict]], where: str, tokenizer, max_length: int,
                 strict: bool) -> tuple[list, Drops]:
    """make(row, tokenizer, max_length) for every row; the rows it refuses counted in Drops (or, strict,
    the first one raised with its line)."""
    drops, out = Drops(where), []
    for line, row in rows:
        try:
            out.append(make(row, tokenizer, max_length))
        except RowError as e:
            drops.add(line, e, strict)
    return out, drops


def sft_examples(rows: list[tuple[int, dict]], where: str, tokenizer, max_length: int,
                 strict: bool) -> tuple[list[Example], Drops]:
    return convert_rows(sft_example, rows, where, tokenizer, max_length, strict)


# ---- preference pairs ------------------------------------------------------------------------------

def split_prompt(row: dict):
    """(prompt, chosen, rejected): the explicit prompt, or the common prefix of chosen and rejected."""
    if "chosen" not in row or "rejected" not in row:
        raise RowError("missing_field", f"fields {sorted(row)}; allowed: chosen and rejected (and prompt)")
    chosen, rejected = row["chosen"], row["rejected"]
    if chosen == rejected:  # before the prefix split, which would leave two empty completions
        raise RowError("identical", "chosen and rejected are the same")
    if "prompt" in row and row["prompt"] is not None:
        return row["prompt"], chosen, rejected
    if isinstance(chosen, list) and isinstance(rejected, list):
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
            n += 1
        if n == 0:
            raise RowError("no_common_prompt", "chosen and rejected share no first message and no prompt is given")
        return chosen[:n], chosen[n:], rejected[n:]
    chosen, rejected = _text(chosen, "chosen"), _text(rejected, "rejected")
    n = _common_prefix(chosen, rejected)
    if not chosen[:n].strip():
        raise RowError("no_common_prompt", "chosen and rejected share no prefix and no prompt is given")
    return chosen[:n], chosen[n:], rejected[n:]


def _common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    cut = max(a.rfind(" ", 0, n + 1), a.rfind("\n", 0, n + 1))  # back to a word boundary
    return cut + 1 if 0 <= cut < n else n


def reward_input_ids(tokenizer, prompt, completion) -> list[int]:
    """What a reward model reads for (prompt, completion) — in training and when it scores PPO samples
    (`rewards.RewardModelScorer`) alike: the chat template's user/assistant conversation when the
    tokenizer has one; else a text pair ([CLS] prompt [SEP] completion [SEP] for BERT-style encoders)
    for tokenizers that mark pairs, or plain concatenation for causal LMs."""
    if tokenizer.chat_template:
        conversation = _conversation(prompt, completion, check=False)
        return _encode(tokenizer, tokenizer.apply_chat_template(conversation, tokenize=False))
    prompt = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
    completion = completion if isinstance(completion, str) else "\n".join(m["content"] for m in completion)
    if tokenizer.sep_token_id is not None and tokenizer.cls_token_id is not None:
        return tokenizer(prompt, completion)["input_ids"]
    return tokenizer(prompt + completion)["input_ids"]


def _short(value) -> str:
    """A value for a message: a 400-digit margin as its first digits and its length."""
    if isinstance(value, int) and abs(value) > 10 ** 30:
        return f"an integer of {len(str(abs(value)))} digits"
    return f"{value!r:.60}"


def preference_pair(row: dict, tokenizer, max_length: int) -> Pair:
    prompt, chosen, rejected = split_prompt(row)
    _conversation(prompt, chosen), _conversation(prompt, rejected)  # the checks: text, messages, not empty
    _refuse_huge(max_length, prompt, chosen)
    _refuse_huge(max_length, prompt, rejected)
    margin = row.get("margin", 0.0)
    if margin is None:
        margin = 0.0
    if not float32_finite(margin):  # an inf margin (or 1e308: inf as float32) makes every step it is in skipped
        raise RowError("bad_margin", f"margin is {_short(margin)}; allowed: a finite number (within float32's "
                       f"+-{FLOAT32_MAX:.1e})")
    c, r = reward_input_ids(tokenizer, prompt, chosen), reward_input_ids(tokenizer, prompt, rejected)
    if max(len(c), len(r)) > max_length:
        raise RowError("too_long", f"{max(len(c), len(r))} tokens > max_length {max_length}")
    return Pair(c, r, float(margin))


def preference_pairs(rows: list[tuple[int, dict]], where: str, tokenizer, max_length: int,
                     strict: bool) -> tuple[list[Pair], Drops]:
    return convert_rows(preference_pair, rows, where, tokenizer, max_length, strict)
