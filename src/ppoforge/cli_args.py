"""The `ppoforge` command's parsers: every subcommand's options, a trainer's built from its config's `param()` fields.

What a user brings from other tools is met here, once, for every subcommand:
- a trainer's options come in sections (GROUPS: model, data, reward, ...), and `--preset NAME --help` (or
  `--config FILE --help`) shows that preset's values as the defaults;
- `--learning_rate` is `--learning-rate` (underscores, TRL's spelling, for every option), and TRL's names for
  the same quantities are accepted (TRL_NAMES); a TRL name whose meaning differs is refused with the options
  that do its job (TRL_DIFFERENT), never mapped to something else;
- no abbreviations (`--num-gen 4` is refused: allow_abbrev=False), and an unknown option is one line with the
  nearest known one ("unknown option --lerning-rate; did you mean --learning-rate?", exit 2).
The command functions are cli.py's; `build_parser(handlers)` sets each subcommand's from that table.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
import typing
from importlib import metadata

from ppoforge import __version__
from ppoforge.config import base_type, list_presets, preset_values
from ppoforge.control.config import ControlConfig
from ppoforge.doctor.report import CAPABILITY_KEYS, DEFAULT_REQUIRE
from ppoforge.errors import UserError
from ppoforge.lm.rl.config import RLHFConfig
from ppoforge.lm.supervised.config import RewardConfig, SFTConfig
from ppoforge.runtime.precision import PRECISION_CHOICES

TRAINERS = {"control": ControlConfig, "rlhf": RLHFConfig, "sft": SFTConfig, "reward": RewardConfig}
PLAN_KINDS = {"rlhf": RLHFConfig, "sft": SFTConfig, "reward": RewardConfig}
RUN_NAMES = {"control": "<env>-s<seed>-<time>", "rlhf": "rlhf-<layout>-s<seed>-<time>",
             "sft": "sft-<layout>-s<seed>-<time>", "reward": "reward-<layout>-s<seed>-<time>"}
DEMO_PRESETS = {"sentiment": "demo", "arithmetic": "arithmetic_demo"}  # `demo --task` -> its preset (configs/rlhf/)
TRAIN_HELP = {"control": "PPO on a gymnasium control task", "rlhf": "PPO RLHF of a causal LM against a reward",
              "sft": "supervised fine-tuning of a causal LM (loss on completions)",
              "reward": "a reward model from preference pairs (Bradley-Terry)"}

# The --help section of every config field, one table for the four trainers (a field name means one thing in
# all of them); tests/test_cli_args.py fails when a field is in no section or in two.
FIELD_GROUPS = {
    "model": ("model", "tokenizer", "layout", "lora_r", "lora_alpha", "lora_target_modules", "critic_model",
              "hidden_size", "lm_head_fp32", "export", "export_dtype"),
    "data": ("prompts", "prompt_field", "heldout_prompts", "heldout_fraction", "heldout_disjoint", "use_chat_template",
             "data", "data_split", "eval_data", "eval_fraction", "max_length", "strict", "packing", "env_id", "env",
             "max_turns", "max_episode_tokens", "max_env_tokens", "env_overflow", "end_check"),
    "reward": ("reward", "reward_weights", "reward_clip", "center_coef", "use_margin", "normalize_reward",
               "clip_reward", "overlong_buffer", "overlong_penalty"),
    "sampling": ("max_prompt_tokens", "max_new_tokens", "temperature", "top_k", "top_p", "stop_tokens",
                 "num_generations", "shared_prefix", "dynamic_sampling", "dynamic_sampling_tries",
                 "num_envs", "num_steps", "normalize_obs", "clip_obs", "rollout_engine", "vllm_gpu_memory_utilization",
                 "vllm_sleep", "vllm_lora_sync"),
    "algorithm": ("advantage", "policy_loss", "gamma", "lam", "gae_lambda", "clip", "clip_high", "clip_coef",
                  "value_clip", "clip_vloss", "vf_coef", "ent_coef", "kl_coef", "kl_estimator", "kl_target",
                  "kl_horizon", "kl_in", "scale_rewards", "loss_agg", "whiten_rewards", "mask_truncated",
                  "skip_flat_rollouts", "old_logprobs", "norm_adv", "target_kl", "vllm_is_correction", "vllm_is_cap"),
    "optimization": ("total_updates", "total_steps", "epochs", "max_steps", "batch_size", "mini_batch_size",
                     "micro_batch_size", "ppo_epochs", "update_epochs", "num_minibatches", "learning_rate",
                     "anneal_lr", "warmup_ratio", "weight_decay", "max_grad_norm", "seed", "precision",
                     "gradient_checkpointing", "attn_implementation", "hand_gradients"),
    "distributed": ("device", "torch_threads", "fsdp", "dist_timeout"),
    "faults": ("nonfinite_patience", "nonfinite_action", "rollback_lr_factor", "max_rollbacks", "call_timeout",
               "collapse_patience", "collapse_action", "rollout_timeout", "sync_timeout"),
    "logging": ("heldout_every", "heldout_samples", "eval_every", "sample_prompts", "sample_tokens",
                "checkpoint_every", "log_every", "tensorboard", "report_to", "progress"),
}

# TRL's (transformers TrainingArguments') names for the same quantity, per trainer (dashes: underscores are
# respelled first). Each was checked against TRL's docs: the same unit and the same effect.
_SUPERVISED_NAMES = {"--output-dir": "--run-dir", "--num-train-epochs": "--epochs",
                     "--save-steps": "--checkpoint-every", "--eval-steps": "--eval-every",
                     "--logging-steps": "--log-every"}
TRL_NAMES = {
    "control": {"--output-dir": "--run-dir"},
    "rlhf": {"--output-dir": "--run-dir", "--max-completion-length": "--max-new-tokens",
             "--max-prompt-length": "--max-prompt-tokens",  # TRL cuts the prompt from the left, as we do
             "--epsilon": "--clip", "--epsilon-high": "--clip-high", "--num-iterations": "--ppo-epochs",
             "--mask-truncated-completions": "--mask-truncated",
             # TRL's PPOConfig
             "--cliprange": "--clip", "--cliprange-value": "--value-clip", "--num-ppo-epochs": "--ppo-epochs",
             "--response-length": "--max-new-tokens"},
    "sft": _SUPERVISED_NAMES, "reward": _SUPERVISED_NAMES,
}
# TRL names whose meaning differs here: refused in one line saying what to use instead, never mapped
_PER_DEVICE = ("is part of TRL's batch (per_device_train_batch_size x gradient_accumulation_steps x GPUs examples per "
               "optimizer step); here --batch-size is that whole number; allowed: --batch-size, and "
               "--micro-batch-size for the examples per forward")
_RLHF_BATCH = ("is part of TRL's batch, counted in completions; here --batch-size counts prompts per rollout (each "
               "sampled --num-generations times); allowed: --batch-size, --mini-batch-size (responses per optimizer "
               "step) and --micro-batch-size (responses per forward)")
TRL_DIFFERENT = {
    "sft": {"--per-device-train-batch-size": _PER_DEVICE, "--gradient-accumulation-steps": _PER_DEVICE},
    "reward": {"--per-device-train-batch-size": _PER_DEVICE, "--gradient-accumulation-steps": _PER_DEVICE},
    "rlhf": {"--per-device-train-batch-size": _RLHF_BATCH, "--gradient-accumulation-steps": _RLHF_BATCH,
             "--max-steps": "counts TRL's optimizer steps; here a run is counted in updates (a rollout, then "
                            "ppo_epochs x its mini-batches of optimizer steps); allowed: --total-updates",
             "--num-train-epochs": "is TRL's passes over the prompts; allowed: --total-updates (rollouts of "
                                   "--batch-size prompts)",
             "--beta": "is TRL's KL coefficient in the loss; here the KL goes in the reward by default; allowed: "
                       "--kl-coef (with --kl-in loss for TRL's placement)"},
}


class Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (exit 2), no abbreviations, underscore and TRL spellings, and the
    nearest known option for an unknown one. `domain` names a trainer parser's config (TRL names, presets)."""

    def __init__(self, *args, domain: str | None = None, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        if domain:  # not every option in the usage line (90 of them filled 45 lines): the sections below list them
            kwargs.setdefault("usage", "%(prog)s [--preset NAME] [--config FILE] [--OPTION VALUE ...]")
        super().__init__(*args, **kwargs)
        self.domain = domain

    def error(self, message: str):
        raise UserError(f"{self.prog}: {message}")

    def parse_known_args(self, args=None, namespace=None):
        if self._subparsers is not None:  # not a leaf: the subcommand's parser reads the options
            return super().parse_known_args(args, namespace)
        args = self._respelled(list(sys.argv[1:] if args is None else args))
        if self.domain and {"-h", "--help"} & set(_before_dashes(args)):
            self._show_preset_defaults(args)
        ns, extras = super().parse_known_args(args, namespace)
        unknown = next((a for a in extras if a.startswith("-") and a != "--"), None)
        if unknown:
            raise UserError(self._unknown(unknown.partition("=")[0]))
        return ns, extras

    def _respelled(self, args: list[str]) -> list[str]:
        """`--learning_rate` -> `--learning-rate`, TRL's names -> ours; refused: a TRL name meant otherwise."""
        known = self._option_string_actions
        out = []
        for i, arg in enumerate(args):
            if arg == "--":
                return out + args[i:]
            name, eq, value = arg.partition("=")
            dashed = name.replace("_", "-")
            if arg.startswith("--") and name not in known:
                if dashed in TRL_DIFFERENT.get(self.domain, {}):
                    raise UserError(f"{name} {TRL_DIFFERENT[self.domain][dashed]}")
                dashed = TRL_NAMES.get(self.domain, {}).get(dashed, dashed)
                arg = dashed + eq + value if dashed in known else arg
            out.append(arg)
        return out

    def _unknown(self, option: str) -> str:
        names = [s for s in self._option_string_actions if s.startswith("--")]
        near = difflib.get_close_matches(option.replace("_", "-"), names, n=1, cutoff=0.6)
        if near:
            return f"unknown option {option}; did you mean {near[0]}?"
        return f"unknown option {option}; allowed: the options `{self.prog} --help` lists"

    def _show_preset_defaults(self, args: list[str]) -> None:
        """`--preset NAME --help`: the help's defaults become the preset's (and a --config file's) values."""
        files = {opt: value for opt, value in zip(args, args[1:], strict=False) if opt in ("--preset", "--config")}
        if not files:
            return
        values = preset_values(files.get("--preset"), files.get("--config"), self.domain)
        source = " + ".join(f"{opt[2:]} {value}" for opt, value in files.items())
        for action in self._actions:
            name = action.dest.removeprefix("cfg.")
            if action.dest.startswith("cfg.") and name in values:
                action.help = _help_text(action.field_meta, f"{values[name]} from {source}")


def _before_dashes(args: list[str]) -> list[str]:
    return args[:args.index("--")] if "--" in args else args


def _help_text(meta: dict, default) -> str:
    extra = f" {{{','.join(map(str, meta['choices']))}}}" if meta["choices"] else ""
    # argparse %-formats help text: a literal % (as in "90% of") must be doubled
    return f"{meta['help']}{extra} (default: {default})".replace("%", "%%")


def field_group(name: str) -> str:
    """The --help section of a config field (config.FIELD_GROUPS); `other` for one not placed yet (a test fails)."""
    return next((group for group, names in FIELD_GROUPS.items() if name in names), "other")


def add_config_arguments(parser: argparse.ArgumentParser, cls) -> None:
    """One `--field-name` option per field, in its section; values stay strings until `build_config` coerces them."""
    fields = dataclasses.fields(cls)
    hints = typing.get_type_hints(cls)
    sections = {}
    for group in [*FIELD_GROUPS, "other"]:
        if any(field_group(f.name) == group for f in fields):
            sections[group] = parser.add_argument_group(f"{group} options")
    for f in fields:
        kind, _ = base_type(hints[f.name])
        action = sections[field_group(f.name)].add_argument(
            f"--{f.name.replace('_', '-')}", dest=f"cfg.{f.name}", default=argparse.SUPPRESS,
            metavar=kind.__name__.upper(), help=_help_text(f.metadata, f.default))
        action.field_meta = f.metadata


def overrides_from_args(args: argparse.Namespace) -> dict:
    return {k.removeprefix("cfg."): v for k, v in vars(args).items() if k.startswith("cfg.")}


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; allowed: an integer >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1; allowed: an integer >= 1")
    return value


def _add_config_files(p: argparse.ArgumentParser, domain: str) -> None:
    p.add_argument("--preset", help=f"built-in preset ({', '.join(list_presets(domain))}) or a YAML file")
    p.add_argument("--config", metavar="FILE", help="a YAML file of config values over the preset's (it may "
                   "name its own base: `preset: grpo`); options on the command line override both")


def _add_print_config(p: argparse.ArgumentParser, sources: str, reader: str) -> None:
    p.add_argument("--print-config", action="store_true", help=f"print the resolved config ({sources}) as YAML, as "
                   f"a run's config.yaml has it, and exit without running; {reader} reads it back")


def _add_train_parser(train_sub, domain: str, handler) -> None:
    p = train_sub.add_parser(domain, help=TRAIN_HELP[domain], domain=domain)
    _add_config_files(p, domain)
    _add_print_config(p, "preset, --config, options", "--config")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its checkpoint; refused "
                   "when the code (py: items) or data files its config names changed since the run started (a check "
                   "against drift, recorded in the run dir itself: not against a run dir someone edited, so resume "
                   "only run dirs you trust)")
    p.add_argument("--trust-run-dir", action="store_true",
                   help="with --resume: go on although the code the run dir's config names (py: items, imported) "
                   "or its data files changed since the run started")
    p.add_argument("--run-dir", help=f"where to write the run (default: RUNS_ROOT/{RUN_NAMES[domain]})")
    p.add_argument("--overwrite", action="store_true", help="replace the run already in --run-dir")
    p.add_argument("--runs-root", default="runs", help="parent folder of new run dirs (default: runs)")
    add_config_arguments(p, TRAINERS[domain])
    p.set_defaults(func=handler)


def _add_plan_parser(sub, handler) -> None:
    plan = sub.add_parser("plan", help="will it fit? a trainer config's memory per phase and the verdict for a "
                          "device, before the run (nothing is loaded: the model is built on the meta device)")
    kinds = plan.add_subparsers(dest="kind", required=True, parser_class=Parser)
    for kind, cls in PLAN_KINDS.items():
        p = kinds.add_parser(kind, help=f"the memory of `ppoforge train {kind}` with these options", domain=kind)
        _add_config_files(p, kind)
        _add_print_config(p, "preset, --config, options; not the device planned for",
                          f"--config (here or of `ppoforge train {kind}`)")
        p.add_argument("--world-size", type=positive_int, default=1,
                       help="GPUs the full layout is sharded over with fsdp (torchrun --nproc_per_node)")
        p.add_argument("--json", action="store_true", help="the plan as JSON")
        add_config_arguments(p, cls)
        p.set_defaults(func=handler)
        for action in p._actions:  # the device to plan for: cpu, cuda, cuda:N or a target such as cuda:80GB
            if action.dest == "cfg.device":
                action.help = ("the device to plan for: cpu (this machine's available memory), cuda or cuda:N "
                               "(the GPU here), or a target such as cuda:24GB, cuda:40GB, cuda:80GB (default: cpu)")


def build_parser(handlers: dict) -> argparse.ArgumentParser:
    """The whole command line; `handlers` maps each command's name (train_rlhf, demo, plan, ...) to its function."""
    parser = Parser(prog="ppoforge", description="PPO that runs: control and RLHF, on CPU or CUDA.")
    parser.add_argument("--version", action="version", help="print ppoforge's version and torch's, and exit",
                        version=f"ppoforge {__version__} (torch {metadata.version('torch')})")  # torch unimported
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    train = sub.add_parser("train", help="train a policy")
    train_sub = train.add_subparsers(dest="domain", required=True, parser_class=Parser)
    for domain in TRAINERS:
        _add_train_parser(train_sub, domain, handlers[f"train_{domain}"])

    demo = sub.add_parser("demo", help="PPO steers SmolLM2-135M-Instruct toward positive sentiment, offline "
                          "(--task arithmetic: GRPO teaches it one-digit sums)", domain="rlhf",
                          usage="%(prog)s [--task NAME] [--OPTION VALUE ...]")
    demo.add_argument("--task", choices=tuple(DEMO_PRESETS), default="sentiment",
                      help="sentiment (default): PPO + VADER, preset demo; arithmetic: GRPO on reasoning-gym "
                      "chain_sum, held-out accuracy before -> after, preset arithmetic_demo (needs ppoforge[tasks])")
    demo.add_argument("--run-dir", help="where to write the run (default: RUNS_ROOT/demo[-TASK]-<time>)")
    demo.add_argument("--runs-root", default="runs", help="parent folder of new run dirs (default: runs)")
    demo.add_argument("--overwrite", action="store_true", help="replace the run already in --run-dir")
    _add_print_config(demo, "the task's preset and options", "`ppoforge train rlhf --config FILE`")
    add_config_arguments(demo, RLHFConfig)
    demo.set_defaults(func=handlers["demo"])

    _add_plan_parser(sub, handlers["plan"])

    pipe = sub.add_parser("pipeline", help="SFT -> reward model -> PPO from one YAML file, resumable per stage")
    pipe.add_argument("config", help=f"a pipeline YAML file or a built-in one ({', '.join(list_presets('pipeline'))})")
    pipe.add_argument("--run-dir", help="where the stages run (default: RUNS_ROOT/pipeline-<config name>); "
                      "rerun with the same one to continue")
    pipe.add_argument("--runs-root", default="runs", help="parent folder of the run dir (default: runs)")
    pipe.add_argument("--trust-run-dir", action="store_true", help="resume stages whose py: code or data files "
                      "changed since they started")
    pipe.set_defaults(func=handlers["pipeline"])

    ev = sub.add_parser("eval", help="evaluate a control run: mean ± std return")
    ev.add_argument("run_dir", help="a run dir written by `ppoforge train control`")
    ev.add_argument("--episodes", type=positive_int, default=20, help="episodes per mode")
    ev.add_argument("--seed", type=int, default=10_000, help="seed of the first evaluation episode")
    ev.set_defaults(func=handlers["eval"])

    _add_doctor_parser(sub, handlers["doctor"])
    _add_notebook_parser(sub, handlers["notebook"])
    return parser


def _add_doctor_parser(sub, handler) -> None:
    doc = sub.add_parser("doctor", help="check this machine: GPU, precision, libraries, storage, security; "
                         "exit 0 when the required capabilities hold")
    doc.add_argument("--quick", action="store_true",
                     help="skip the slow checks (all-reduce, smoke runs, matmul benchmark); for HEALTHCHECK")
    doc.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    doc.add_argument("--device", default="auto", help="device for the smoke runs: auto, cpu, cuda, cuda:N")
    doc.add_argument("--precision", default="fp32", choices=PRECISION_CHOICES,
                     help="precision for the smoke runs (default: fp32)")
    doc.add_argument("--require", default=",".join(DEFAULT_REQUIRE),
                     help="capabilities that decide the exit code, comma-separated: "
                     f"{', '.join(CAPABILITY_KEYS)}, all or none (default: {','.join(DEFAULT_REQUIRE)})")
    doc.add_argument("--runs-root", default="runs", help="the runs/checkpoint dir to check (default: runs)")
    doc.add_argument("--model", help="will this model train here? the memory plan of GRPO (preset grpo) on it "
                     "for the device checked (a directory, hub id or built-in name; only its config is read)")
    doc.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="multi-node: meet the other nodes' doctors "
                     "there (default: MASTER_ADDR:MASTER_PORT when set); run it on every node at once")
    doc.add_argument("--nnodes", type=positive_int, help="multi-node: how many nodes (default: NNODES, "
                     "SLURM_NNODES, else 1)")
    doc.add_argument("--node-rank", type=int, help="multi-node: this node's rank, 0 hosts the rendezvous "
                     "(default: NODE_RANK, SLURM_NODEID, else 0)")
    doc.set_defaults(func=handler)


def _add_notebook_parser(sub, handler) -> None:
    nb = sub.add_parser("notebook", help="JupyterLab with authentication always on, on 127.0.0.1 by default")
    nb.add_argument("--ip", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 warns)")
    nb.add_argument("--port", type=int, default=8888, help="port (default 8888)")
    nb.add_argument("--root-dir", default=".", help="folder the notebook browser starts in (default: .)")
    nb.add_argument("--token-file", help="file holding the token (default: $PPOFORGE_NOTEBOOK_TOKEN_FILE, "
                    "$PPOFORGE_NOTEBOOK_TOKEN, else a new random token printed once)")
    nb.add_argument("--password-hash", help="argon2 hash for password login instead of a token (default: "
                    "$PPOFORGE_NOTEBOOK_PASSWORD_HASH)")
    nb.add_argument("--allow-origin", default="", help="one exact origin allowed to call the API (never '*')")
    nb.add_argument("--allow-root", action="store_true", help="allow running as root (prints a warning)")
    nb.add_argument("jupyter_args", nargs=argparse.REMAINDER, help="after --: more jupyter lab options")
    nb.set_defaults(func=handler)
