"""`ppoforge pipeline CONFIG`: the three stages of RLHF — SFT, a reward model, PPO — from one YAML file.

    sft:    {SFTConfig fields}
    reward: {RewardConfig fields}
    ppo:    {RLHFConfig fields}      # model and reward default to the two stages' exports

Each stage runs in its own subfolder of the run dir with its own trainer, so everything a stage does
alone (checkpoints, exact resume, the error boundary, SIGTERM) holds inside the pipeline. All three
configs are validated before the first stage starts: a typo in `ppo` fails in a second, not after an
hour of SFT. Rerunning the command continues where it stopped: a finished stage (`stage.json`) is not
redone, an interrupted one resumes from its checkpoint (its config may only change the fields a resume
may change). A finished stage is reused only as it finished: when its section of the file changed, or
its data file did (`runtime/trust.py`), the rerun is refused with one line rather than redoing it,
which would replace a finished model and everything built on it; a new --run-dir runs the changed
pipeline, or removing that stage's folder (and the later ones) redoes it there. A stage can be left
out of the file (e.g. to start from your own SFT model).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import yaml

from ppoforge.config import build_config, not_utf8, read_saved_config, resume_config
from ppoforge.errors import UserError
from ppoforge.lm.rl import trainer as rlhf
from ppoforge.lm.rl.config import RLHFConfig
from ppoforge.lm.supervised import reward_model, sft
from ppoforge.lm.supervised.config import RewardConfig, SFTConfig
from ppoforge.runtime import distributed, rundir, trust
from ppoforge.runtime.rundir import atomic_write_text

STAGES = {"sft": SFTConfig, "reward": RewardConfig, "ppo": RLHFConfig}


def read_pipeline(path: Path) -> dict[str, dict]:
    """{stage: fields} from the YAML file: only known stages, each a mapping."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as e:
        raise UserError(f"pipeline: cannot read {path} ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise not_utf8("pipeline", path, e) from None
    except yaml.YAMLError as e:
        raise UserError(f"pipeline: {path} is not valid YAML ({str(e).splitlines()[0]})") from None
    except ValueError as e:  # PyYAML's int() of an integer past sys.get_int_max_str_digits() digits
        raise UserError(f"pipeline: {path} is not valid YAML ({str(e).split(':')[0]})") from None
    unknown = sorted(set(data) - set(STAGES)) if isinstance(data, dict) else ["(not a mapping)"]
    if unknown or not data:
        raise UserError(f"pipeline: {path} has {unknown[0] if unknown else 'no stages'}; allowed: sft, reward "
                        "and ppo sections, each a mapping of that trainer's fields")
    for stage, fields in data.items():
        if not isinstance(fields, dict):
            raise UserError(f"pipeline: the {stage} section of {path} must be a mapping of fields")
    return data


def stage_configs(spec: dict[str, dict], run_dir: Path) -> dict:
    """Every stage's config, validated now; PPO's model and reward default to the stages' exports."""
    configs = {}
    for stage, cls in STAGES.items():
        if stage not in spec:
            continue
        values = dict(spec[stage])
        if stage == "ppo":
            if "sft" in spec:
                values.setdefault("model", str(run_dir / "sft" / "model"))
            if "reward" in spec:
                values.setdefault("reward", f"model:{run_dir / 'reward' / 'model'}")
        try:
            configs[stage] = build_config(cls, values)
            if stage != "ppo":
                configs[stage].check_data()
        except UserError as e:
            raise UserError(f"pipeline: {stage}: {e}") from None
    return configs


def _run_stage(stage: str, cfg, stage_dir: Path, trusted: bool) -> tuple[dict, str | None]:
    """Run (or resume) one stage; (its result, the signal that stopped it or None)."""
    resume = (stage_dir / "checkpoint.pt").is_file() or (stage_dir / "checkpoint").is_dir()  # fsdp: a directory
    if resume:
        cfg = resume_config(type(cfg), read_saved_config(stage_dir / "config.yaml"), vars(cfg))
        trust.check_resume(stage_dir, cfg, trusted)
    elif _main():  # under torchrun rank 0 alone touches the run dir
        rundir.prepare_new_run_dir(stage_dir, overwrite=True)  # what a stage left before its first checkpoint
    if stage == "ppo":
        result = rlhf.train(cfg, stage_dir, resume=resume)
        return {"updates": result.updates, **result.last_metrics, **(_heldout(stage_dir) if _main() else {})}, \
            result.stopped_by
    result = (sft if stage == "sft" else reward_model).train(cfg, stage_dir, resume=resume)
    return result, result["stopped_by"]


def _check_finished(stage: str, cfg, stage_dir: Path, trusted: bool) -> None:
    """Refuse to reuse a finished stage whose config (as its section gives it now) or data file changed."""
    saved = build_config(type(cfg), read_saved_config(stage_dir / "config.yaml"))
    changed = [f.name for f in dataclasses.fields(cfg) if getattr(saved, f.name) != getattr(cfg, f.name)]
    what = ", ".join(f"{n} ({getattr(saved, n)!r} -> {getattr(cfg, n)!r})" for n in changed)
    what = f"settings changed: {what}" if changed else (None if trusted else trust.data_change(stage_dir, cfg))
    if what:
        raise UserError(f"pipeline: {stage} finished in {stage_dir}, but its {what}; allowed: the settings and data "
                        f"it finished with, another --run-dir for the changed pipeline, or remove {stage_dir} (and "
                        "the later stages' folders) to redo it")


def _main() -> bool:
    """Rank 0 under torchrun (read from its environment: the first stage has not joined the group yet)."""
    return distributed.env_world().is_main


def _heldout(stage_dir: Path) -> dict:
    """PPO's held-out score before the first and after the last update (its eval/scores rows)."""
    rows = [json.loads(line) for line in (stage_dir / "metrics.jsonl").read_text().splitlines() if line]
    scores = [r["eval/scores"] for r in rows if r.get("eval/scores") is not None]
    return {"heldout_before": scores[0], "heldout_after": scores[-1]} if len(scores) > 1 else {}


def run_pipeline(config_path: Path, run_dir: Path, trusted: bool = False) -> dict:
    """Run the stages in order, skipping finished ones; returns the summary (also run_dir/summary.json).
    Under torchrun every rank runs each stage's trainer; rank 0 alone prints and writes the summaries."""
    configs = stage_configs(read_pipeline(config_path), Path(run_dir))
    with rundir.hold(run_dir):  # one pipeline at a time in it (each stage's trainer holds its own folder too)
        return _run_stages(configs, Path(run_dir), trusted)


def _run_stages(configs: dict, run_dir: Path, trusted: bool) -> dict:
    """`run_pipeline`'s work, its run dir held."""
    for stage, cfg in configs.items():  # before any stage runs, as the configs' checks
        if (Path(run_dir) / stage / "stage.json").is_file():
            _check_finished(stage, cfg, Path(run_dir) / stage, trusted)
    summary, main = {}, _main()
    for stage, cfg in configs.items():
        stage_dir, done = Path(run_dir) / stage, Path(run_dir) / stage / "stage.json"
        if done.is_file():
            summary[stage] = json.loads(done.read_text())
            if main:
                print(f"ppoforge pipeline: {stage} already finished in {stage_dir}; not redone", file=sys.stderr)
            continue
        if main:
            print(f"ppoforge pipeline: {stage} in {stage_dir}", file=sys.stderr, flush=True)
        result, stopped = _run_stage(stage, cfg, stage_dir, trusted)
        if stopped:
            return {"stopped_by": stopped, "stage": stage, **summary}
        summary[stage] = {k: v for k, v in result.items() if isinstance(v, (int, float, str)) and k != "stopped_by"}
        if main:
            atomic_write_text(done, json.dumps(summary[stage], indent=1) + "\n")
        distributed.barrier()  # no rank checks the next stage's files before rank 0 has written this one's
    if main:
        atomic_write_text(Path(run_dir) / "summary.json", json.dumps(summary, indent=1) + "\n")
    return {"stopped_by": None, **summary}


def describe(summary: dict) -> str:
    """The end-of-pipeline lines: what each stage reached."""
    lines = []
    def count(n, noun: str) -> str:
        return f"{n} {noun}" if n == 1 else f"{n} {noun}s"

    if "sft" in summary:
        s = summary["sft"]
        loss = (f"held-out loss {s['eval/loss']:.3f}" if "eval/loss" in s  # eval_fraction 0: no held-out loss
                else f"train loss {s.get('train/loss', float('nan')):.3f} (no held-out rows)")
        lines.append(f"sft: {count(s.get('steps'), 'step')}, {loss}")
    if "reward" in summary:
        r = summary["reward"]
        lines.append(f"reward model: held-out pairwise accuracy {r['eval/accuracy']:.1%}, mean gap "
                     f"{r.get('eval/gap', float('nan')):+.2f}" if "eval/accuracy" in r
                     else "reward model: no held-out pairs")
    if "ppo" in summary:
        p = summary["ppo"]
        lines.append(f"ppo: {count(p.get('updates'), 'update')}, learned reward on held-out prompts "
                     f"{p.get('heldout_before', float('nan')):+.3f} -> {p.get('heldout_after', float('nan')):+.3f}")
    return "\n".join(lines)
