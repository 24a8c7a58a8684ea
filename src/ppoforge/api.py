"""The Python API, TRL-shaped: `RLHFTrainer(model=..., reward_funcs=[fn], train_dataset=[...],
args=RLHFConfig(...)).train()`, and `SFTTrainer`, `RewardTrainer`, `ControlTrainer` alike (`ppoforge.X`
imports them lazily: `import ppoforge` loads no torch).

Each runs what `ppoforge train ...` runs, nothing of its own: the config is checked when it is built
(`config.Validated`, the CLI's one-line UserError), the run dir is held and a used one refused
(`runtime/rundir.py`) from construction to the end of the run, and `train()` is the trainer's own run —
config.yaml, metrics.jsonl, TensorBoard, checkpoints, the export. What the CLI names by a string is
accepted as a Python object and turned into what the CLI would have: rows (a list of strings or dicts, a
`datasets.Dataset`) are written into the run dir as JSON lines that the config then names (`runtime/trust.py`
fingerprints them, a CLI resume reads them); reward callables become the trainer's `reward_fn` (config.yaml's
`reward` says `python:` and their names, which a CLI resume refuses in one line); an already-loaded model and
tokenizer are copied in (`lm/models/loading.finish_loaded_*`) in place of loading `model`, never written to disk.

`RLHFTrainer` is the RLHF loop itself (`lm/rl/trainer.RLHFTrainer`) with this constructor and `save_pretrained()`;
the other three hold their loops (`lm/supervised/loop.SupervisedTrainer`, `control/trainer.ControlTrainer`) as
`loop`. All four `step()` and `train()` through `RunSteps`: the loop's run pieces (`runtime/runloop.py`), one update
at a time or to the end, each update through `runtime/resilience.run_update` as in the CLI's loop. Left out:
resuming from Python (`ppoforge train ... --resume RUN` continues these run dirs, but for callable rewards).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import weakref
from pathlib import Path

import torch

from ppoforge.control import trainer as control
from ppoforge.control.config import ControlConfig
from ppoforge.control.evaluate import evaluate
from ppoforge.errors import UserError
from ppoforge.lm.models import memplan
from ppoforge.lm.models.loading import check_loaded_lm, check_loaded_reward_model
from ppoforge.lm.rl import trainer as rl
from ppoforge.lm.rl.config import RLHFConfig
from ppoforge.lm.rl.rewards import WeightedSum, parse_weights
from ppoforge.lm.supervised import reward_model, sft
from ppoforge.lm.supervised.config import RewardConfig, SFTConfig
from ppoforge.lm.supervised.loop import SupervisedTrainer
from ppoforge.runtime import rundir, runloop
from ppoforge.runtime.device import resolve_device

RUNS_ROOT = "runs"  # where a trainer without output_dir makes its run dir, as the CLI's --runs-root
ROWS_ALLOWED = "a list of strings (prompts) or dicts, a datasets.Dataset, or a file / datasets name"


class RunDir:
    """The run dir a public trainer holds (`rundir.hold`) from its construction to the end of `train()` or
    `close()`: `output_dir`, else a new runs/NAME-STAMP; a folder holding a run is refused unless `overwrite`."""

    def __init__(self, output_dir: str | Path | None, name: str, overwrite: bool):
        self.path = Path(output_dir) if output_dir is not None else rundir.new_run_dir(RUNS_ROOT, name)
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(rundir.hold(self.path))
        self._release = weakref.finalize(self, self._stack.close)  # a trainer dropped unclosed lets go of it too
        try:
            rundir.prepare_new_run_dir(self.path, overwrite)
        except BaseException:
            self.close()
            raise

    def rows(self, rows, name: str, what: str, text_field: str | None = None) -> str:
        """`rows` as a source the config names: a str (a file or datasets name) as it is, else JSON lines
        written to RUN/name (strings become {text_field: s} where `text_field` is given)."""
        if isinstance(rows, (str, Path)):
            return str(rows)
        out = []
        for i, row in enumerate(rows):
            if isinstance(row, str) and text_field:
                row = {text_field: row}
            if not isinstance(row, dict):
                raise UserError(f"{what}: row {i + 1} is a {type(row).__name__}; allowed: {ROWS_ALLOWED}")
            try:
                out.append(json.dumps(row) + "\n")
            except (TypeError, ValueError) as e:
                raise UserError(f"{what}: row {i + 1} cannot be written as JSON ({e}); allowed: rows of strings, "
                                "numbers, lists and dicts") from None
        rundir.atomic_write_text(self.path / name, "".join(out))
        return str(self.path / name)

    def close(self) -> None:
        self._release()


def reward_fields(reward_funcs, weights: str | None) -> tuple[object, dict]:
    """(reward_fn or None, config fields): spec strings go to `reward`; callables
    `fn(prompts, completions, *, finished, **row_fields) -> list[float]` become one reward_fn (a weighted sum
    of several, `reward_weights`) and config.yaml's reward says `python:` with their names."""
    if reward_funcs is None:
        return None, {}
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if funcs and all(isinstance(f, str) for f in funcs):
        return None, {"reward": ",".join(funcs)}
    if not funcs or not all(callable(f) for f in funcs):
        raise UserError("reward_funcs: a mix of reward specs and callables, or neither; allowed: callables "
                        "fn(prompts, completions, *, finished, **row_fields) -> list[float], or reward specs "
                        "(strings: vader, length:N, model:PATH, ...)")
    names = [getattr(f, "__name__", type(f).__name__) for f in funcs]
    names = [n if names.count(n) == 1 else f"{n}#{i + 1}" for i, n in enumerate(names)]
    fn = funcs[0] if len(funcs) == 1 and weights is None else WeightedSum(
        list(zip(names, funcs, parse_weights(weights, names), strict=True)))
    return fn, {"reward": "python:" + ",".join(names)}


def model_fields(model, tokenizer, check) -> tuple[dict, object, object]:
    """(config fields, the loaded model or None, the loaded tokenizer or None) of `model=` / `tokenizer=`: a
    path or hub id is a config field, an object is handed to the trainer (config.yaml names its name_or_path)
    once `check(model)` (`loading.check_loaded_lm` ...) took it, before any run dir is made."""
    fields, loaded = {}, None
    if isinstance(tokenizer, (str, Path)):
        fields["tokenizer"], tokenizer = str(tokenizer), None
    if isinstance(model, (str, Path)):
        fields["model"] = str(model)
    elif model is not None:
        check(model)
        loaded, fields["model"] = model, str(getattr(model, "name_or_path", "") or "")
        if not fields["model"] and tokenizer is None and "tokenizer" not in fields:
            raise UserError("tokenizer: required with a model that has no name_or_path (nothing to load its "
                            "tokenizer from); allowed: tokenizer=a transformers tokenizer or its path")
        fields["model"] = fields["model"] or "in-memory"
    return fields, loaded, tokenizer


def floats(metrics: dict | None) -> dict[str, float]:
    """An update's metrics as step() returns them: plain floats ({} for none)."""
    return {k: float(v) for k, v in (metrics or {}).items()}


class RunSteps:
    """A public trainer's `step()` and `train()` over its loop (`runloop.Loop`) and run dir: the first step() opens
    the run (its logs, the evaluation before training), the last one ends it as train() does (the export, the
    summary, the curves) and lets go of the run dir; train() after step()s goes on from there. Past the end: one
    line naming `field`, the config field that sets the run's length in `unit`s."""

    def __init__(self, hold: RunDir, total: int, checkpoint_every: int, field: str, unit: str):
        self.hold, self.total, self.checkpoint_every, self.field, self.unit = hold, total, checkpoint_every, field, unit
        self.open = False  # has a step() opened the run's logs

    def step(self, loop):
        """One update (`runloop.step`): what the loop's update returned, None when a stop signal came before it
        completed (then, as from the CLI, `ppoforge train ... --resume RUN` finishes the run)."""
        self._check_left(loop)
        if not self.open:
            loop.open_run()
            self.open = True
        result, stopped = runloop.step(loop, self.total, self.checkpoint_every)
        if loop.update == self.total and not stopped:  # the run's end, as train()'s
            self.open = False
            try:
                runloop.end(loop, None, finished=True)
                loop.plot()
            finally:
                self.hold.close()
        return result

    def train(self, loop):
        """The rest of the run (`runloop.run`), its curves drawn; the run dir let go of at the end."""
        self._check_left(loop)
        if self.open:  # step()s opened the logs: the run opens them again, as a resume would
            loop.close_run()
            self.open = False
        try:
            result = runloop.run(loop, self.total, self.checkpoint_every)
            loop.plot()
            return result
        finally:
            self.hold.close()

    def _check_left(self, loop) -> None:
        if loop.update >= self.total:
            raise UserError(f"{self.field}: the run has done its {self.total} {self.unit}s; allowed: a new trainer, "
                            f"or a larger {self.field}")


class RLHFTrainer(rl.RLHFTrainer):
    """PPO, GRPO, RLOO and REINFORCE++ (`args.advantage`) for a causal LM, as `ppoforge train rlhf`.

    `model`: a path, hub id or built-in name, or an already-loaded transformers causal LM (copied; pass its
    `tokenizer` too unless its name_or_path has one). `reward_funcs`: a callable or a list of them (summed, with
    `args.reward_weights`), or reward specs. `train_dataset` / `eval_dataset`: prompts (strings, or dicts with
    `args.prompt_field` and any columns the rewards read) for training / held-out evaluation. `output_dir`: the
    run dir (default runs/rlhf-LAYOUT-sSEED-STAMP)."""

    def __init__(self, model=None, reward_funcs=None, train_dataset=None, args: RLHFConfig | None = None, *,
                 eval_dataset=None, tokenizer=None, output_dir: str | Path | None = None, overwrite: bool = False):
        args = args if args is not None else RLHFConfig()
        fields, loaded, tokenizer = model_fields(model, tokenizer, check_loaded_lm)
        reward_fn, more = reward_fields(reward_funcs, args.reward_weights)
        self.hold = RunDir(output_dir, f"rlhf-{args.layout}-s{args.seed}", overwrite)
        try:
            if train_dataset is not None:
                fields["prompts"] = self.hold.rows(train_dataset, "prompts.jsonl", "train_dataset", args.prompt_field)
            if eval_dataset is not None:
                fields["heldout_prompts"] = self.hold.rows(eval_dataset, "heldout_prompts.jsonl", "eval_dataset",
                                                          args.prompt_field)
            cfg = dataclasses.replace(args, **fields, **more)  # checked again, as a whole
            if loaded is None:  # the CLI's memory check (CUDA only): a run that cannot fit is refused first
                memplan.check_fits(cfg, "rlhf", resolve_device(cfg.device))
            super().__init__(cfg, self.hold.path, reward_fn, loaded, tokenizer)
        except BaseException:
            self.hold.close()
            raise
        self.stepping = RunSteps(self.hold, self.cfg.total_updates, self.cfg.checkpoint_every, "total_updates",
                                 "update")

    def train(self) -> rl.TrainResult:
        """Train to `total_updates` (or a stop signal: the last update checkpointed) exactly as the CLI does;
        after step()s it goes on from there. Returns run_dir, updates, episodes, last_metrics, stopped_by."""
        return self.stepping.train(self)

    def step(self) -> dict[str, float]:
        """One update, as one turn of the CLI's loop (`run_update`): its metrics line, completions and
        checkpoint (every `checkpoint_every` updates and at the last) written to the run dir; after the last
        update the held-out evaluation and the export (not when a stop signal came: then, as the CLI,
        `ppoforge train rlhf --resume RUN` finishes it). Returns the update's metrics; {} when a stop signal ended
        it before any update completed (after a rollback the retried update's)."""
        result = self.stepping.step(self)
        return floats(result[0]) if result else {}  # an update returns (metrics, completions)

    def save_pretrained(self, path: str | Path, adapter_only: bool = False) -> Path:
        """The policy as Hugging Face loads it, with its tokenizer: base + LoRA adapter merged in fp32
        (`AutoModelForCausalLM.from_pretrained(path)`), or with `adapter_only` the adapter alone
        (`peft.PeftModel.from_pretrained(base, path)`). The full layout has no adapter: the whole policy."""
        if adapter_only and self.cfg.layout == "full":
            raise UserError("adapter_only: the full layout trains every weight, there is no adapter; allowed: "
                            "adapter_only=False, or layout lora")
        return self.layout.export(Path(path), "adapter" if adapter_only else "merged", torch.float32, self.tokenizer)


class _Supervised:
    """SFT and reward-model training from Python: `ppoforge train sft|reward` with rows (and, if you like, the model
    and tokenizer) as Python objects. `loop` is the run's `lm/supervised/loop.SupervisedTrainer`, built here."""

    config: type
    name: str
    objective: type
    check_loaded = staticmethod(check_loaded_lm)

    def __init__(self, model=None, train_dataset=None, args=None, *, eval_dataset=None, tokenizer=None,
                 output_dir: str | Path | None = None, overwrite: bool = False):
        args = args if args is not None else self.config()
        fields, loaded, tokenizer = model_fields(model, tokenizer, self.check_loaded)
        self.hold = RunDir(output_dir, f"{self.name}-{args.layout}-s{args.seed}", overwrite)
        try:
            if train_dataset is not None:
                fields["data"] = self.hold.rows(train_dataset, "train_data.jsonl", "train_dataset")
            if eval_dataset is not None:
                fields["eval_data"] = self.hold.rows(eval_dataset, "eval_data.jsonl", "eval_dataset")
            self.cfg = dataclasses.replace(args, **fields)
            self.cfg.check_data()
            if loaded is None:  # the CLI's memory check (CUDA only): a run that cannot fit is refused first
                memplan.check_fits(self.cfg, self.name, resolve_device(self.cfg.device))
            self.loop = SupervisedTrainer(self.cfg, self.hold.path,
                                          self.objective(self.cfg, self.hold.path, loaded, tokenizer))
        except BaseException:
            self.hold.close()
            raise
        self.stepping = RunSteps(self.hold, self.loop.total_steps, self.cfg.checkpoint_every,
                                 "max_steps" if self.cfg.max_steps else "epochs", "step")

    def train(self) -> dict:
        """Train to the end (or a stop signal) exactly as the CLI does; the model is exported to RUN/model. After
        step()s it goes on from there. Returns the last metrics with `steps`, `stopped_by` and `export`."""
        return self.stepping.train(self.loop)

    def step(self) -> dict[str, float]:
        """One optimizer step (the unit `max_steps` counts), as one turn of the CLI's loop: its metrics line, the
        evaluation every `eval_every` steps, a checkpoint every `checkpoint_every`; after the last step the export.
        Returns the step's metrics (eval/ ones included when it evaluated); {} when a stop signal came first."""
        return floats(self.stepping.step(self.loop))


class SFTTrainer(_Supervised):
    """Supervised fine-tuning of a causal LM, as `ppoforge train sft`: `train_dataset` rows with `messages`
    (chat turns), or `prompt` and `completion`; the loss on the assistant / completion tokens only. `model`: a
    path, hub id or built-in name, or a transformers causal LM already loaded (copied: yours is left as it is)."""

    config, name, objective = SFTConfig, "sft", sft.SFTObjective


class RewardTrainer(_Supervised):
    """A scalar reward model from preference pairs, as `ppoforge train reward`: `train_dataset` rows with
    `prompt`, `chosen`, `rejected` (and an optional `margin`); Bradley-Terry loss. `model`: a path, hub id or
    built-in name, or an `AutoModelForSequenceClassification` with num_labels=1 already loaded (copied)."""

    config, name, objective = RewardConfig, "reward", reward_model.RewardObjective
    check_loaded = staticmethod(check_loaded_reward_model)


class ControlTrainer:
    """PPO for a gymnasium environment, as `ppoforge train control`: `env` (an id, default args.env_id). `loop` is
    the run's `control/trainer.ControlTrainer`, built here (its environments made, its agent initialized)."""

    def __init__(self, env: str | None = None, args: ControlConfig | None = None, *,
                 output_dir: str | Path | None = None, overwrite: bool = False):
        args = args if args is not None else ControlConfig()
        self.cfg = dataclasses.replace(args, env_id=env) if env is not None else args
        self.hold = RunDir(output_dir, f"{self.cfg.env_id}-s{self.cfg.seed}", overwrite)
        try:
            self.loop = control.ControlTrainer(self.cfg, self.hold.path)
        except BaseException:
            self.hold.close()
            raise
        self.stepping = RunSteps(self.hold, self.cfg.num_updates, self.cfg.checkpoint_every, "total_steps", "update")

    def train(self) -> control.TrainResult:
        """Train to total_steps (or a stop signal) exactly as the CLI does, the learning curve drawn; after step()s
        it goes on from there. Returns run_dir, global_step, updates, recent_returns, stopped_by."""
        return self.stepping.train(self.loop)

    def step(self) -> dict[str, float]:
        """One PPO update (a rollout of num_steps x num_envs environment steps, then the update epochs), as one
        turn of the CLI's loop: its metrics line, a checkpoint every `checkpoint_every` updates and at the last
        (then the learning curve too). Returns its metrics; {} when a stop signal came first."""
        return floats(self.stepping.step(self.loop))

    def evaluate(self, episodes: int = 10) -> dict[str, list[float]]:
        """`ppoforge eval RUN`: the saved checkpoint's returns over `episodes` episodes, greedy ("deterministic")
        and sampled actions."""
        return evaluate(self.hold.path, episodes)
