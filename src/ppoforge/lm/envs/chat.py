"""Token-in/token-out chat rendering for multi-turn episodes: the policy's tokens are never re-encoded.

A multi-turn trajectory is prompt ids + the policy's sampled ids + environment ids + the policy's ids +
... Re-encoding the decoded conversation each turn would train on tokens the policy never sampled (a
BPE merges " 4" and "2" into " 42" that the policy emitted as two tokens) and would change the
log-probs PPO's ratio compares. So the environment's tokens are the chat template's *diff* (what TRL's
multi-turn tool loop does since its issue #5224, `_get_tool_suffix_ids`):

1. the part of the template's closing of an assistant turn that the policy did not sample (ChatML
   closes with `<|im_end|>\n`: after a policy that stopped on `<|im_end|>` only `\n`; after one that ran
   out of tokens the whole closing), then
2. ids(render(conversation + new, add_generation_prompt=True)) minus ids(render(conversation)): the new
   messages and the next generation prompt. The shorter render must be a token prefix of the longer
   one; a template that rewrites earlier turns (Qwen3 drops `<think>` from all but the last assistant
   turn) is refused with a one-line error — `prefix_preserving` tells before a run starts (the doctor's
   `chat_template` check).

`check_episode` compares a finished trajectory with the template's own tokens of the whole
conversation: equal unless the policy's text tokenizes differently from how it was sampled (or a
template trims or rewrites content). `end_check` says what a difference does: "strict" raises,
"warn" returns its description and counts it in `mismatches`, "off" skips the render.
"""

from __future__ import annotations

from ppoforge.errors import UserError

END_CHECKS = ("strict", "warn", "off")
_SENTINEL = "\u2063ppoforge-reply\u2063"  # content no template rewrites, found again in the render
_PROBE = [{"role": "user", "content": "Pick a number."},
          {"role": "assistant", "content": "<think>\nSmall.\n</think>\n\n3"},
          {"role": "user", "content": "Another one."},
          {"role": "assistant", "content": "<think>\nBigger.\n</think>\n\n7"}]


def _render(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


class ChatRenderer:
    def __init__(self, tokenizer, end_check: str = "warn"):
        if end_check not in END_CHECKS:
            raise UserError(f"end_check: {end_check!r} is not allowed; allowed: {', '.join(END_CHECKS)}")
        if not getattr(tokenizer, "chat_template", None):
            raise UserError("multi-turn episodes need a chat template; the tokenizer has none (allowed: a chat "
                            "model, or set tokenizer.chat_template)")
        self.tokenizer, self.end_check = tokenizer, end_check
        self.mismatches = 0

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The template's tokens of `messages` followed by the generation prompt (the first turn)."""
        return self._ids(_render(self.tokenizer, messages, True))

    def closing_ids(self, conversation: list[dict]) -> list[int]:
        """The tokens the template puts after the content of the conversation's last (assistant) turn."""
        text = _render(self.tokenizer, [*conversation[:-1], {"role": "assistant", "content": _SENTINEL}], False)
        at = text.rfind(_SENTINEL)
        if at < 0:
            raise UserError("the chat template does not render an assistant turn's content as it is; allowed: "
                            "a template that writes message content unchanged")
        return self._ids(text[at + len(_SENTINEL):])

    def env_ids(self, conversation: list[dict], policy_ids: list[int], finished: bool,
                new_messages: list[dict]) -> list[int]:
        """The tokens to append after `policy_ids` (this turn's sampled tokens, whose decoded text is
        `conversation[-1]`): the rest of the assistant turn's closing, then the new messages and the next
        generation prompt (the module docstring has the rule)."""
        if not conversation or conversation[-1].get("role") != "assistant":
            raise ValueError("env_ids: the conversation must end with the assistant's reply")
        closing = self.closing_ids(conversation)
        sampled = _overlap(policy_ids, closing) if finished else 0
        before = self._ids(_render(self.tokenizer, conversation, False))
        after = self._ids(_render(self.tokenizer, [*conversation, *new_messages], True))
        if after[:len(before)] != before:
            at = _first_difference(before, after)
            raise UserError(f"the chat template is not prefix-preserving: adding {len(new_messages)} message(s) "
                            f"re-renders the conversation from token {at} on ({self._show(before, at)} becomes "
                            f"{self._show(after, at)}); fix: a template that renders earlier turns the same way "
                            "whatever follows (ppoforge doctor names it; TRL's get_training_chat_template)")
        return closing[sampled:] + after[len(before):]

    def check_episode(self, conversation: list[dict], trajectory_ids: list[int]) -> str | None:
        """None when `trajectory_ids` equals the template's tokens of `conversation` (its final assistant
        turn's closing may be missing from the trajectory, or only partly there), else the first difference
        as one line — raised as a UserError under end_check "strict", counted under "warn"."""
        if self.end_check == "off":
            return None
        expected = self._ids(_render(self.tokenizer, conversation, False))
        tail = self.closing_ids(conversation) if conversation and conversation[-1]["role"] == "assistant" else []
        missing = next((k for k in range(len(tail) + 1) if trajectory_ids + tail[k:] == expected), None)
        if missing is not None:
            return None
        at = _first_difference(trajectory_ids, expected)
        problem = (f"episode tokens differ from the chat template's at token {at} of {len(expected)}: trajectory "
                   f"{self._show(trajectory_ids, at)}, template {self._show(expected, at)}")
        self.mismatches += 1
        if self.end_check == "strict":
            raise UserError(f"{problem}; allowed under end_check strict: none (end_check warn counts them)")
        return problem

    def _show(self, ids: list[int], at: int) -> str:
        return repr(self.tokenizer.convert_ids_to_tokens(ids[at])) if at < len(ids) else "(end)"


def _overlap(ids: list[int], closing: list[int]) -> int:
    """The longest k with ids[-k:] == closing[:k]: how much of the closing the policy sampled."""
    return next((k for k in range(min(len(ids), len(closing)), 0, -1) if ids[-k:] == closing[:k]), 0)


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def prefix_preserving(tokenizer) -> tuple[bool, str]:
    """(True, evidence) when rendering user, assistant, user, assistant one message at a time gives
    renders that each start with the one before, in text and in tokens; else (False, what differs).
    The assistant turns hold `<think>` blocks, so templates that strip reasoning from earlier turns
    (Qwen3) fail here."""
    if not getattr(tokenizer, "chat_template", None):
        return False, "the tokenizer has no chat template"
    texts = [_render(tokenizer, _PROBE[:k], _PROBE[k - 1]["role"] == "user") for k in range(1, len(_PROBE) + 1)]
    for k in range(1, len(texts)):
        shorter, longer = texts[k - 1], texts[k]
        if not longer.startswith(shorter):
            at = next((i for i, (x, y) in enumerate(zip(shorter, longer, strict=False)) if x != y), len(shorter))
            return False, (f"adding message {k + 1} ({_PROBE[k]['role']}) re-renders the earlier turns from "
                           f"character {at}: {shorter[at:at + 24]!r} becomes {longer[at:at + 24]!r}")
        short_ids = tokenizer(shorter, add_special_tokens=False)["input_ids"]
        long_ids = tokenizer(longer, add_special_tokens=False)["input_ids"]
        if long_ids[:len(short_ids)] != short_ids:
            return False, (f"adding message {k + 1} keeps the text but re-tokenizes the boundary at token "
                           f"{_first_difference(short_ids, long_ids)}")
    return True, f"{len(_PROBE)} messages render as growing prefixes"
