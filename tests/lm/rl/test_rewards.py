"""Reward functions: built-ins on hand values, validation of every bad return, spec parsing, user
Python rewards, and a tiny reward model whose scores do not depend on batching or padding."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from ppoforge.errors import UserError
from ppoforge.lm.rl.rewards import (
    RewardModelScorer,
    WeightedSum,
    build_reward,
    format_reward,
    length_reward,
    missing_eos_penalty,
    score,
    split_spec,
    vader_sentiment,
)

P2 = ["p1", "p2"]


# ---- built-ins -----------------------------------------------------------------------------------

def error_lines(err: str) -> list[str]:
    """stderr less the informational line about prompts cut to max_prompt_tokens (these runs cut the demo
    prompts to 16 tokens on purpose, to stay small): what is left must be the one error line."""
    return [line for line in err.splitlines() if "prompts are longer than max_prompt_tokens" not in line]



def test_vader_signs_and_range():
    completions = ["What a great, wonderful day!", "This is terrible and awful.", "The table."]
    out = vader_sentiment(["a"] * 3, completions)
    assert out[0] > 0.5 and out[1] < -0.5 and out[2] == 0.0
    assert all(-1 <= v <= 1 for v in out)


def test_length_reward_by_hand():
    # target 4: 4 words -> 0; 2 words -> -|2-4|/4 = -0.5; 8 words -> -|8-4|/4 = -1; 0 words -> -1
    out = length_reward(4)(["p"] * 4, ["a b c d", "a b", "a b c d e f g h", ""])
    assert out == [0.0, -0.5, -1.0, -1.0]
    with pytest.raises(UserError, match=r"length:0: target out of range; allowed: an integer >= 1"):
        length_reward(0)


def test_format_reward_search_and_bad_regex():
    assert format_reward(r"^yes\b")(P2, ["yes indeed", "well, yes"]) == [1.0, 0.0]
    with pytest.raises(UserError, match=r"reward format:\(: invalid regular expression"):
        format_reward("(")


def test_missing_eos_penalty():
    assert missing_eos_penalty(0.5)(P2, ["a", "b"], finished=[True, False]) == [0.0, -0.5]


# ---- score: validation ---------------------------------------------------------------------------


def test_score_returns_float32_and_passes_columns():
    seen = {}

    def fn(prompts, completions, **kwargs):
        seen.update(kwargs)
        return [1, 2.5]

    rows = [{"prompt": "p1", "answer": "x"}, {"prompt": "p2", "answer": "y"}]
    out = score(fn, "mine", P2, ["c1", "c2"], [True, False], rows)
    assert out.dtype == torch.float32 and out.tolist() == [1.0, 2.5]
    assert seen == {"prompt": ["p1", "p2"], "answer": ["x", "y"], "finished": [True, False]}


def test_score_row_columns_never_clash_with_arguments():
    rows = [{"prompt": "p", "completions": "oops", "finished": "oops"}]
    def fn(prompts, completions, finished, **kwargs):
        return [float(finished[0])]

    out = score(fn, "f", ["p"], ["c"], [True], rows)
    assert out.tolist() == [1.0]


def test_reward_that_raises():
    def boom(prompts, completions, **kwargs):
        raise ValueError("boom\nsecond line")

    with pytest.raises(UserError, match=r"^reward bad raised ValueError: boom$"):
        score(boom, "bad", P2, ["a", "b"], [True, True], [{}, {}])


def test_reward_without_kwargs_is_reported_not_crashed():
    with pytest.raises(UserError, match=r"^reward strict raised TypeError: .*finished"):
        score(lambda prompts, completions: [0.0, 0.0], "strict", P2, ["a", "b"], [True, True], [{}, {}])


@pytest.mark.parametrize("returned, message", [
    ({"a": 1}, r"returned dict \{'a': 1\}; allowed: a list of 2 numbers, one per completion$"),
    (torch.zeros(2), r"returned Tensor tensor\(\[0\., 0\.\]\); allowed: a list of 2"),
    (0.5, r"returned float 0\.5; allowed"),
    ([1.0], r"returned 1 values for 2 completions; allowed: a list of 2 numbers"),
    ([1.0, "2"], r"returned str '2' at index 1; allowed"),
    ([1.0, None], r"returned NoneType None at index 1; allowed"),
    ([1.0, torch.tensor(2.0)], r"returned Tensor tensor\(2\.\) at index 1; allowed"),
    # float(10**400) raises OverflowError: it was reported as the reward's own "raised OverflowError"
    ([1.0, 10**400], r"returned a number too large for float \(an integer of 401 digits\) at index 1; "
                     r"allowed: finite numbers$"),
    ([-(10**5000), 1.0], r"returned a number too large for float at index 0; allowed: finite numbers$"),
])
def test_bad_return_values(returned, message):
    with pytest.raises(UserError, match=r"^reward mine " + message):
        score(lambda prompts, completions, **kw: returned, "mine", P2, ["a", "b"], [True, True], [{}, {}])


def test_non_finite_rewards_pass_to_the_trainers_guard():
    out = score(lambda prompts, completions, **kw: [math.nan, -math.inf], "mine", P2, ["a", "b"], [True] * 2, [{}] * 2)
    assert torch.isnan(out[0]) and out[1] == -math.inf


def test_tuple_and_numpy_scalars_are_fine():
    np = pytest.importorskip("numpy")
    returned = (np.float64(0.5), np.int64(2))
    out = score(lambda p, c, **kw: returned, "np", P2, ["a", "b"], [True, True], [{}, {}])
    assert out.tolist() == [0.5, 2.0]


# ---- WeightedSum and build_reward ------------------------------------------------------------------


def test_weighted_sum_by_hand():
    total = WeightedSum([("len", length_reward(2), 2.0), ("eos", missing_eos_penalty(1.0), 0.5)])
    kw = {"finished": [True, False]}
    assert total.term_values(P2, ["a b", "a"], **kw) == {"len": [0.0, -0.5], "eos": [0.0, -1.0]}
    # row 0: 2*0 + 0.5*0 = 0; row 1: 2*(-0.5) + 0.5*(-1) = -1.5
    assert total(P2, ["a b", "a"], **kw) == [0.0, -1.5]


def test_weighted_sum_names_the_failing_term():
    total = WeightedSum([("ok", lambda p, c, **kw: [0.0, 0.0], 1.0),
                         ("text", lambda p, c, **kw: [0.0, "1"], 1.0)])
    with pytest.raises(UserError, match=r"^reward text returned str '1' at index 1"):
        score(total, "total", P2, ["a", "b"], [True, True], [{}, {}])


def test_build_reward_spec_and_weights_by_hand():
    fn = build_reward("length:2, eos_penalty:1", weights="2,0.5")
    assert [name for name, _, _ in fn.terms] == ["length:2", "eos_penalty:1"]
    assert score(fn, "r", P2, ["a b", "a"], [True, False], [{}, {}]).tolist() == [0.0, -1.5]
    assert build_reward("vader")(["p"], ["I love it, it is wonderful!"], finished=[True])[0] > 0.5


def test_split_spec_keeps_commas_inside_regex():
    assert split_spec("format:^a{1,3}b$,vader, length:20") == ["format:^a{1,3}b$", "vader", "length:20"]
    fn = build_reward("format:^a{1,3}$,vader")
    assert score(fn, "r", P2, ["aa", "aaaa"], [True] * 2, [{}] * 2).tolist() == [1.0, 0.0]


@pytest.mark.parametrize("spec", ["sentiment", "vader2", "length", "format:", "model:", "py:", "",
                                  "vader,,length:3"])
def test_unknown_item_lists_allowed_forms(spec):
    with pytest.raises(UserError, match=r"^reward: unknown item .*; allowed: vader, length:N, format:REGEX, "
                                        r"eos_penalty:X, model:PATH, task \(with prompts task:NAME\), "
                                        r"py:module\.path:function or "
                                        r"py:/path/file\.py:function \(comma-separated\)$"):
        build_reward(spec)


def test_duplicate_term_is_refused():
    with pytest.raises(UserError, match=r"^reward: vader appears more than once; allowed: each reward once"):
        build_reward("vader,length:3,vader")


def test_bad_numbers_and_weights():
    with pytest.raises(UserError, match=r"^reward length:abc: 'abc' is not an integer; allowed: an integer, e\.g\. "
                                        r"length:4$"):
        build_reward("length:abc")
    with pytest.raises(UserError, match=r"^reward eos_penalty:nan: 'nan' is not a finite number; allowed: a finite "
                                        r"number, e\.g\. eos_penalty:0\.5$"):
        build_reward("eos_penalty:nan")
    with pytest.raises(UserError, match=r"^reward weights: 1 weights for 2 rewards \(vader, length:3\); "):
        build_reward("vader,length:3", weights="1")
    with pytest.raises(UserError, match=r"^reward weights: 'x' is not a finite number; allowed: a finite number, "
                                        r"e\.g\. 1,0\.5 "):
        build_reward("vader", weights="x")


# ---- user Python rewards ---------------------------------------------------------------------------


def test_py_module_and_file(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(
        "def shout(prompts, completions, **kwargs):\n    return [float(c.isupper()) for c in completions]\n")
    monkeypatch.chdir(tmp_path)  # modules are found from the current directory, like `python -m`
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    by_module = build_reward("py:my_rewards_mod:shout")
    by_file = build_reward(f"py:{tmp_path / 'my_rewards_mod.py'}:shout")
    for fn in (by_module, by_file):
        assert fn(P2, ["HEY", "hey"], finished=[True, True]) == [1.0, 0.0]


def test_py_errors(tmp_path):
    (tmp_path / "broken.py").write_text("import no_such_module_xyz\n")
    (tmp_path / "fine.py").write_text("x = 1\n")
    with pytest.raises(UserError, match=r"^reward py:.*broken\.py:f: importing .*broken\.py raised "
                                        r"ModuleNotFoundError: No module named 'no_such_module_xyz'$"):
        build_reward(f"py:{tmp_path / 'broken.py'}:f")
    with pytest.raises(UserError, match=r"fine\.py has no function 'f'$"):
        build_reward(f"py:{tmp_path / 'fine.py'}:f")
    with pytest.raises(UserError, match=r"fine\.py has no function 'x'$"):  # not callable
        build_reward(f"py:{tmp_path / 'fine.py'}:x")
    with pytest.raises(UserError, match=r"no file .*missing\.py$"):
        build_reward(f"py:{tmp_path / 'missing.py'}:f")
    with pytest.raises(UserError, match=r"importing no_such_pkg_xyz\.mod raised ModuleNotFoundError"):
        build_reward("py:no_such_pkg_xyz.mod:f")
    with pytest.raises(UserError, match=r"expected py:module\.path:function"):
        build_reward("py:justamodule")


# ---- reward models ---------------------------------------------------------------------------------


def test_reward_model_scores_do_not_depend_on_batching(tiny_reward_model_dir):
    prompts = ["Write one sentence about rain.", "Hi", "Tell me a story about a city at night, please."]
    completions = ["It was a great day.", "Terrible.", "ok"]
    one = RewardModelScorer(str(tiny_reward_model_dir), batch_size=1)(prompts, completions, finished=[True])
    three = RewardModelScorer(str(tiny_reward_model_dir), batch_size=3)(prompts, completions)
    assert len(one) == 3 and all(math.isfinite(v) for v in one) and len(set(one)) == 3
    torch.testing.assert_close(torch.tensor(three), torch.tensor(one), rtol=1e-4, atol=1e-5)


def test_a_groups_texts_are_scored_in_one_row_with_their_prompt_once(tiny_reward_model_dir, monkeypatch):
    """`share_prefix`: a causal reward model scores a GRPO group's completions of one long prompt as one
    row (the prompt once, `branch_rows`); the scores are those of padded rows, to fp32 rounding."""
    from ppoforge.lm.models import rows

    prompt = "you are a good assistant . you write one very nice sentence about this and that . tell a story"
    prompts = [prompt] * 4 + ["describe the city at night"] * 4
    completions = ["it was a great day .", "no", "the rain", "ok", "bad", "the city is beautiful .", "fine", "yes"]
    plain = RewardModelScorer(str(tiny_reward_model_dir), batch_size=4)
    shared = RewardModelScorer(str(tiny_reward_model_dir), batch_size=4, share_prefix=True)
    built = []
    monkeypatch.setattr("ppoforge.lm.rl.rewards.branch_rows", lambda groups, *a: built.append(len(groups)) or
                        rows.branch_rows(groups, *a))
    assert plain.group_size(plain.input_ids(prompts, completions)) == 1
    assert shared.group_size(shared.input_ids(prompts, completions)) == 4
    want, got = plain(prompts, completions), shared(prompts, completions)
    assert built == [1, 1]  # one row per batch: the four texts of one prompt
    assert len(set(want)) == 8
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_absolute_position_reward_models_score_a_text_as_they_would_alone(tmp_path, tiny_model, arch):
    """GPT-2 and BERT add absolute position embeddings (BERT also pools its first token): a text batched
    beside a longer one must get the positions, and so the score, it gets alone."""
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        GPT2Config,
        GPT2ForSequenceClassification,
        PreTrainedTokenizerFast,
    )

    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_model)
    tokenizer.chat_template = None  # plain concatenation: the texts differ only in length
    tokenizer.save_pretrained(tmp_path)
    size = dict(vocab_size=len(tokenizer), num_labels=1, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    if arch == "gpt2":
        model = GPT2ForSequenceClassification(GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=64, **size))
    else:
        model = BertForSequenceClassification(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                         intermediate_size=64, max_position_embeddings=64, **size))
    model.save_pretrained(tmp_path)
    prompts, completions = ["Hi", "Tell me a story about a city at night, please."], ["ok", "It was a great day."]
    scorer = RewardModelScorer(str(tmp_path), batch_size=2)
    together = scorer(prompts, completions)
    alone = [scorer(prompts[i:i + 1], completions[i:i + 1])[0] for i in range(2)]
    torch.testing.assert_close(torch.tensor(together), torch.tensor(alone), rtol=1e-5, atol=1e-6)
    assert scorer.tokenizer.padding_side == "left"  # shared with the policy: left as it was


def test_reward_model_renders_chat_template(tiny_reward_model_dir):
    scorer = RewardModelScorer(str(tiny_reward_model_dir))
    [ids] = scorer.input_ids(["Hi"], ["Hello!"])
    assert scorer.tokenizer.decode(ids) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
    assert scorer.input_ids(["Hi"], [""])  # a sampled completion may be empty


def test_model_spec(tiny_reward_model_dir):
    fn = build_reward(f"model:{tiny_reward_model_dir},eos_penalty:1")
    out = score(fn, "r", P2, ["good", "bad"], [True, False], [{}, {}])
    assert out.shape == (2,) and torch.isfinite(out).all()
    with pytest.raises(UserError, match=r"^model: no model at /no/such/rm; allowed: "):
        build_reward("model:/no/such/rm")


def test_reward_model_loads_in_the_requested_dtype_and_attention(tiny_reward_model_dir):
    fn = build_reward(f"model:{tiny_reward_model_dir}", dtype=torch.bfloat16, attn_implementation="eager")
    scorer = fn.terms[0][1]
    assert next(scorer.model.parameters()).dtype == torch.bfloat16
    assert scorer.model.config._attn_implementation == "eager"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = score(fn, "r", P2, ["good", "bad"], [True, True], [{}, {}])
    assert torch.isfinite(out).all()


# ---- user code that ends the process or hangs, in a real training run -----------------------------------

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """The doctor's tiny LM (lm/models/tiny.py): a chat template, and no fast-path warning on stderr."""
    from ppoforge.lm.models.tiny import save_tiny_lm

    return save_tiny_lm(tmp_path_factory.mktemp("tiny") / "model")


RUN_REWARD = '''
import os, sys, time
if os.environ["REWARD_MODE"] == "exit_at_import":
    sys.exit(3)
if os.environ["REWARD_MODE"] == "hang_at_import":
    time.sleep(3600)
calls = []

def reward(prompts, completions, **kwargs):
    calls.append(1)
    if len(calls) == 3 and os.environ["REWARD_MODE"] == "exit":
        sys.exit(0)
    return [float(len(c)) for c in completions]
'''


def _reward_run(tmp_path, tiny_model, mode: str, *extra: str):
    """`ppoforge train rlhf --reward py:FILE:reward` for 4 updates in a subprocess: (code, stdout, stderr)."""
    import os
    import subprocess

    (tmp_path / "run_reward.py").write_text(RUN_REWARD)
    argv = [sys.executable, "-m", "ppoforge", "train", "rlhf", "--model", str(tiny_model), "--prompts", "demo",
            "--heldout-prompts", "none", "--reward", f"py:{tmp_path / 'run_reward.py'}:reward", "--batch-size", "2",
            "--mini-batch-size", "2", "--micro-batch-size", "2", "--max-new-tokens", "3", "--max-prompt-tokens",
            "16", "--ppo-epochs", "1", "--lora-r", "2", "--progress", "false", "--tensorboard", "false",
            "--checkpoint-every", "100", "--device", "cpu", "--torch-threads", "1", "--total-updates", "4",
            "--run-dir", str(tmp_path / "run"), *extra]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**os.environ, "REWARD_MODE": mode})
    return proc.returncode, proc.stdout, proc.stderr.strip()


def test_sys_exit_0_in_a_reward_is_its_failure_not_a_success(tmp_path, tiny_model):
    code, out, err = _reward_run(tmp_path, tiny_model, "exit")
    assert code == 2 and len(error_lines(err)) == 1, (out, err)
    assert f"reward py:{tmp_path / 'run_reward.py'}:reward raised SystemExit: 0" in err
    assert "checkpoint at update 2" in err
    assert torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["update"] == 2


def test_sys_exit_at_import_of_a_reward_module_is_one_line(tmp_path, tiny_model):
    code, out, err = _reward_run(tmp_path, tiny_model, "exit_at_import")
    assert code == 2 and len(error_lines(err)) == 1, (out, err)
    assert f"importing {tmp_path / 'run_reward.py'} raised SystemExit: 3" in err
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())  # before anything is written


def test_a_reward_module_whose_import_hangs_times_out(tmp_path, tiny_model):
    code, out, err = _reward_run(tmp_path, tiny_model, "hang_at_import", "--call-timeout", "2")
    assert code == 1 and len(error_lines(err)) == 1, (out, err)
    assert f"importing {tmp_path / 'run_reward.py'} did not return within 2 s (call_timeout)" in err


@pytest.mark.parametrize("spec", ["length:abc", "eos_penalty:nan", "format:("])
def test_a_bad_number_or_pattern_in_a_reward_spec_says_what_is_allowed(spec):
    from ppoforge.lm.rl.rewards import build_reward

    with pytest.raises(UserError, match=r"; allowed: "):
        build_reward(spec)
