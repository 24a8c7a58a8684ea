"""Reward functions: one plain signature, a few built-ins, reward models, and validation.

A reward function is any callable

    fn(prompts: list[str], completions: list[str], **row_fields) -> list[float]

`prompts` are the raw prompt texts (the prompt field, before any chat template), `completions` the
decoded completions without special tokens. The trainer always passes `finished: list[bool]` (True
when the completion ended with a stop token rather than hitting the length limit) plus every other
column of the prompt rows as a list, so a function takes `**kwargs` to ignore what it does not need.

`score` is the one place a reward's output is checked: a reward that raises (sys.exit included: the
user-code boundary, runtime/usercode.py), or returns anything but one real number per completion, is a
`UserError` naming the reward — exit code 2, no traceback. NaN and infinity are numbers (and so is
1e308, infinite as float32), but they would silently poison every advantage in the batch: the trainer's
non-finite guard skips such an update, counts it and stops after `nonfinite_patience` of them in a row
(`runtime/resilience.py`).
"""

from __future__ import annotations

import functools
import math
import numbers
import re
from collections.abc import Callable, Sequence

import torch

from ppoforge.errors import UserError
from ppoforge.lm.data.tasks import task_reward
from ppoforge.lm.models.attention import right_pad
from ppoforge.lm.models.loading import has_tokenizer_files, is_causal, load_reward_model, load_tokenizer
from ppoforge.lm.models.rows import attention_cost, branch_rows, branch_work
from ppoforge.lm.models.windows import attention_window
from ppoforge.lm.supervised.examples import reward_input_ids
from ppoforge.runtime.usercode import call_user, load_python

RewardFn = Callable[..., list[float]]
ALLOWED_SPECS = ("vader, length:N, format:REGEX, eos_penalty:X, model:PATH, task (with prompts task:NAME), "
                 "py:module.path:function or py:/path/file.py:function")
_POSITIONAL = ("prompts", "completions", "finished")


# ---- built-in rewards -------------------------------------------------------------------------------

@functools.cache
def _vader():
    # an optional extra (vaderSentiment, in ppoforge[lm]): imported when the vader reward first scores
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    return SentimentIntensityAnalyzer()


def vader_sentiment(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
    """VADER compound sentiment of each completion, in [-1, 1] (0 for text without sentiment)."""
    return [_vader().polarity_scores(c)["compound"] for c in completions]


def length_reward(target: int) -> RewardFn:
    """-|words - target| / target: 0 at exactly `target` whitespace-separated words, -1 at 0 or 2x."""
    if target < 1:
        raise UserError(f"reward length:{target}: target out of range; allowed: an integer >= 1")

    def length(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
        return [-abs(len(c.split()) - target) / target for c in completions]

    return length


def format_reward(pattern: str) -> RewardFn:
    """1.0 when `re.search(pattern, completion)` finds a match, else 0.0 (anchor with ^ and $)."""
    try:
        regex = re.compile(pattern)
    except re.error as e:
        raise UserError(f"reward format:{pattern}: invalid regular expression ({e}); allowed: a Python regular "
                        "expression, e.g. format:^Answer: [0-9]+$") from None

    def format_match(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
        return [1.0 if regex.search(c) else 0.0 for c in completions]

    return format_match


def missing_eos_penalty(penalty: float) -> RewardFn:
    """-penalty for completions cut off by the length limit (finished False), 0 for the rest."""

    def eos_penalty(prompts: list[str], completions: list[str], finished: list[bool],
                    **kwargs) -> list[float]:
        return [0.0 if done else -penalty for done in finished]

    return eos_penalty


class RewardModelScorer:
    """A scalar reward model (`AutoModelForSequenceClassification`, 1 label) as a reward function.

    Each (prompt, completion) is tokenized as the reward model was trained to read it
    (`examples.reward_input_ids`: the chat template's conversation, a text pair for encoders, else
    concatenation), then scored in right-padded batches: every text starts at position 0 as it would
    alone, which absolute-position models (GPT-2, BERT-style encoders that pool their first token)
    need — left-padded, a GPT-2 reward model scored the same text 0.056 alone and 0.106 beside a longer
    one. Causal-LM classifiers find the last real token from the pad token themselves.
    With `share_prefix` a causal model with a `score` head scores k consecutive texts as one row, the
    tokens they begin with once (`rows.branch_rows`: a GRPO group's prompt, a chat template's header), each
    score read at its text's last token; k (1: padded rows) is the one whose rows cost least
    (`rows.branch_work`), per call — 1 when a text is longer than a windowed model's window (`windows.py`).
    """

    def __init__(self, name_or_path: str, tokenizer=None, device="cpu", dtype: torch.dtype = torch.float32,
                 batch_size: int = 8, attn_implementation: str | None = None, share_prefix: bool = False):
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(name_or_path)
        self.model = load_reward_model(name_or_path, dtype=dtype, device=device, tokenizer=self.tokenizer,
                                       attn_implementation=attn_implementation)
        self.device = device
        self.batch_size = batch_size
        self.head = getattr(self.model, "score", None)
        self.share = share_prefix and self.head is not None and is_causal(self.model.config.model_type)
        self.cost = attention_cost(self.model.config) if self.share else 0.0
        # branch rows' tree mask is one 4D mask for every layer: exact for a windowed model only while each
        # text fits its window; longer texts go right-padded, through the model's own per-layer masks
        self.window = attention_window(self.model.config)

    def input_ids(self, prompts: list[str], completions: list[str]) -> list[list[int]]:
        return [reward_input_ids(self.tokenizer, p, c) for p, c in zip(prompts, completions, strict=True)]

    def group_size(self, rows: list[list[int]]) -> int:
        """The k of 1, 2, 4, ... (dividing batch_size) whose rows cost least over all batches of `rows`."""
        fits = self.window is None or max(map(len, rows), default=0) <= self.window
        sizes = [k for k in range(1, self.batch_size + 1) if self.batch_size % k == 0] if self.share and fits else [1]
        batches = [rows[i:i + self.batch_size] for i in range(0, len(rows), self.batch_size)]

        def work(k: int) -> float:
            if k == 1:
                return sum(len(b) * (w + self.cost * w * w) for b in batches for w in [max(map(len, b))])
            return sum(branch_work([b[j:j + k] for j in range(0, len(b), k)], self.cost) for b in batches)

        return min(sizes, key=work)

    @torch.inference_mode()
    def __call__(self, prompts: list[str], completions: list[str], **kwargs) -> list[float]:
        rows, scores = self.input_ids(prompts, completions), []
        k = self.group_size(rows)
        for i in range(0, len(rows), self.batch_size):
            part = rows[i:i + self.batch_size]
            if k > 1:
                br = branch_rows([part[j:j + k] for j in range(0, len(part), k)], self.tokenizer.pad_token_id,
                                 self.device)
                backbone = getattr(self.model, self.model.base_model_prefix)
                hidden = backbone(**br.inputs(backbone)).last_hidden_state
                scores += self.head(hidden.flatten(0, 1)[br.last])[:, 0].float().tolist()
                continue
            ids, mask = right_pad(part, self.tokenizer.pad_token_id, self.device)
            scores += self.model(input_ids=ids, attention_mask=mask).logits[:, 0].float().tolist()  # (b,)
        return scores


class WeightedSum:
    """sum_i weight_i * reward_i, each term checked by `score` so errors name the failing term. The terms'
    unweighted values of the last call stay in `last_terms` (by `metric_names`) for TRL's per-reward
    metrics, `rewards/<name>/mean` and `/std` (`term_metrics`)."""

    def __init__(self, terms: Sequence[tuple[str, RewardFn, float]]):
        names = [name for name, _, _ in terms]
        if not names:
            raise UserError(f"reward: no reward terms; allowed: one or more of {ALLOWED_SPECS}")
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise UserError(f"reward: {twice[0]} appears more than once; allowed: each reward once "
                            "(scale it with its weight)")
        self.terms = list(terms)
        self.metric_names = _unique([_metric_name(name) for name in names])
        self.last_terms: dict[str, list[float]] = {}

    def term_values(self, prompts: list[str], completions: list[str], **row_fields) -> dict[str, list[float]]:
        """Each term's unweighted rewards, by name (for per-term metrics)."""
        return {name: _checked(fn, name, prompts, completions, row_fields) for name, fn, _ in self.terms}

    def __call__(self, prompts: list[str], completions: list[str], **row_fields) -> list[float]:
        values = self.term_values(prompts, completions, **row_fields)
        self.last_terms = dict(zip(self.metric_names, values.values(), strict=True))
        total = [0.0] * len(completions)
        for (_, _, weight), term in zip(self.terms, values.values(), strict=True):
            total = [t + weight * v for t, v in zip(total, term, strict=True)]
        return total


def _metric_name(item: str) -> str:
    """A reward term's name in metric keys, as TRL names a reward function: `py:mod:fn` -> fn, `eos_penalty:1`
    -> eos_penalty, `model:PATH` -> model (no path separators in a TensorBoard tag)."""
    kind, _, rest = item.partition(":")
    return rest.rpartition(":")[2] if kind == "py" else kind


def _unique(names: list[str]) -> list[str]:
    """Names made unique by a suffix: two reward models are model and model_2."""
    out, seen = [], {}
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return out


def term_metrics(terms: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """TRL's per-reward-function metrics over a rollout: `rewards/<name>/mean` and `rewards/<name>/std`
    (unbiased, TRL's nanstd; 0 for one value) of each term's unweighted rewards."""
    out = {}
    for name, x in terms.items():
        out[f"rewards/{name}/mean"] = x.mean()
        out[f"rewards/{name}/std"] = x.std() if x.numel() > 1 else torch.zeros((), device=x.device)
    return out


# ---- validation ---------------------------------------------------------------------------------------

def _describe(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _checked(fn: RewardFn, name: str, prompts: list[str], completions: list[str],
             kwargs: dict) -> list[float]:
    """Call `fn` and return its rewards as floats, or raise a one-line UserError naming `name` (the time
    limit is the trainer's, around the whole reward)."""
    out = call_user(lambda: fn(prompts, completions, **kwargs), f"reward {name}")
    allowed = f"allowed: a list of {len(completions)} numbers, one per completion"
    if not isinstance(out, (list, tuple)):
        raise UserError(f"reward {name} returned {_describe(out)}; {allowed}")
    if len(out) != len(completions):
        raise UserError(f"reward {name} returned {len(out)} values for {len(completions)} completions; "
                        f"{allowed}")
    values = []
    for i, v in enumerate(out):
        if not isinstance(v, numbers.Real):
            raise UserError(f"reward {name} returned {_describe(v)} at index {i}; {allowed}")
        try:
            values.append(float(v))
        except OverflowError:  # an int beyond float's range: the reward returned it, it did not raise
            digits = f" (an integer of {len(str(abs(v)))} digits)" if isinstance(v, int) and abs(v) < 10 ** 4000 else ""
            raise UserError(f"reward {name} returned a number too large for float{digits} at index {i}; "
                            "allowed: finite numbers") from None
    return values


def score(fn: RewardFn, name: str, prompts: list[str], completions: list[str], finished: list[bool],
          rows: list[dict]) -> torch.Tensor:
    """Validated rewards, float32 of shape (B,); `rows` are the prompt rows, passed on as columns."""
    columns = {k: [row[k] for row in rows] for k in (rows[0] if rows else {}) if k not in _POSITIONAL}
    values = _checked(fn, name, prompts, completions, {**columns, "finished": list(finished)})
    return torch.tensor(values, dtype=torch.float32)  # (B,)  # cpu: user floats; callers .to(device)


# ---- specs -------------------------------------------------------------------------------------------


def _number(item: str, text: str, kind: type):
    """`text` as an int or a finite float, or a UserError naming `item`."""
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value):
        what = "an integer" if kind is int else "a finite number"
        example = "1,0.5 (one per reward)" if item == "weights" else f"{item.split(':')[0]}:{4 if kind is int else 0.5}"
        raise UserError(f"reward {item}: {text!r} is not {what}; allowed: {what}, e.g. {example}")
    return value


def _build_one(item: str, device, policy_tokenizer, model_kwargs: dict, call_timeout: float | None) -> RewardFn:
    kind, _, arg = item.partition(":")
    if item == "vader":
        return vader_sentiment
    if item == "task":  # reasoning-gym's checker of each row's task (lm/data/tasks.py)
        return task_reward
    if kind == "length" and arg:
        return length_reward(_number(item, arg, int))
    if kind == "format" and arg:
        return format_reward(arg)
    if kind == "eos_penalty" and arg:
        return missing_eos_penalty(_number(item, arg, float))
    if kind == "model" and arg:
        # a checkpoint saved without its tokenizer shares the policy's (what TRL's PPO always assumed)
        tokenizer = None if has_tokenizer_files(arg) else policy_tokenizer
        return RewardModelScorer(arg, tokenizer=tokenizer, device=device, **model_kwargs)
    if kind == "py" and arg:
        return load_python(arg, timeout=call_timeout)
    raise UserError(f"reward: unknown item {item!r}; allowed: {ALLOWED_SPECS} (comma-separated)")


def split_spec(spec: str) -> list[str]:
    """Split on commas that start a new item, so `format:a{1,3}` keeps its comma."""
    parts = re.split(r",\s*(?=(?:vader|task)\s*(?:,|$)|(?:length|format|eos_penalty|model|py):)", spec.strip())
    return [p.strip() for p in parts]


def build_reward(spec: str, weights: str | None = None, device="cpu", policy_tokenizer=None,
                 call_timeout: float | None = None, **model_kwargs) -> WeightedSum:
    """The reward described by `spec` (e.g. "vader,eos_penalty:1") with optional weights ("1,0.5").

    A reward model folder without tokenizer files uses `policy_tokenizer`; `py:` modules are imported
    under `call_timeout` seconds. `model_kwargs` (dtype, attn_implementation) go to the reward models'
    loader."""
    items = split_spec(spec)
    return WeightedSum([(item, _build_one(item, device, policy_tokenizer, model_kwargs, call_timeout), w)
                        for item, w in zip(items, parse_weights(weights, items), strict=True)])


def parse_weights(weights: str | None, names: list[str]) -> list[float]:
    """`reward_weights` ("1,0.5"): one weight per reward named in `names`; None: all 1."""
    if weights is None:
        return [1.0] * len(names)
    ws = [_number("weights", w.strip(), float) for w in weights.split(",")]
    if len(ws) != len(names):
        raise UserError(f"reward weights: {len(ws)} weights for {len(names)} rewards "
                        f"({', '.join(names)}); allowed: one weight per reward, comma-separated")
    return ws
