"""Verifiable tasks from reasoning-gym (procedurally generated problems with exact checkers) as prompt
sets and a reward, for GRPO-style training against answers that can be checked.

    --prompts 'task:NAME?size=500&seed=1&KEY=VALUE...'  --reward task

`task:` builds `reasoning_gym.create_dataset(NAME, size=..., seed=..., KEY=VALUE...)`; each value is read
as YAML (`3` an int, `0.5` a float, `true` a bool, else a string), so every dataset's own config keys
work as they are. Each row's prompt is reasoning-gym's default instruction (think, then the answer in
`<answer>...</answer>`) followed by the question; the row keeps the bare `question`, the dataset's
`answer` and its `metadata`, which the trainer hands to reward functions as columns. One key is ours, not
the dataset's: `instruction=` replaces that instruction with one of reasoning-gym's `SYSTEM_PROMPTS` by name
(`direct`, `simple`, ...) or with the value itself as text (taken as written, not YAML; URL-decoded, so
write `+` as `%2B`): a small model may need a terser instruction to answer in the tags at all. `task` scores a
completion with the dataset's own `score_answer` on what `reasoning_gym.utils.extract_answer` finds in
its last answer tags (no tags: score 0), a number in [0, 1]. Nothing here re-implements a generator or
a checker.

reasoning-gym is an optional dependency (`pip install 'ppoforge[tasks]'`); without it either spec is a
one-line error.
"""

from __future__ import annotations

import functools
from urllib.parse import unquote_plus

from ppoforge.config import parse_query
from ppoforge.errors import UserError
from ppoforge.runtime.usercode import call_user

PREFIX = "task:"
DEFAULTS = {"size": 500, "seed": 1}
INSTALL = "pip install 'ppoforge[tasks]' (reasoning-gym)"


def _reasoning_gym():
    try:
        # optional extra (ppoforge[tasks]): imported at first use, a one-line error without it
        import reasoning_gym
        import reasoning_gym.utils
    except ImportError:
        raise UserError(f"tasks need reasoning-gym, which is not installed; install it: {INSTALL}") from None
    return reasoning_gym


def parse_task(spec: str) -> tuple[str, dict]:
    """'task:NAME?k=v&...' -> (NAME, {k: YAML value}), size and seed defaulted."""
    head, _, query = spec.removeprefix(PREFIX).partition("?")
    # `instruction` is text, taken as written (YAML would read "Example: 2 + 3" as a mapping)
    own = [item for item in query.split("&") if item.startswith("instruction=")]
    rest = "&".join(item for item in query.split("&") if item and item not in own)
    name, kwargs = parse_query(spec, f"{head}?{rest}", "prompts")
    if not name:
        raise UserError(f"prompts: {spec!r} names no task; allowed: task:NAME?size=N&seed=S&KEY=VALUE")
    if own:
        kwargs["instruction"] = unquote_plus(own[-1].removeprefix("instruction="))
    return name, {**DEFAULTS, **kwargs}


def task_rows(spec: str, field: str = "prompt") -> list[dict]:
    """The prompt rows of a `task:` spec: {field: instruction + question, question, answer, metadata}."""
    rg = _reasoning_gym()
    name, kwargs = parse_task(spec)
    instruction = kwargs.pop("instruction", "default")
    if name not in rg.factory.DATASETS:
        raise UserError(f"prompts: no reasoning-gym task {name!r}; allowed: one of its {len(rg.factory.DATASETS)} "
                        f"datasets, e.g. {', '.join(sorted(rg.factory.DATASETS)[:6])}")

    def generate() -> list[dict]:  # the dataset's own code (a registered dataset may be the user's)
        dataset = rg.create_dataset(name, **kwargs)
        return [dataset[i] for i in range(len(dataset))]

    # its config checks refuse a bad key or value: one line, as anything else it raises (runtime/usercode.py)
    entries = call_user(generate, f"prompts: task {name} with {kwargs}")
    instruction = rg.utils.SYSTEM_PROMPTS.get(instruction, instruction)
    return [{field: f"{instruction}\n{e['question']}", "question": e["question"], "answer": e["answer"],
             "metadata": e["metadata"]} for e in entries]


@functools.cache
def _checker(source: str):
    return _reasoning_gym().get_score_answer_fn(source)


def task_reward(prompts: list[str], completions: list[str], question: list[str] | None = None,
                answer: list | None = None, metadata: list[dict] | None = None, **kwargs) -> list[float]:
    """Each completion's score by its task's own checker, on the text inside its last <answer> tags."""
    if question is None or answer is None or metadata is None:
        raise UserError("reward task: the prompt rows carry no reasoning-gym answer and metadata; allowed with "
                        "prompts task:NAME?...")
    extract_answer = _reasoning_gym().utils.extract_answer
    entries = [{"question": q, "answer": a, "metadata": m} for q, a, m in zip(question, answer, metadata, strict=True)]
    return [float(_checker(e["metadata"]["source_dataset"])(extract_answer(text), e))
            for text, e in zip(completions, entries, strict=True)]
