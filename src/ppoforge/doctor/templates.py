"""Whether the doctor's models have chat templates multi-turn episodes can use (lm/envs/chat.py).

Multi-turn RLHF appends the environment's tokens as a template diff, which needs a prefix-preserving
template: rendering a conversation must not rewrite its earlier turns when messages are added (Qwen3's
template drops `<think>` from earlier assistant turns, so it is not). Checked on the tiny LM's
tokenizer (always: it is built here in ~0.1 s) and on SmolLM2's when its checkpoint is already built
(never built here: that takes ~30 s). Rendering a few messages is the whole cost.
"""

from __future__ import annotations

import importlib.util

from ppoforge.doctor.report import CheckResult, ok, skip, warn

NAME = "chat_template"
FIX = ("multi-turn environments refuse a template that rewrites earlier turns: set tokenizer.chat_template to a "
       "prefix-preserving one (TRL's get_training_chat_template returns one for Qwen3 and other known models)")


def gather_templates() -> dict[str, tuple[bool, str] | None] | None:
    """{model: prefix_preserving(its tokenizer)} for the tiny LM and a built SmolLM2 (None: SmolLM2 is
    installed but not built); None without transformers."""
    try:
        from transformers import PreTrainedTokenizerFast  # optional extra (ppoforge[lm]): no check without it
    except ImportError:
        return None
    # these need transformers too: imported once it is known to be there
    from ppoforge.lm.envs.chat import prefix_preserving
    from ppoforge.lm.models import smollm2
    from ppoforge.lm.models.tiny import tiny_tokenizer

    found: dict[str, tuple[bool, str] | None] = {"tiny Qwen2": prefix_preserving(tiny_tokenizer())}
    if (smollm2.cache_dir() / "tokenizer.json").is_file():
        found[smollm2.NAME] = prefix_preserving(PreTrainedTokenizerFast.from_pretrained(smollm2.cache_dir()))
    elif importlib.util.find_spec(smollm2.PACKAGE) is not None:
        found[smollm2.NAME] = None  # installed, not built: not checked
    return found


def _line(model: str, result: tuple[bool, str] | None) -> str:
    if result is None:
        return f"{model}: not built yet, not checked (ppoforge demo builds it)"
    good, why = result
    return f"{model}: prefix-preserving" if good else f"{model}: not prefix-preserving ({why})"


def check_chat_template(found: dict[str, tuple[bool, str] | None] | None) -> CheckResult:
    if found is None:
        return skip(NAME, "transformers not installed (libraries_lm says how to install it)")
    evidence = "; ".join(_line(model, result) for model, result in found.items())
    bad = [model for model, result in found.items() if result is not None and not result[0]]
    return warn(NAME, evidence, FIX) if bad else ok(NAME, evidence)
