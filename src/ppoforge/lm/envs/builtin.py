"""Built-in environments (lm/envs/protocol.py's protocol), named by a spec such as `guess_number?hi=8`.

`guess_number`: the environment picks a whole number in [1, hi]; the policy guesses, the environment
answers "Higher." or "Lower." until the guess is right (reward 1.0, done). A reply without a number
costs `invalid` (default 0.0: a small negative such as -0.1 teaches the format faster, but makes a
silent policy's return depend on how many turns the sampler allows). The secret comes from the row's
`secret` column when it has one (reproducible evaluation sets), else from the episode's `rng`; `hi`
from the row's `hi` column, else the spec (`guess_number?hi=8`), else 16. Binary search solves it in
ceil(log2(hi + 1)) guesses, so a turn budget of that size separates a policy that uses the feedback from
one that guesses at random.

Two options make the feedback easier to learn from, neither changing what counts as solved:
- `feedback=range` adds the numbers still possible to each reply ("Higher. It is from 5 to 8."), so a
  policy has to read one line instead of keeping the whole history in mind, and the first message says
  so, and that the middle one is the best guess;
- `progress=c` pays c * (candidates ruled out) / (hi - 1) on each wrong guess, and c times the rest on
  the right one. An episode's shaping sums to c * (hi - candidates left) / (hi - 1): c for a solved
  game, less for one that narrowed the range less, 0 for guesses that repeat or contradict the
  feedback. A potential-based shaping: it never makes an unsolved game worth more than a solved one.
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
    FEEDBACK = ("direction", "range")

    def __init__(self, hi: int = 16, invalid: float = 0.0, feedback: str = "direction", progress: float = 0.0):
        if isinstance(hi, bool) or not isinstance(hi, int) or hi < 1:
            raise UserError(f"environment guess_number: hi={hi!r}; allowed: an integer >= 1")
        for name, value in (("invalid", invalid), ("progress", progress)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise UserError(f"environment guess_number: {name}={value!r}; allowed: a number (e.g. -0.1)")
        if feedback not in self.FEEDBACK:
            raise UserError(f"environment guess_number: feedback={feedback!r}; allowed: {', '.join(self.FEEDBACK)}")
        self.default_hi, self.invalid, self.feedback, self.progress = hi, float(invalid), feedback, float(progress)
        self.hi = self.secret = self.low = self.high = 0
        self.solved = False

    def reset(self, row: dict, rng: random.Random) -> str:
        self.hi = int(row.get("hi", self.default_hi))
        self.secret = int(row["secret"]) if row.get("secret") is not None else rng.randint(1, self.hi)
        if not 1 <= self.secret <= self.hi:
            raise UserError(f"environment guess_number: row secret {self.secret} is outside 1..{self.hi}")
        self.solved = False
        self.low, self.high = 1, self.hi  # the numbers the feedback so far leaves possible
        ask = f"I am thinking of a whole number from 1 to {self.hi}. Guess it: reply with just the number."
        if self.feedback == "range":
            ask += (" After a wrong guess I say Higher or Lower and which numbers are still possible: guessing"
                    " the middle one finds it fastest.")
        return ask

    def _shaping(self, low: int, high: int) -> float:
        """progress * the candidates this guess ruled out, over the hi - 1 there are to rule out."""
        ruled_out = (self.high - self.low) - (high - low)
        return self.progress * ruled_out / max(self.hi - 1, 1)

    def step(self, reply: str) -> EnvStep:
        match = _INTEGER.search(reply)
        if match is None:
            return EnvStep("Reply with just a number.", reward=self.invalid)
        guess = int(match.group())
        if guess == self.secret:
            self.solved = True
            return EnvStep("Correct.", reward=1.0 + self._shaping(guess, guess), done=True, info={"guess": guess})
        if guess < self.secret:
            low, high = max(self.low, guess + 1), self.high
        else:
            low, high = self.low, min(self.high, guess - 1)
        reward = self._shaping(low, high)
        self.low, self.high = low, high
        answer = "Higher." if guess < self.secret else "Lower."
        if self.feedback == "range":
            answer += f" It is from {low} to {high}." if low < high else f" It is {low}."
        return EnvStep(answer, reward=reward, info={"guess": guess})


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
