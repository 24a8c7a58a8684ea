"""Token-in/token-out rendering (lm/envs/chat.py): environment tokens by template diff, the end-of-episode
check, and the prefix-preserving probe, on the tiny ChatML tokenizer, SmolLM2's and a Qwen3-style one."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from ppoforge.errors import UserError
from ppoforge.lm.envs.chat import ChatRenderer, prefix_preserving
from ppoforge.lm.envs.loading import load_env
from ppoforge.lm.models import smollm2
from ppoforge.lm.models.tiny import tiny_tokenizer

# Qwen3's rule, cut down: assistant turns before the last user message lose their <think> block.
QWEN3_STYLE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- set content = m.content %}"
    "{%- if m.role == 'assistant' and loop.index0 < ns.last_user and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
EPISODE = [("I am thinking of a number from 1 to 8 . Guess it", "the number is 4", "Higher ."),
           ("Higher ?", "then it is 6", "Lower ."),
           ("Lower ?", "so it is 5", None)]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def smol_tok():
    """SmolLM2's real tokenizer, when the built-in checkpoint is already cached (building it takes ~30 s)."""
    if not (smollm2.cache_dir() / "tokenizer_config.json").is_file():
        pytest.skip(f"SmolLM2 is not cached at {smollm2.cache_dir()} (ppoforge demo builds it)")
    from transformers import PreTrainedTokenizerFast  # not Auto: transformers 4 cannot read 5's tokenizer class

    return PreTrainedTokenizerFast.from_pretrained(smollm2.cache_dir())


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _template_ids(tok, messages, generation_prompt=False):
    return _ids(tok, tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt))


def _play(renderer, tok, finished=(True, True, True), sample=None):
    """Run EPISODE through the renderer; the policy's ids are the template's own tokens of each reply
    (or `sample(reply)`), plus the stop token when that turn `finished`. -> (conversation, trajectory)."""
    conversation = [{"role": "user", "content": EPISODE[0][0]}]
    trajectory = renderer.prompt_ids(conversation)
    for (_, reply, answer), done in zip(EPISODE, finished, strict=True):
        before = _template_ids(tok, conversation, generation_prompt=True)
        conversation.append({"role": "assistant", "content": reply})
        own = _template_ids(tok, conversation)[len(before):]  # content + <|im_end|> + \n, as the template has it
        policy = (sample(reply) if sample else own[:own.index(tok.eos_token_id)]) + [tok.eos_token_id] * done
        trajectory += policy
        if answer is None:
            break
        new = [{"role": "user", "content": answer}]
        trajectory += renderer.env_ids(conversation, policy, done, new)
        conversation += new
    return conversation, trajectory


@pytest.mark.parametrize("tokenizer", ["tok", "smol_tok"])
def test_policy_and_env_ids_rebuild_the_template_render_of_a_three_turn_episode(tokenizer, request):
    tok = request.getfixturevalue(tokenizer)
    renderer = ChatRenderer(tok, end_check="strict")
    conversation, trajectory = _play(renderer, tok)
    full = _template_ids(tok, conversation)
    # the trajectory ends on the last reply's <|im_end|>; the template closes that turn with one more "\n"
    assert trajectory + _ids(tok, "\n") == full
    assert renderer.check_episode(conversation, trajectory) is None


def test_a_turn_cut_by_the_length_limit_gets_the_whole_closing(tok):
    renderer = ChatRenderer(tok, end_check="strict")
    conversation = [{"role": "user", "content": "Guess"}, {"role": "assistant", "content": "the"}]
    policy = _ids(tok, "the")
    new = [{"role": "user", "content": "Higher ."}]
    stopped = renderer.env_ids(conversation, policy + [tok.eos_token_id], True, new)
    cut = renderer.env_ids(conversation, policy, False, new)
    assert tok.convert_ids_to_tokens(stopped[:2]) == ["Ċ", "<|im_start|>"]  # only the "\n" was missing
    assert cut == [tok.eos_token_id] + stopped  # the template closes the turn the policy did not
    conversation, trajectory = _play(renderer, tok, finished=(False, True, False))
    assert trajectory + _ids(tok, "<|im_end|>\n") == _template_ids(tok, conversation)
    assert renderer.check_episode(conversation, trajectory) is None


def test_a_reply_tokenized_unlike_the_template_is_caught_at_the_end(tok):
    def by_characters(reply):  # the same text, one token per character: what re-encoding would hide
        return [i for ch in reply for i in _ids(tok, ch)]

    assert by_characters("the number is 4") != _ids(tok, "the number is 4")
    warn = ChatRenderer(tok, end_check="warn")
    conversation, trajectory = _play(warn, tok, sample=by_characters)
    assert tok.decode(trajectory) == tok.apply_chat_template(conversation, tokenize=False).removesuffix("\n")
    problem = warn.check_episode(conversation, trajectory)
    sampled, template = by_characters("the number is 4"), _ids(tok, "the number is 4")
    first = next(i for i, (a, b) in enumerate(zip(sampled, template, strict=False)) if a != b)
    at, full = len(warn.prompt_ids(conversation[:1])) + first, _template_ids(tok, conversation)
    show = tok.convert_ids_to_tokens
    assert problem == (f"episode tokens differ from the chat template's at token {at} of {len(full)}: trajectory "
                       f"{show(trajectory[at])!r}, template {show(full[at])!r}")
    assert warn.mismatches == 1
    with pytest.raises(UserError, match=f"at token {at} .*end_check strict"):
        ChatRenderer(tok, end_check="strict").check_episode(conversation, trajectory)
    assert ChatRenderer(tok, end_check="off").check_episode(conversation, trajectory) is None


@pytest.mark.parametrize("tokenizer", ["tok", "smol_tok"])
def test_chatml_templates_are_prefix_preserving(tokenizer, request):
    assert prefix_preserving(request.getfixturevalue(tokenizer)) == (True, "4 messages render as growing prefixes")


def test_a_template_that_rewrites_earlier_turns_is_refused(tok):
    qwen3 = tiny_tokenizer()
    qwen3.chat_template = QWEN3_STYLE
    ok, reason = prefix_preserving(qwen3)
    assert not ok and reason.startswith("adding message 3 (user) re-renders the earlier turns from character")
    assert "'<think>" in reason
    renderer = ChatRenderer(qwen3)
    conversation = [{"role": "user", "content": "Guess"}, {"role": "assistant", "content": "<think>\nx\n</think>\n\n4"}]
    with pytest.raises(UserError, match=r"^the chat template is not prefix-preserving: adding 1 message\(s\)"):
        renderer.env_ids(conversation, _ids(qwen3, "4") + [qwen3.eos_token_id], True,
                         [{"role": "user", "content": "Higher ."}])


def test_no_template_and_bad_end_check_are_one_line_errors(tok):
    bare = tiny_tokenizer()
    bare.chat_template = None
    assert prefix_preserving(bare) == (False, "the tokenizer has no chat template")
    with pytest.raises(UserError, match="need a chat template"):
        ChatRenderer(bare)
    with pytest.raises(UserError, match="end_check: 'loud' is not allowed; allowed: strict, warn, off"):
        ChatRenderer(tok, end_check="loud")


def test_a_trl_tool_episode_renders_token_in_token_out(tok):
    env = load_env(f"trl:{Path(__file__).parent / 'test_protocol.py'}:Counter")()
    renderer = ChatRenderer(tok, end_check="strict")
    conversation = env.reset({"prompt": "Count for me.", "target": 2}, random.Random(0))
    trajectory = renderer.prompt_ids(conversation)
    for reply in ('<tool_call>\n{"name": "increment", "arguments": {"step": 2}}\n</tool_call>', "Done: 2."):
        policy = _ids(tok, reply) + [tok.eos_token_id]
        trajectory += policy
        conversation.append({"role": "assistant", "content": reply})
        step = env.step(reply)
        if step.done:
            break
        trajectory += renderer.env_ids(conversation, policy, True, step.messages)
        conversation += step.messages
    assert conversation[3] == {"role": "tool", "name": "increment", "content": "2"} and env.score() == 1.0
    assert renderer.check_episode(conversation, trajectory) is None
    assert tok.decode(trajectory).endswith('<|im_start|>tool\n2<|im_end|>\n<|im_start|>assistant\nDone: 2.<|im_end|>')
