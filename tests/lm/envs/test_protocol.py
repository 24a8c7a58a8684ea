"""The environment protocol (lm/envs/protocol.py): specs, checked replies, the built-in guess_number, and the
TextArena and TRL environment_factory adapters each on a real game / class."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ppoforge.errors import UserError
from ppoforge.lm.envs.adapters import parse_tool_calls
from ppoforge.lm.envs.loading import load_env
from ppoforge.lm.envs.protocol import EnvStep, as_messages


class Counter:
    """A TRL environment_factory class, written as TRL's GRPOTrainer docs write theirs: `reset(**kwargs)`,
    public methods with type hints and Google-style docstrings become tools, `get_reward` scores."""

    def __init__(self):
        self.counter = 0

    def reset(self, **kwargs) -> str | None:
        self.counter = 0
        self.target = kwargs.get("target", 3)
        return f" The counter is 0; bring it to {self.target}."

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        if step < 0:
            raise ValueError("step must be positive")
        self.counter += step
        return self.counter

    def get_reward(self) -> float:
        return 1.0 if self.counter == self.target else 0.0


def _play_guess(env, row, replies):
    first = env.reset(row, random.Random(0))
    steps = [env.step(r) for r in replies]
    return first, steps


def test_guess_number_full_episode():
    env = load_env("guess_number?hi=8")()
    first, steps = _play_guess(env, {"secret": 5}, ["4", "seven", "I guess 6", "5"])
    assert first == [{"role": "user", "content": "I am thinking of a whole number from 1 to 8. Guess it: reply "
                                                 "with just the number."}]
    assert [(s.messages, s.reward, s.done) for s in steps] == [
        ([{"role": "user", "content": "Higher."}], 0.0, False),
        ([{"role": "user", "content": "Reply with just a number."}], 0.0, False),
        ([{"role": "user", "content": "Lower."}], 0.0, False),
        ([{"role": "user", "content": "Correct."}], 1.0, True)]
    assert env.score() is None  # the reward came with the turn: no final score on top of it


def test_guess_number_draws_from_rng_and_reads_options():
    factory = load_env("guess_number?hi=8&invalid=-0.1")
    secrets = set()
    for seed in range(40):
        env = factory()
        env.reset({}, random.Random(seed))
        secrets.add(env.env.secret)
        assert env.env.secret == random.Random(seed).randint(1, 8)  # reproducible from the episode's rng
    assert secrets == set(range(1, 9))
    env = factory()
    assert "from 1 to 3." in env.reset({"hi": 3}, random.Random(0))[0]["content"]  # the row's hi wins
    assert env.step("no idea").reward == -0.1


def test_guess_number_range_feedback_and_progress_shaping():
    """feedback=range names the numbers still possible; progress=c pays for the candidates each guess rules
    out (hand-computed: hi=8, 7 to rule out), so a solved game's shaping sums to c and a repeat earns 0."""
    env = load_env("guess_number?hi=8&feedback=range&progress=0.7")()
    first, steps = _play_guess(env, {"secret": 6}, ["4", "3", "7", "6"])
    assert first[0]["content"].endswith("which numbers are still possible: guessing the middle one finds it fastest.")
    assert [s.messages[0]["content"] for s in steps] == [
        "Higher. It is from 5 to 8.", "Higher. It is from 5 to 8.", "Lower. It is from 5 to 6.", "Correct."]
    # 8 -> 4 candidates (4 ruled out), 4 -> 4 (a guess the feedback had ruled out), 4 -> 2, 2 -> the secret
    assert [s.reward for s in steps] == pytest.approx([0.7 * 4 / 7, 0.0, 0.7 * 2 / 7, 1.0 + 0.7 * 1 / 7])
    assert sum(s.reward for s in steps) == pytest.approx(1.7)
    env = load_env("guess_number?hi=8&feedback=range&progress=0.7")()
    _, steps = _play_guess(env, {"secret": 2}, ["1", "3"])
    assert steps[-1].messages[0]["content"] == "Lower. It is 2."
    assert sum(s.reward for s in steps) == pytest.approx(0.7)  # narrowed to one: all the shaping, not the solve's 1
    plain = load_env("guess_number?hi=8")()
    _, steps = _play_guess(plain, {"secret": 6}, ["4", "6"])
    assert [(s.messages[0]["content"], s.reward) for s in steps] == [("Higher.", 0.0), ("Correct.", 1.0)]


@pytest.mark.parametrize(("spec", "message"), [
    ("nope", "environment: 'nope' is not an environment spec; allowed: py:module.path:Class"),
    ("gym:CartPole-v1", "environment: 'gym:CartPole-v1' is not an environment spec; allowed: py:"),
    ("py:", "environment: 'py:' is not an environment spec"),
    ("py:no_such_module_xyz:Env", "environment py:no_such_module_xyz:Env: importing no_such_module_xyz raised"),
    ("py:/nowhere/env.py:Env", "environment py:/nowhere/env.py:Env: no file /nowhere/env.py"),
    ("trl:Counter", "environment trl:Counter: expected trl:module.path:Class or trl:/path/file.py:Class"),
    ("guess_number?hi=0", "environment guess_number: hi=0; allowed: an integer >= 1"),
    ("guess_number?colour=red", "environment guess_number\\?colour=red: .*allowed options of guess_number: hi, "
                                "invalid"),
    ("guess_number?feedback=loud", "environment guess_number: feedback='loud'; allowed: direction, range"),
    ("guess_number?progress=lots", "environment guess_number: progress='lots'; allowed: a number"),
    ("guess_number?hi", "the part after \\? is not KEY=VALUE pairs"),
])
def test_bad_spec_is_one_line_user_error(spec, message):
    with pytest.raises(UserError, match=message) as e:
        load_env(spec)
    assert "\n" not in str(e.value)


BAD_ENV = '''
import math
from ppoforge.lm.envs.protocol import EnvStep

class Bad:
    def __init__(self, reply):
        self.reply = reply
    def reset(self, row, rng):
        return row.get("first", "hello")
    def step(self, reply):
        if self.reply == "raise":
            raise KeyError("secret")
        return self.reply

REPLIES = {
    "dict": {"messages": "hi"},
    "role": EnvStep([{"role": "bot", "content": "hi"}]),
    "content": EnvStep([{"role": "user", "content": 3}]),
    "assistant": EnvStep([{"role": "assistant", "content": "I win"}]),
    "nan": EnvStep("hi", reward=math.nan),
    "huge": EnvStep("hi", reward=1e308),  # finite as a float, inf as the rollout's float32
    "text_reward": EnvStep("hi", reward="1"),
    "done": EnvStep("hi", done="yes"),
    "silent": EnvStep([], done=False),
    "raise": "raise",
}

def make(kind):
    return type(f"Bad_{kind}", (Bad,), {"__init__": lambda self: Bad.__init__(self, REPLIES[kind])})

for _kind in REPLIES:
    globals()[f"Bad_{_kind}"] = make(_kind)
'''


@pytest.mark.parametrize(("kind", "message"), [
    ("dict", "step returned dict .*allowed: an EnvStep"),
    ("role", "step returned role 'bot' in message 0; allowed roles: system, user, assistant, tool"),
    ("content", "step returned dict .* as message 0; allowed: a string or a list of"),
    ("assistant", "step replied as the assistant; allowed roles: system, user, tool"),
    ("nan", r"step returned reward float nan; allowed: a finite number \(within float32's \+-3.4e\+38\) or None"),
    ("huge", r"step returned reward float 1e\+308; allowed: a finite number \(within float32's"),
    ("text_reward", "step returned reward str '1'"),
    ("done", "step returned done=str 'yes'; allowed: True or False"),
    ("silent", "step returned no messages and done=False"),
    ("raise", "step raised KeyError: 'secret'"),
])
def test_bad_env_reply_is_one_line_user_error_naming_the_environment(tmp_path, kind, message):
    path = tmp_path / "bad_env.py"
    path.write_text(BAD_ENV)
    spec = f"py:{path}:Bad_{kind}"
    env = load_env(spec)()
    assert env.reset({}, random.Random(0)) == [{"role": "user", "content": "hello"}]
    with pytest.raises(UserError, match=f"^environment {spec}: {message}") as e:
        env.step("4")
    assert "\n" not in str(e.value)


def test_bad_reset_and_as_messages(tmp_path, monkeypatch):
    (tmp_path / "bad_env.py").write_text(BAD_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    env = load_env("py:bad_env:Bad_nan")()  # a module on sys.path, as py: rewards load
    with pytest.raises(UserError, match="^environment py:bad_env:Bad_nan: reset returned 1 messages ending with "
                                        "assistant; allowed: one or more messages, the last not from the assistant"):
        env.reset({"first": [{"role": "assistant", "content": "I start"}]}, random.Random(0))
    assert as_messages("hi") == [{"role": "user", "content": "hi"}]
    tool = [{"role": "tool", "name": "f", "content": "2"}]
    assert as_messages(tool) == tool
    with pytest.raises(UserError, match="^environment returned int 3; allowed: a string or a list of"):
        as_messages(3)


def test_textarena_guess_the_number_episode():
    pytest.importorskip("textarena", reason="textarena is an optional extra: pip install 'ppoforge[envs]'")
    outer = random.getstate()
    env = load_env("textarena:GuessTheNumber-v0")()
    first = env.reset({"seed": 7}, random.Random(0))
    assert len(first) == 1 and "You are playing Guess The Number" in first[0]["content"]
    lo, hi, replies = 1, 20, []
    while True:  # binary search, replying without brackets: the game's action wrapper adds them
        guess = (lo + hi) // 2
        step = env.step(str(guess))
        replies.append(step)
        if step.done:
            break
        text = step.messages[0]["content"]
        assert text in ("The target number is higher.", "The target number is lower.")  # only what is new
        lo, hi = (guess + 1, hi) if "higher" in text else (lo, guess - 1)
    assert all(s.reward is None for s in replies)  # the game's reward is the score, counted once
    assert "Congratulations" in replies[-1].messages[0]["content"]
    assert env.score() == 1.0 and len(replies) <= 5
    assert random.getstate() == outer  # the game seeds and draws from its own copy of `random`


def test_textarena_seed_from_the_row_fixes_the_game():
    pytest.importorskip("textarena", reason="textarena is an optional extra: pip install 'ppoforge[envs]'")

    def play(seed):
        env = load_env("textarena:GuessTheNumber-v0")()
        env.reset({"seed": seed}, random.Random(0))
        return [env.step(g).messages[0]["content"] for g in ("[10]", "[5]", "[15]")]

    assert play(7) == play(7)
    assert len({tuple(play(seed)) for seed in range(6)}) > 1


def test_textarena_unknown_game():
    pytest.importorskip("textarena", reason="textarena is an optional extra: pip install 'ppoforge[envs]'")
    with pytest.raises(UserError, match="^environment textarena:NoSuchGame-v0: no such TextArena game; allowed:"):
        load_env("textarena:NoSuchGame-v0")


def test_trl_environment_factory_class_tool_call_round_trip():
    env = load_env(f"trl:{Path(__file__)}:Counter")()
    system, user = env.reset({"prompt": "Count for me.", "target": 3}, random.Random(0))
    assert user == {"role": "user", "content": "Count for me. The counter is 0; bring it to 3."}  # TRL: appended
    assert system["role"] == "system" and system["content"].startswith("# Tools\n\nYou may call one or more")
    assert '{"type": "function", "function": {"name": "increment", "description": "Increment the internal ' \
           'counter."' in system["content"]
    call = '<tool_call>\n{"name": "increment", "arguments": {"step": %d}}\n</tool_call>'
    step = env.step("I will add two. " + call % 2)
    assert (step.messages, step.reward, step.done) == ([{"role": "tool", "name": "increment", "content": "2"}],
                                                       None, False)
    step = env.step(call % -1 + '<tool_call>{"name": "decrement", "arguments": {}}</tool_call>' + call % 1)
    assert step.messages == [{"role": "tool", "name": "increment", "content": "{'error': 'step must be positive'}"},
                             {"role": "tool", "name": "decrement", "content": "{'error': 'Tool decrement not found.'}"},
                             {"role": "tool", "name": "increment", "content": "3"}]
    assert env.step("The counter is 3.") == EnvStep([], None, True, {})  # no tool call: the episode ends
    assert env.score() == 1.0


class NoReward:
    def reset(self, **kwargs):
        return None

    async def shout(self, text: str) -> str:
        """
        Shout the text.

        Args:
            text: What to shout.
        """
        return text.upper()


class NoDocstring:
    def reset(self, **kwargs):
        return None

    def tool(self, x: int) -> int:
        return x


class NoReset:
    def tool(self, x: int) -> int:
        """
        A tool.

        Args:
            x: A number.
        """
        return x


def test_trl_class_without_reward_async_tool_and_bad_classes():
    env = load_env(f"trl:{Path(__file__)}:NoReward")()
    assert env.reset({}, random.Random(0))[1] == {"role": "user", "content": ""}  # no prompt, reset said nothing
    step = env.step('<tool_call>{"name": "shout", "arguments": {"text": "hi"}}</tool_call>')
    assert step.messages == [{"role": "tool", "name": "shout", "content": "HI"}]
    assert env.score() is None  # no get_reward: the run's reward functions score the episode
    for cls, message in (("NoDocstring", "a tool's schema cannot be built"), ("NoReset", "has no reset method")):
        with pytest.raises(UserError, match=f"^environment trl:{cls}.*{message}") as e:
            load_env(f"trl:{Path(__file__)}:{cls}")()
        assert "\n" not in str(e.value)


def test_tool_call_parsing_follows_trl_fallback():
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>') == [("f", {"x": 1})]
    assert parse_tool_calls('<tool_call>{"name": "f"}</tool_call>') == [("f", {})]
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": {}</tool_call>') == []  # malformed: plain text
    assert parse_tool_calls("no call") == []


def test_env_code_is_fingerprinted_for_resume():
    from dataclasses import dataclass

    from ppoforge.runtime import trust

    @dataclass
    class Cfg:
        env: str

    assert trust.code_items(Cfg("py:my_envs.games:Game")) == ["my_envs.games"]
    assert trust.code_items(Cfg("trl:/work/envs/counter.py:Counter")) == ["/work/envs/counter.py"]
    assert trust.code_items(Cfg("guess_number?hi=8")) == trust.code_items(Cfg("textarena:Wordle-v0")) == []


# ---- environments in a real training run: the user-code boundary (time limit, SIGTERM, sys.exit) ---------

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """The doctor's tiny LM (lm/models/tiny.py): a chat template, and no fast-path warning on stderr."""
    from ppoforge.lm.models.tiny import save_tiny_lm

    return save_tiny_lm(tmp_path_factory.mktemp("tiny") / "model")


RUN_ENV = '''
import os, sys, time
from ppoforge.lm.envs.protocol import EnvStep

resets = []  # every episode's reset in the run: 4 episodes an update, so update 3 misbehaves

class Env:
    def reset(self, row, rng):
        resets.append(1)
        self.late = len(resets) > 8
        return "say something"

    def step(self, reply):
        if self.late and os.environ["ENV_MODE"] == "hang":
            open(os.environ["ENV_MARK"], "w").close()  # the test sees the step has started
            while True:
                time.sleep(3600)
        if self.late and os.environ["ENV_MODE"] == "exit":
            raise SystemExit("the game server said goodbye")
        if self.late and os.environ["ENV_MODE"] == "huge":
            return EnvStep("ok", reward=1e308, done=True)
        return EnvStep("ok", reward=1.0, done=True)
'''


def _env_run(tmp_path: Path, tiny_model: Path, mode: str, *extra: str) -> subprocess.Popen:
    """`ppoforge train rlhf --env py:FILE:Env` for 4 updates of 4 episodes, in a subprocess."""
    (tmp_path / "run_env.py").write_text(RUN_ENV)
    argv = [sys.executable, "-m", "ppoforge", "train", "rlhf", "--model", str(tiny_model), "--prompts", "demo",
            "--heldout-prompts", "none", "--env", f"py:{tmp_path / 'run_env.py'}:Env", "--reward", "env",
            "--advantage", "grpo", "--kl-coef", "0", "--max-turns", "2", "--batch-size", "2", "--num-generations",
            "2", "--mini-batch-size", "4", "--micro-batch-size", "4", "--max-new-tokens", "3",
            "--max-prompt-tokens", "16", "--max-env-tokens", "8", "--ppo-epochs", "1", "--lora-r", "2",
            "--progress", "false", "--tensorboard", "false", "--checkpoint-every", "100", "--device", "cpu",
            "--torch-threads", "1", "--total-updates", "4", "--run-dir", str(tmp_path / "run"), *extra]
    env = {**os.environ, "ENV_MODE": mode, "ENV_MARK": str(tmp_path / "hung")}
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[str, str]:
    """The run's (stdout, stderr); a run still going after `timeout` seconds is killed (and fails the test)."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the run did not end within {timeout} s; its stderr: {err[-2000:]}")


def _saved_update(run: Path) -> int:
    import torch

    return torch.load(run / "checkpoint.pt", weights_only=True)["update"]


def test_a_hung_environment_step_times_out_with_one_line_and_a_checkpoint(tmp_path, tiny_model):
    proc = _env_run(tmp_path, tiny_model, "hang", "--call-timeout", "2")
    out, err = _finish(proc)
    assert proc.returncode == 1 and len(err.strip().splitlines()) == 1, err
    assert f"environment py:{tmp_path / 'run_env.py'}:Env: step did not return within 2 s (call_timeout)" in err
    assert "checkpoint at update 2" in err and _saved_update(tmp_path / "run") == 2


def test_sigterm_inside_a_hung_environment_step_stops_with_a_checkpoint(tmp_path, tiny_model):
    proc = _env_run(tmp_path, tiny_model, "hang")  # call_timeout 600 s: only the signal can end the step
    deadline = time.monotonic() + 120
    while not (tmp_path / "hung").exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    if not (tmp_path / "hung").exists():
        proc.kill()
        pytest.fail(f"the step never hung; stderr: {proc.communicate()[1][-2000:]}")
    proc.send_signal(signal.SIGTERM)
    out, err = _finish(proc, 60)
    assert proc.returncode == 0, err
    assert "stopped by SIGTERM, checkpoint saved: 2 updates" in out
    assert _saved_update(tmp_path / "run") == 2


def test_sys_exit_in_an_environment_step_is_its_failure(tmp_path, tiny_model):
    proc = _env_run(tmp_path, tiny_model, "exit")
    out, err = _finish(proc)
    assert proc.returncode == 2 and len(err.strip().splitlines()) == 1, (out, err)
    assert (f"environment py:{tmp_path / 'run_env.py'}:Env: step raised SystemExit: the game server said goodbye"
            in err)
    assert "checkpoint at update 2" in err and _saved_update(tmp_path / "run") == 2


def test_a_turn_reward_beyond_float32_is_refused_in_one_line(tmp_path, tiny_model):
    proc = _env_run(tmp_path, tiny_model, "huge")
    out, err = _finish(proc)
    assert proc.returncode == 2 and len(err.strip().splitlines()) == 1, (out, err)
    assert "step returned reward float 1e+308; allowed: a finite number (within float32's" in err
    assert "checkpoint at update 2" in err
