"""The `ppoforge` command: parse, build a config, call the library. Nothing else lives here.

  ppoforge train control --preset cartpole --total-steps 200000 --seed 3
  ppoforge train control --resume runs/CartPole-v1-s3-20261129-201500
  ppoforge eval RUN_DIR --episodes 20
  ppoforge demo
  ppoforge demo --task arithmetic           # GRPO on one-digit sums, held-out accuracy before -> after
  ppoforge train rlhf --preset demo --total-updates 40
  ppoforge train rlhf --resume runs/rlhf-lora-s1-20261129-201500
  ppoforge train sft --preset tiny --model PATH --data chats.jsonl
  ppoforge train reward --preset tiny --model PATH --data pairs.jsonl
  ppoforge pipeline demo                     # SFT -> reward model -> PPO, resumable per stage
  ppoforge plan rlhf --preset grpo --model DIR --device cuda:24GB   # will it fit? memory per phase
  ppoforge notebook --port 8888

Every failure ends in one line on stderr: bad input exit code 2, a fault of the environment exit code
1 (see errors.py); `--debug` (anywhere on the line) or PPOFORGE_DEBUG=1 shows the traceback instead.

Imported here: the configs (`--help` lists their fields) and what the commands share. Each command
imports its trainer, evaluator or doctor in its own function (comment "CLI start-up"), so `--help` and
every other command never load transformers, peft, gymnasium or the trainers they do not run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from importlib import resources
from pathlib import Path

import yaml

from ppoforge.cli_args import DEMO_PRESETS, PLAN_KINDS, TRAINERS, build_parser, overrides_from_args
from ppoforge.config import (
    build_config,
    config_to_dict,
    list_presets,
    preset_values,
    read_preset,
    read_saved_config,
    resume_config,
)
from ppoforge.errors import UserError, classify
from ppoforge.notebook import NotebookOptions, launch
from ppoforge.runtime import rundir, trust
from ppoforge.runtime.allocator import keep_freed_memory


def _config_and_run_dir(args, cls, domain: str, run_name) -> tuple[object, Path]:
    """--resume: the run dir's saved config plus the overrides a resume may change, and the code it names
    checked against the code the run started with; else preset plus overrides and a new run dir. Validation
    only: nothing is written here (`_held` then holds the run dir and, for a new run, clears it)."""
    overrides = overrides_from_args(args)
    if args.resume:
        if args.preset or args.config or args.run_dir:
            raise UserError("resume: --preset, --config and --run-dir belong to a new run; allowed with --resume: the "
                            "run dir and the fields a resume may change")
        run_dir = Path(args.resume)
        cfg = resume_config(cls, read_saved_config(run_dir / "config.yaml"), overrides)
        trust.check_resume(run_dir, cfg, args.trust_run_dir)
        return cfg, run_dir
    cfg = build_config(cls, {**preset_values(args.preset, args.config, domain), **overrides})
    run_dir = Path(args.run_dir) if args.run_dir else rundir.new_run_dir(args.runs_root, run_name(cfg))
    return cfg, run_dir


@contextlib.contextmanager
def _held(args, run_dir: Path):
    """The command's run dir held against a second run (`rundir.hold`) from before a new run's
    `prepare_new_run_dir` (which refuses a used one, and with --overwrite clears it) to the command's end."""
    with rundir.hold(run_dir):
        if not getattr(args, "resume", None):
            rundir.prepare_new_run_dir(run_dir, args.overwrite)
        yield


def _report(line: str) -> None:
    """A run's closing line, printed once: under torchrun by rank 0 (the one whose metrics are global)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(line)


def _status(stopped_by: str | None) -> str:
    return f"stopped by {stopped_by}, checkpoint saved" if stopped_by else "done"


def _count(n: int, noun: str) -> str:
    """`1 update`, `2 updates`."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


def _export(result: dict, run_dir: Path) -> str:
    """Where the trained model is, or (stopped before the end: nothing exported yet) how to finish."""
    return f"run dir {run_dir} (--resume to finish)" if result["stopped_by"] else f"model {run_dir / 'model'}"


def _cmd_train_control(args) -> int:
    # CLI start-up: the trainer and gymnasium load for this command only, never for --help or another command
    from ppoforge.control.trainer import train

    cfg, run_dir = _config_and_run_dir(args, TRAINERS["control"], "control", lambda c: f"{c.env_id}-s{c.seed}")
    with _held(args, run_dir):
        result = train(cfg, run_dir, resume=bool(args.resume))
    recent = result.recent_returns[-20:]
    mean = sum(recent) / len(recent) if recent else float("nan")
    _report(f"{_status(result.stopped_by)}: {result.global_step:,} steps, mean return of last {len(recent)} "
          f"episodes {mean:.1f}; run dir {result.run_dir}")
    return 0


def _cmd_train_rlhf(args) -> int:
    # CLI start-up: the trainer, transformers and peft load for this command only
    from ppoforge.lm.rl.trainer import train

    cfg, run_dir = _config_and_run_dir(args, TRAINERS["rlhf"], "rlhf", lambda c: f"rlhf-{c.layout}-s{c.seed}")
    _memory_plan(cfg, "rlhf")
    with _held(args, run_dir):
        result = train(cfg, run_dir, resume=bool(args.resume))
    _report(_rlhf_closing(result, cfg))
    return 0


def _rlhf_closing(result, cfg) -> str:
    """An RLHF run's closing lines: updates, last score and held-out before -> after; where the model is; how to
    look at the curves."""
    score = result.last_metrics.get("objective/scores", float("nan"))
    heldout = f"; held-out mean score {result.heldout[0]:.3f} -> {result.heldout[1]:.3f}" if result.heldout else ""
    counts = f"{_count(result.updates, 'update')} ({_count(result.episodes, 'episode')})"
    lines = [f"{_status(result.stopped_by)}: {counts}, last mean score {score:.3f}{heldout}"]
    if result.export is not None:
        what = "LoRA adapter, PEFT format" if cfg.export == "adapter" and cfg.layout != "full" else "save_pretrained"
        lines.append(f"model {result.export} ({what}); summary {result.run_dir / 'summary.json'}")
    else:
        lines.append(f"run dir {result.run_dir} (--resume to finish)")
    if cfg.tensorboard:
        lines.append(f"curves: tensorboard --logdir {result.run_dir}")
    flat = _flat_updates(result.run_dir / "metrics.jsonl")
    if flat[1] and flat[0] * 2 >= flat[1]:  # half the updates or more learned nothing: say so, not just "done"
        lines.append(f"note: {flat[0]} of {_count(flat[1], 'update')} skipped as flat (every group's scores agreed: "
                     "no learning signal); a reward that tells completions apart, or more num_generations or a "
                     "higher temperature, gives one")
    return "\n".join(lines)


def _flat_updates(metrics: Path) -> tuple[int, int]:
    """(updates skipped as flat rollouts, updates logged) in a run's metrics.jsonl."""
    from ppoforge.runtime.metrics import read_metrics  # CLI start-up: only after a run

    rows = [r for r in read_metrics(metrics) if "guard/flat_rollout_skipped" in r] if metrics.is_file() else []
    return sum(r["guard/flat_rollout_skipped"] == 1.0 for r in rows), len(rows)


def _cmd_train_sft(args) -> int:
    # CLI start-up: the trainer, transformers and peft load for this command only
    from ppoforge.lm.supervised.sft import train

    cfg, run_dir = _config_and_run_dir(args, TRAINERS["sft"], "sft", lambda c: f"sft-{c.layout}-s{c.seed}")
    _memory_plan(cfg, "sft")
    with _held(args, run_dir):
        result = train(cfg, run_dir, resume=bool(args.resume))
    loss = (f"eval loss {result['eval/loss']:.4f}" if "eval/loss" in result  # no held-out rows: say which loss
            else f"train loss {result.get('train/loss', float('nan')):.4f} (no held-out rows)")
    _report(f"{_status(result['stopped_by'])}: {_count(result['steps'], 'step')}, {loss}; {_export(result, run_dir)}")
    return 0


def _cmd_train_reward(args) -> int:
    # CLI start-up: the trainer, transformers and peft load for this command only
    from ppoforge.lm.supervised.reward_model import train

    cfg, run_dir = _config_and_run_dir(args, TRAINERS["reward"], "reward", lambda c: f"reward-{c.layout}-s{c.seed}")
    _memory_plan(cfg, "reward")
    with _held(args, run_dir):
        result = train(cfg, run_dir, resume=bool(args.resume))
    accuracy = (f"held-out pairwise accuracy {result['eval/accuracy']:.1%}" if "eval/accuracy" in result
                else "no held-out pairs")  # not "accuracy nan%"
    _report(f"{_status(result['stopped_by'])}: {_count(result['steps'], 'step')}, {accuracy}; "
            f"{_export(result, run_dir)}")
    return 0


def _cmd_pipeline(args) -> int:
    # CLI start-up: the pipeline imports every LM trainer; they load for this command only
    from ppoforge.pipeline import describe, run_pipeline

    config = _pipeline_file(args.config)
    run_dir = Path(args.run_dir) if args.run_dir else Path(args.runs_root) / f"pipeline-{config.stem}"
    summary = run_pipeline(config, run_dir, trusted=args.trust_run_dir)
    if summary["stopped_by"]:
        _report(f"stopped by {summary['stopped_by']} in stage {summary['stage']}, checkpoint saved; rerun "
                f"`ppoforge pipeline {args.config} --run-dir {run_dir}` to continue")
        return 0
    _report(describe(summary))
    _report(f"run dir {run_dir} (summary.json, and sft/ reward/ ppo/ with each stage's run)")
    return 0


def _pipeline_file(name: str) -> Path:
    """A pipeline YAML path, or the name of a built-in one (configs/pipeline/<name>.yaml)."""
    path = Path(name)
    if path.suffix:
        return path
    builtin = resources.files("ppoforge") / "configs" / "pipeline" / f"{name}.yaml"
    if not builtin.is_file():
        raise UserError(f"pipeline: no built-in pipeline {name!r}; allowed: {', '.join(list_presets('pipeline'))} "
                        "or a path to a .yaml file")
    return Path(str(builtin))


def _cmd_eval(args) -> int:
    # CLI start-up: the evaluator and gymnasium load for this command only
    from ppoforge.control.evaluate import evaluate

    results = evaluate(Path(args.run_dir), args.episodes, seed=args.seed)
    for mode, returns in results.items():
        mean = sum(returns) / len(returns)
        std = (sum((r - mean) ** 2 for r in returns) / len(returns)) ** 0.5
        print(f"{mode:>13}: {mean:.1f} ± {std:.1f} over {len(returns)} episodes")
    return 0


def _cmd_demo(args) -> int:
    # CLI start-up: the RLHF trainer, transformers and peft load for this command only
    from ppoforge.lm.rl.demo import run_demo

    cfg = _demo_config(args)
    name = "demo" if args.task == "sentiment" else f"demo-{args.task}"
    run_dir = Path(args.run_dir) if args.run_dir else rundir.new_run_dir(args.runs_root, name)
    with _held(args, run_dir):
        run_demo(run_dir, cfg, args.task)
    return 0


def _demo_config(args):
    """The demo's config: its task's preset (DEMO_PRESETS) with the options on top."""
    return build_config(TRAINERS["rlhf"], {**read_preset(DEMO_PRESETS[args.task], "rlhf"), **overrides_from_args(args)})


def _cmd_doctor(args) -> int:
    # CLI start-up: every check (and the control trainer its smoke run uses) loads for this command only
    from ppoforge.doctor.runner import Options, main, parse_require

    opts = Options(device=args.device, precision=args.precision, quick=args.quick,
                   require=parse_require(args.require), runs_root=args.runs_root, rdzv_endpoint=args.rdzv_endpoint,
                   nnodes=args.nnodes, node_rank=args.node_rank, model=args.model)
    return main(opts, as_json=args.json)


def _cmd_notebook(args) -> int:
    extra = args.jupyter_args[1:] if args.jupyter_args[:1] == ["--"] else args.jupyter_args
    launch(NotebookOptions(ip=args.ip, port=args.port, root_dir=args.root_dir, token_file=args.token_file,
                           password_hash=args.password_hash, allow_origin=args.allow_origin,
                           allow_root=args.allow_root, extra=extra))
    return 0  # not reached: launch() execs jupyter


def _memory_plan(cfg, kind: str) -> None:
    """On CUDA: the plan's peak, one line at a run's start, and a run the plan says cannot fit refused first."""
    # CLI start-up: transformers loads for the train commands only
    from ppoforge.lm.models import memplan
    from ppoforge.runtime.device import resolve_device

    memplan.check_fits(cfg, kind, resolve_device(cfg.device))


def _cmd_plan(args) -> int:
    # CLI start-up: transformers loads for this command only (the model is built on the meta device)
    from ppoforge.lm.models import memplan

    cfg, target = _plan_config(args)
    result = memplan.for_config(cfg, args.kind, target, args.world_size)
    if args.json:
        print(json.dumps({"components": result.components, "phases": result.phases, "peak": result.peak,
                          "capacity": result.capacity, "fits": result.fits, "fix": result.fix,
                          "device": result.device, "notes": result.notes}, indent=1))
    else:
        print("\n".join(result.lines()))
    return 0 if result.fits is not False else 1


def _plan_config(args) -> tuple[object, str]:
    """(the config `plan KIND` plans, the device to plan for: --device, which is not the config's)."""
    overrides = overrides_from_args(args)
    target = overrides.pop("device", "cpu")  # a target such as cuda:80GB is not a run's device
    cfg = build_config(PLAN_KINDS[args.kind], {**preset_values(args.preset, args.config, args.kind), **overrides})
    return cfg, target


def _print_config(args) -> int:
    """`--print-config` of train, plan and demo: the config the command would use as YAML (as config.yaml has it;
    --config reads it back, `train rlhf --config` the demo's)."""
    if args.command == "plan":
        cfg = _plan_config(args)[0]
    elif args.command == "demo":
        cfg = _demo_config(args)
    else:
        cfg = _config_and_run_dir(args, TRAINERS[args.domain], args.domain, lambda c: "")[0]
    print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), end="")
    return 0


HANDLERS = {"train_control": _cmd_train_control, "train_rlhf": _cmd_train_rlhf, "train_sft": _cmd_train_sft,
            "train_reward": _cmd_train_reward, "demo": _cmd_demo, "plan": _cmd_plan, "pipeline": _cmd_pipeline,
            "eval": _cmd_eval, "doctor": _cmd_doctor, "notebook": _cmd_notebook}


def _quiet_libraries() -> None:
    """Our progress bar and our one-line errors only: no per-load progress bars from transformers."""
    try:
        # optional extra (ppoforge[lm]), and CLI start-up: only the training commands load transformers
        from transformers.utils import logging as hf_logging
    except ImportError:  # control PPO needs no transformers
        return
    hf_logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    code = _main(argv)
    dist = sys.modules.get("ppoforge.runtime.distributed")
    if dist is not None:
        dist.finish(code)  # under torchrun: leaves the process group and exits here
    return code


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("PPOFORGE_DEBUG") == "1"
    argv = [a for a in argv if a != "--debug"]
    if not debug:  # the hub's retry warnings ("Retrying in 4s [Retry 3/5]") before a failure: its one line says it
        logging.getLogger("huggingface_hub.utils._http").setLevel(logging.ERROR)
    try:
        args = build_parser(HANDLERS).parse_args(argv)
        if getattr(args, "print_config", False):
            return _print_config(args)
        if args.command in ("train", "demo", "pipeline"):
            _quiet_libraries()
            keep_freed_memory()  # process-wide, so here and not in a trainer (see runtime/allocator.py)
        return args.func(args)
    except KeyboardInterrupt:
        print("ppoforge: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the error boundary: every failure is one line (errors.py)
        if debug:
            raise
        code, line = classify(e)
        line = _rank_line(e, line)
        if line:
            print(f"ppoforge: error: {line}", file=sys.stderr)
        return code


def _rank_line(e: Exception, line: str) -> str | None:
    """Under torchrun: the rank in front of the line, and a failure every rank knows (`checked`) printed
    by rank 0 alone; None for a line this rank leaves to rank 0."""
    dist = sys.modules.get("ppoforge.runtime.distributed")
    if dist is None or dist.world().size == 1:
        return line
    world = dist.world()
    if getattr(e, "ppoforge_shared", False) and not world.is_main:
        return None
    return line if line.startswith("rank ") else f"rank {world.rank}: {line}"


if __name__ == "__main__":
    raise SystemExit(main())
