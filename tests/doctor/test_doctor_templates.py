"""`chat_template`: the doctor's models have prefix-preserving chat templates (lm/envs/chat.py needs one)."""

import importlib.util

import pytest

from ppoforge.doctor.report import OK, SKIP, WARN
from ppoforge.doctor.templates import FIX, check_chat_template, gather_templates
from ppoforge.lm.models import smollm2


def test_the_tiny_lm_and_a_built_smollm2_pass(monkeypatch, tmp_path):
    pytest.importorskip("transformers")
    monkeypatch.setenv("PPOFORGE_CACHE", str(tmp_path))  # SmolLM2 not built here: checked only when it is
    found = gather_templates()
    assert found.pop("tiny Qwen2") == (True, "4 messages render as growing prefixes")
    assert found == ({smollm2.NAME: None} if importlib.util.find_spec(smollm2.PACKAGE) else {})
    result = check_chat_template({"tiny Qwen2": (True, "ok"), smollm2.NAME: None})
    assert (result.status, result.evidence) == (OK, f"tiny Qwen2: prefix-preserving; {smollm2.NAME}: not built "
                                                    "yet, not checked (ppoforge demo builds it)")


def test_smollm2_is_checked_when_built():
    if not (smollm2.cache_dir() / "tokenizer.json").is_file():
        pytest.skip(f"SmolLM2 is not built at {smollm2.cache_dir()} (ppoforge demo builds it)")
    assert gather_templates()[smollm2.NAME] == (True, "4 messages render as growing prefixes")


def test_a_rewriting_template_warns_with_the_fix():
    result = check_chat_template({"tiny Qwen2": (True, "ok"), "qwen3": (False, "adding message 3 re-renders")})
    assert result.status == WARN and result.fix == FIX
    assert result.evidence == ("tiny Qwen2: prefix-preserving; qwen3: not prefix-preserving (adding message 3 "
                               "re-renders)")
    assert check_chat_template(None).status == SKIP
