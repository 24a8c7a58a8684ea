"""The environment protocol for multi-turn RLHF: plain Python objects that talk in chat messages.

    reset(row, rng) -> str | list[dict]     the first message(s); a str is one user message
    step(reply)     -> EnvStep              the environment's answer to the policy's reply (text)
    score()         -> float                optional: the episode's final score (after done or truncation)

An environment is a Protocol, not a base class: any object with these methods is one. `load_env(spec)`
returns a factory (one fresh environment per episode) whose environments are wrapped in `Checked`, the
one place an environment's output is validated and its code is called: a reply that is not a string or
a list of {"role": str, "content": str} messages, a reward that is not a finite number float32 can hold,
anything the code raises (sys.exit included) — each is a one-line `UserError` naming the environment
(exit code 2), as reward functions are checked in lm/rl/rewards.py; a call that runs past `call_timeout` is
a `CallTimeout` naming it (exit 1), and SIGTERM abandons it (runtime/usercode.py). Specs:

    py:module.path:Class | py:/path/file.py:Class   a user's environment (hashed by runtime/trust.py)
    textarena:GameName-v0                           a TextArena game (lm/envs/adapters.py)
    trl:module.path:Class | trl:/path/file.py:Class a TRL `environment_factory` class, run unchanged
    guess_number?hi=8                               a built-in (lm/envs/builtin.py), ?KEY=VALUE options
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Protocol

from ppoforge.config import FLOAT32_MAX, float32_finite
from ppoforge.errors import UserError
from ppoforge.runtime.usercode import call_user

ALLOWED_SPECS = ("py:module.path:Class, py:/path/file.py:Class, textarena:GameName-v0, trl:module.path:Class, "
                 "trl:/path/file.py:Class, or a built-in: guess_number[?hi=N]")
ROLES = ("system", "user", "assistant", "tool")


@dataclass
class EnvStep:
    messages: list[dict] | str      # the environment's reply: chat messages, or a str = one user message
    reward: float | None = None     # this turn's reward (sits on the turn's last policy token)
    done: bool = False              # the episode terminated
    info: dict = field(default_factory=dict)


class Environment(Protocol):
    def reset(self, row: dict, rng: random.Random) -> str | list[dict]: ...

    def step(self, reply: str) -> EnvStep: ...


def _short(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def as_messages(x: str | list[dict], where: str = "environment") -> list[dict]:
    """str -> [{"role": "user", "content": x}]; a list must hold {"role": one of ROLES, "content": str}
    dicts (other keys, e.g. a tool message's "name", are kept). Else a UserError naming `where`."""
    if isinstance(x, str):
        return [{"role": "user", "content": x}]
    allowed = "allowed: a string or a list of {'role': ..., 'content': str} messages"
    if not isinstance(x, (list, tuple)):
        raise UserError(f"{where} returned {_short(x)}; {allowed}")
    for i, m in enumerate(x):
        if not (isinstance(m, dict) and isinstance(m.get("content"), str)):
            raise UserError(f"{where} returned {_short(m)} as message {i}; {allowed}")
        if m.get("role") not in ROLES:
            raise UserError(f"{where} returned role {m.get('role')!r} in message {i}; allowed roles: "
                            f"{', '.join(ROLES)}")
    return [dict(m) for m in x]


class Checked:
    """An environment whose every output is validated and whose exceptions are one-line UserErrors.

    `reset` returns the first messages as a list (never empty, not ending with an assistant turn: the
    policy speaks next). `step` returns an EnvStep with `messages` as a list (empty only when done) and
    `reward` a float or None. `score()` is the environment's own score as a float, or None when it
    defines no `score` (or its score returned None: an adapted TRL class without `get_reward`). Every call
    into the environment runs under `timeout` seconds (runtime/usercode.py)."""

    def __init__(self, env, name: str, timeout: float | None = None):
        self.env, self.name, self.timeout = env, name, timeout
        self._score = getattr(env, "score", None)  # the protocol's one optional method

    def _call(self, method: str, *args):
        """The environment's `method(*args)` under `timeout` seconds (call_timeout), its failures one line."""
        return call_user(lambda: getattr(self.env, method)(*args), f"environment {self.name}: {method}",
                         self.timeout)

    def reset(self, row: dict, rng: random.Random) -> list[dict]:
        messages = as_messages(self._call("reset", row, rng), f"environment {self.name}: reset")
        if not messages or messages[-1]["role"] == "assistant":
            raise UserError(f"environment {self.name}: reset returned {len(messages)} messages ending with "
                            f"{messages[-1]['role'] if messages else 'nothing'}; allowed: one or more messages, "
                            "the last not from the assistant")
        return messages

    def step(self, reply: str) -> EnvStep:
        out = self._call("step", reply)
        where = f"environment {self.name}: step"
        if not isinstance(out, EnvStep):
            raise UserError(f"{where} returned {_short(out)}; allowed: an EnvStep(messages, reward, done, info)")
        messages = as_messages(out.messages, where)
        if any(m["role"] == "assistant" for m in messages):
            raise UserError(f"{where} replied as the assistant; allowed roles: system, user, tool")
        if not isinstance(out.done, bool):
            raise UserError(f"{where} returned done={_short(out.done)}; allowed: True or False")
        if not messages and not out.done:
            raise UserError(f"{where} returned no messages and done=False; allowed: a reply, or done=True")
        if not isinstance(out.info, dict):
            raise UserError(f"{where} returned info={_short(out.info)}; allowed: a dict")
        return EnvStep(messages, _number(out.reward, where, "reward"), out.done, out.info)

    def score(self) -> float | None:
        if self._score is None:
            return None
        return _number(self._call("score"), f"environment {self.name}: score", "score")


def _number(value, where: str, what: str) -> float | None:
    if value is None:
        return None
    if not float32_finite(value):  # the rollout holds rewards as float32, where 1e308 is inf
        raise UserError(f"{where} returned {what} {_short(value)}; allowed: a finite number (within float32's "
                        f"+-{FLOAT32_MAX:.1e}) or None")
    return float(value)


