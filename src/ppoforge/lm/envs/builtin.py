"""Built-in environments (lm/envs/protocol.py's protocol), named by a spec such as `guess_number?hi=8`.

`guess_number`: the environment picks a whole number in [1, hi]; the policy guesses, the environment
answers "Higher." or "Lower." until the guess is right (reward 1.0, done). A reply without a number
costs `invalid` (default 0.0: a small negative such as -0.1 teaches the format faster, but makes a
silent policy's return depend on how many turns the sampler allows). The secret comes from the row's
`secret` column when it has one (reproducible evaluation sets), else from the episode's `rng`; `hi`
from the row's `hi` column, else the spec (`guess_number?hi=8`), else 16. Binary search solves it in
ceil(log2(hi + 1)) guesses, so a turn budget of that size separates a policy that uses the feedback from
one that guesses at random.
"""

from __future__ import annotations

import inspect
import random
import re

from ppoforge.config import parse_query
from ppoforge.errors import UserError
from ppoforge.lm.envs.protocol import ALLOWED_SPECS, EnvStep

_INTEGER = re.compile(r"-?\d+")


class GuessNumber:
    def __init__(self, hi: int = 16, invalid: float = 0.0):
        if isinstance(hi, bool) or not isinstance(hi, int) or hi < 1:
            raise UserError(f"environment guess_number: hi={hi!r}; allowed: an integer >= 1")
        if isinstance(invalid, bool) or not isinstance(invalid, (int, float)):
            raise UserError(f"environment guess_number: invalid={invalid!r}; allowed: a number (e.g. -0.1)")
        self.default_hi, self.invalid = hi, float(invalid)
        self.hi = self.secret = 0
        self.solved = False

    def reset(self, row: dict, rng: random.Random) -> str:
        self.hi = int(row.get("hi", self.default_hi))
        self.secret = int(row["secret"]) if row.get("secret") is not None else rng.randint(1, self.hi)
        if not 1 <= self.secret <= self.hi:
            raise UserError(f"environment guess_number: row secret {self.secret} is outside 1..{self.hi}")
        self.solved = False
        return f"I am thinking of a whole number from 1 to {self.hi}. Guess it: reply with just the number."

    def step(self, reply: str) -> EnvStep:
        match = _INTEGER.search(reply)
        if match is None:
            return EnvStep("Reply with just a number.", reward=self.invalid)
        guess = int(match.group())
        if guess == self.secret:
            self.solved = True
            return EnvStep("Correct.", reward=1.0, done=True, info={"guess": guess})
        return EnvStep("Higher." if guess < self.secret else "Lower.", reward=0.0, info={"guess": guess})


BUILTINS = {"guess_number": GuessNumber}


def builtin(spec: str):
    """A zero-argument factory for the built-in `NAME?KEY=VALUE&...` (values read as YAML)."""
    name, kwargs = parse_query(spec, spec, "environment")
    cls = BUILTINS.get(name)
    if cls is None:
        raise UserError(f"environment: {spec!r} is not an environment spec; allowed: {ALLOWED_SPECS}")
    try:
        cls(**kwargs)  # a bad option fails here, at load time, not in the first episode
    except TypeError as e:
        options = ", ".join(inspect.signature(cls).parameters)
        raise UserError(f"environment {spec}: {e}; allowed options of {name}: {options}") from None
    return lambda: cls(**kwargs)
