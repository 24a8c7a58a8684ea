"""reasoning-gym tasks as prompts (`task:NAME?KEY=VALUE`) and reward (`task`): the rows carry what the
dataset's checker needs, the checker scores right and wrong answers, errors are one line, GRPO trains."""

import importlib.util
import sys

import pytest

from ppoforge.cli import main
from ppoforge.errors import UserError
from ppoforge.lm.data.prompts import load_prompts
from ppoforge.lm.data.tasks import parse_task
from ppoforge.lm.rl.rewards import build_reward, score

# an optional dependency (ppoforge[tasks]): the tests need it, except the missing-library one
needs_reasoning_gym = pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None,
                                reason="reasoning-gym is not installed (pip install 'ppoforge[tasks]')")


def test_spec_values_are_yaml_and_size_and_seed_default():
    assert parse_task("task:leg_counting?min_animals=2&name=x&p=0.5&flag=true") == (
        "leg_counting", {"size": 500, "seed": 1, "min_animals": 2, "name": "x", "p": 0.5, "flag": True})
    assert parse_task("task:chain_sum?size=8") == ("chain_sum", {"size": 8, "seed": 1})


@needs_reasoning_gym
def test_task_rows_are_seeded_problems_with_their_answers():
    rows = load_prompts("task:leg_counting?size=3&seed=2&min_animals=2&max_animals=3")
    assert len(rows) == 3 and {"prompt", "question", "answer", "metadata"} <= set(rows[0])
    assert all(r["prompt"].endswith(r["question"]) and "<answer>" in r["prompt"] for r in rows)
    assert all(2 <= len(r["metadata"]["animals"]) <= 3 for r in rows)  # the dataset's own config key
    assert rows == load_prompts("task:leg_counting?size=3&seed=2&min_animals=2&max_animals=3")
    assert rows != load_prompts("task:leg_counting?size=3&seed=3&min_animals=2&max_animals=3")


@needs_reasoning_gym
def test_instruction_is_a_named_system_prompt_or_the_text_as_written():
    import reasoning_gym.utils

    named = load_prompts("task:chain_sum?size=2&instruction=direct")
    text = load_prompts("task:chain_sum?size=2&instruction=Example: 2 %2B 3 = <answer>5</answer>%0ANow you.")
    default = load_prompts("task:chain_sum?size=2")
    assert [r["prompt"] for r in named] == [f"{reasoning_gym.utils.SYSTEM_PROMPTS['direct']}\n{r['question']}"
                                            for r in default]
    assert [r["prompt"] for r in text] == [f"Example: 2 + 3 = <answer>5</answer>\nNow you.\n{r['question']}"
                                           for r in default]  # not YAML: "Example: ..." stays text
    assert [r["answer"] for r in named] == [r["answer"] for r in text] == [r["answer"] for r in default]


@needs_reasoning_gym
def test_task_reward_is_the_datasets_checker_on_the_answer_tags():
    rows = load_prompts("task:basic_arithmetic?size=4&seed=1")
    right = [f"let me think. <answer>{r['answer']}</answer>" for r in rows]
    near = [f"<answer>{r['answer']}1</answer>" for r in rows]  # a wrong number: the checker's partial credit
    untagged = [str(r["answer"]) for r in rows[:2]] + ["<answer>banana</answer>"] * 2
    completions = right + near + untagged
    scores = score(build_reward("task"), "task", [r["prompt"] for r in rows * 3], completions,
                   [True] * len(completions), rows * 3).tolist()
    assert scores[:4] == [1.0] * 4 and all(0 < x < 1 for x in scores[4:8]) and scores[8:] == [0.0] * 4


@needs_reasoning_gym
@pytest.mark.parametrize("spec, message", [
    ("task:no_such_task", "prompts: no reasoning-gym task 'no_such_task'; allowed: one of its"),
    ("task:leg_counting?bogus=1", "'bogus': 1} raised TypeError: LegCountingConfig"),
    ("task:leg_counting?min_animals=0", "min_animals must be positive"),
    ("task:leg_counting?size", "the part after ? is not KEY=VALUE pairs"),
    ("task:", "names no task"),
])
def test_task_errors_are_one_line(spec, message):
    with pytest.raises(UserError, match=".") as info:
        load_prompts(spec)
    assert message in str(info.value) and "\n" not in str(info.value)


@needs_reasoning_gym
def test_task_reward_without_task_prompts_is_one_line():
    with pytest.raises(UserError, match="reward task: the prompt rows carry no reasoning-gym answer"):
        score(build_reward("task"), "task", ["p"], ["c"], [True], [{"prompt": "p"}])
    assert [name for name, _, _ in build_reward("task,eos_penalty:1").terms] == ["task", "eos_penalty:1"]


@needs_reasoning_gym
def test_grpo_trains_on_a_task_from_the_cli(capsys, tmp_path, tiny_lm_dir):
    from ppoforge.runtime.metrics import read_metrics

    run = tmp_path / "run"
    code = main(["train", "rlhf", "--preset", "grpo", "--model", str(tiny_lm_dir), "--prompts",
                 "task:basic_arithmetic?size=16&seed=1", "--reward", "task", "--heldout-prompts",
                 "task:basic_arithmetic?size=4&seed=2", "--heldout-samples", "1", "--batch-size", "2",
                 "--num-generations", "4", "--mini-batch-size", "8", "--max-new-tokens", "4", "--total-updates", "1",
                 "--progress", "false", "--tensorboard", "false", "--run-dir", str(run)])
    first = capsys.readouterr().err
    assert code == 0, first
    (row,) = [r for r in read_metrics(run / "metrics.jsonl") if "reward" in r]
    assert row["reward"] == 0.0 and row["frac_reward_zero_std"] == 1.0  # a random model: no right answer
    code = main(["train", "rlhf", "--model", str(tiny_lm_dir), "--prompts", "task:nope",
                 "--run-dir", str(tmp_path / "bad")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "no reasoning-gym task 'nope'" in err


@pytest.mark.parametrize("use", ["prompts", "reward"])
def test_without_reasoning_gym_a_task_is_one_line_naming_the_install(monkeypatch, use):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym -> ImportError
    monkeypatch.setitem(sys.modules, "reasoning_gym.utils", None)
    rows = [{"prompt": "p", "question": "q", "answer": "1", "metadata": {"source_dataset": "chain_sum"}}]
    with pytest.raises(UserError, match=r"^tasks need reasoning-gym, which is not installed; install it: pip "):
        if use == "prompts":
            load_prompts("task:chain_sum?size=2")
        else:
            score(build_reward("task"), "task", ["p"], ["<answer>1</answer>"], [True], rows)


@needs_reasoning_gym
def test_a_task_generator_that_calls_sys_exit_is_one_line(monkeypatch):
    import reasoning_gym

    def leaving(name, **kwargs):
        raise SystemExit(1)

    monkeypatch.setattr(reasoning_gym, "create_dataset", leaving)
    with pytest.raises(UserError, match=r"^prompts: task leg_counting with .* raised SystemExit: 1; allowed"):
        load_prompts("task:leg_counting")
