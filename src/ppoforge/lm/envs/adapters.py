"""Adapters that run other libraries' environments unchanged under lm/envs/protocol.py's protocol.

TextArena (`textarena:GameName-v0`, `pip install 'ppoforge[envs]'`): one player, `reset(num_players=1,
seed)`, each reply to `step(action)`, the game's messages since the last reply as one user message, and
the reward of `close()` on the last turn. Actions go through the game's registered wrappers (e.g. the
bracket formatting `[5]` its parsers want); observations are read from the bare game, not through its
observation wrappers, which re-render the whole history into every message — the chat template
already carries the history. TextArena seeds Python's global `random` in `reset` and draws from it;
the adapter gives each game a private copy of that state, so a game neither disturbs nor depends on
anything else in the process.

TRL (`trl:module.path:Class`): a class written for `GRPOTrainer(environment_factory=Class)`, as TRL 1.x
drives it (trl/trainer/grpo_trainer.py): a fresh instance per episode; `reset(**row)` returns None or a
string appended to the row's prompt (its last message); every public method other than `reset` and
`get_reward` is a tool, described by its type hints and Google-style docstring
(`transformers.utils.get_json_schema`); `get_reward()`, when defined, scores the finished episode
(here: `score()`). TRL parses tool calls with the tokenizer's response schema; the protocol carries
text, so this adapter reads the Hermes / Qwen format those schemas parse,
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, and puts the tool list in a system message
worded as Qwen2.5's template words it. Like TRL: a reply without a (well-formed) tool call ends the
episode; each call's result comes back as {"role": "tool", "name": ..., "content": str(result)}, and an
unknown tool or a tool that raises as {"error": ...} in that content, not as a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import random
import re

from transformers.utils import get_json_schema

from ppoforge.errors import UserError
from ppoforge.lm.envs.protocol import EnvStep, as_messages

INSTALL = "pip install 'ppoforge[envs]' (textarena)"

# ---- TextArena ---------------------------------------------------------------------------------------


def _textarena():
    try:
        import textarena  # optional extra (ppoforge[envs]): imported at first use, a one-line error without it
    except ImportError:
        raise UserError(f"environment textarena: needs textarena, which is not installed; install it: {INSTALL}"
                        ) from None
    return textarena


def textarena_check(name: str) -> None:
    """A UserError unless `name` is a registered TextArena game (checked when the spec is loaded)."""
    _textarena()
    from textarena.envs.registration import ENV_REGISTRY  # optional extra: `_textarena` said it is there

    if name not in ENV_REGISTRY:
        raise UserError(f"environment textarena:{name}: no such TextArena game; allowed: one of its "
                        f"{len(ENV_REGISTRY)} registered ids, e.g. single-player GuessTheNumber-v0, Wordle-v0, "
                        "TowerOfHanoi-v0")


class TextArenaEnvironment:
    def __init__(self, name: str):
        ta = _textarena()
        self.name, self.env = name, ta.make(name)
        self.game = self.env
        while isinstance(self.game, ta.Wrapper):  # the bare game, under its observation wrappers
            self.game = self.game.env
        self._random = random.Random().getstate()
        self.final: float | None = None
        self.reason = ""

    @contextlib.contextmanager
    def _own_random(self):
        outer = random.getstate()
        random.setstate(self._random)
        try:
            yield
        finally:
            self._random = random.getstate()
            random.setstate(outer)

    def _messages(self) -> str:
        _, observations = self.game.get_observation()
        ta = _textarena()
        return "\n".join(text for _, text, kind in observations if kind != ta.ObservationType.PLAYER_ACTION)

    def reset(self, row: dict, rng: random.Random) -> str:
        seed = row["seed"] if row.get("seed") is not None else rng.randrange(2**31)
        with self._own_random():
            self.env.reset(num_players=1, seed=seed)
        self.final = None
        return self._messages()

    def step(self, reply: str) -> EnvStep:
        with self._own_random():
            done, info = self.env.step(reply)
        text = self._messages()
        if not done:
            return EnvStep(text, info=dict(info or {}))
        self.score()  # the game's reward is the episode's score (not also this step's: it would count twice)
        return EnvStep(text or self.reason or "The game is over.", done=True, info=dict(info or {}))

    def score(self) -> float:
        """The game's reward for player 0 from `close()` (closed on the first call: at the end, or when
        the episode is truncated); 0.0 when the game gives none."""
        if self.final is None:
            with self._own_random():
                rewards, game_info = self.env.close()
            self.final = float((rewards or {}).get(0, 0.0))
            self.reason = str(((game_info or {}).get(0) or {}).get("reason", ""))
        return self.final


# ---- TRL environment_factory -------------------------------------------------------------------------

_TOOL_CALL = re.compile(r"<tool_call>\s*(.+?)\s*</tool_call>", re.DOTALL)
_TOOLS_PROMPT = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                 "with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor "
                 "each function call, return a json object with function name and arguments within "
                 "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
                 "<args-json-object>}}\n</tool_call>")


def parse_tool_calls(reply: str) -> list[tuple[str, dict]]:
    """[(name, arguments)] of the reply's <tool_call> blocks; [] when it has none or any is malformed
    (TRL's `parse_response` then falls back to plain text, which ends the episode)."""
    calls = []
    for block in _TOOL_CALL.findall(reply):
        try:
            call = json.loads(block)
            args = call.get("arguments") if isinstance(call, dict) else None
            args = json.loads(args) if isinstance(args, str) else ({} if args is None else args)
        except (ValueError, AttributeError):
            return []
        if not isinstance(call.get("name"), str) or not isinstance(args, dict):
            return []
        calls.append((call["name"], args))
    return calls


class TRLEnvironment:
    def __init__(self, env):
        self.env = env
        methods = dict(inspect.getmembers(env, predicate=inspect.ismethod))
        where = f"environment trl:{type(env).__name__}"
        if "reset" not in methods:
            raise UserError(f"{where} has no reset method; allowed: a class as TRL's environment_factory "
                            "takes (reset(**row) -> str | None, public methods as tools)")
        self.tools = {n: m for n, m in methods.items() if n not in ("reset", "get_reward") and not n.startswith("_")}
        try:
            self.schemas = [get_json_schema(m) for m in self.tools.values()]
        except Exception as e:  # noqa: BLE001 - transformers' docstring/type-hint parser: the user's to fix
            raise UserError(f"{where}: a tool's schema cannot be built ({type(e).__name__}: "
                            f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}); allowed: type hints "
                            "and a Google-style docstring on every public method") from None
        self._get_reward = methods.get("get_reward")

    def reset(self, row: dict, rng: random.Random) -> list[dict]:
        observation = self.env.reset(**row)
        messages = as_messages(row.get("prompt", ""), "environment trl: the row's prompt")
        if observation is not None:
            messages[-1] = {**messages[-1], "content": messages[-1]["content"] + str(observation)}
        if not self.tools:
            return messages
        tools = _TOOLS_PROMPT.format(tools="\n".join(json.dumps(s, ensure_ascii=False) for s in self.schemas))
        if messages[0]["role"] == "system":
            return [{**messages[0], "content": f"{messages[0]['content']}\n\n{tools}"}, *messages[1:]]
        return [{"role": "system", "content": tools}, *messages]

    def _call(self, name: str, args: dict):
        if name not in self.tools:
            return {"error": f"Tool {name} not found."}
        try:
            out = self.tools[name](**args)
            return asyncio.run(out) if inspect.iscoroutine(out) else out
        except Exception as e:  # noqa: BLE001 - as TRL: a failing tool is the model's problem, told in the reply
            return {"error": str(e)}

    def step(self, reply: str) -> EnvStep:
        calls = parse_tool_calls(reply)
        if not calls:
            return EnvStep([], done=True)
        results = [(name, self._call(name, args)) for name, args in calls]
        return EnvStep([{"role": "tool", "name": name, "content": str(result)} for name, result in results],
                       info={"tool_calls": len(calls)})

    def score(self) -> float | None:
        """`get_reward()` when the class defines it (TRL calls it once per finished rollout), else None."""
        if self._get_reward is None:
            return None
        out = self._get_reward()
        return asyncio.run(out) if inspect.iscoroutine(out) else out  # TRL takes an async get_reward too
