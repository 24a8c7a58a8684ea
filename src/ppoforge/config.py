"""Flat dataclass configs: YAML presets, `--key value` overrides, one-line validation errors.

A trainer's config is one dataclass whose fields are declared with `param(default, help, ...)`.
The same declaration drives `--help`, YAML preset loading, string coercion of CLI overrides, range and
choice checks, and the `config.yaml` saved in each run dir. Precedence: field default < preset < a `--config`
file < CLI (a preset or config file may extend a preset: `preset: grpo`).
Cross-field rules and derived values live in the dataclass's `finalize()` hook, which `Validated`'s
`__post_init__` runs after checking every field: a config constructed in Python is checked as the CLI's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import numbers
import types
import typing
from importlib import resources
from pathlib import Path
from urllib.parse import parse_qsl

import yaml

from ppoforge.errors import UserError
from ppoforge.runtime.rundir import atomic_write_text

FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max


def float32_finite(value) -> bool:
    """A real number (not a bool) that stays finite as float32, the dtype rewards and margins train in:
    1e308 is finite as a Python float and inf there."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value) and abs(value) <= FLOAT32_MAX
    except OverflowError:  # an int too large for a float (a JSON margin of 400 digits)
        return False


def param(default, help: str, *, choices=None, lo=None, hi=None, gt=None, resume: bool = False, data: bool = False):
    """A config field: default, one-line doc, and optional allowed values / inclusive bounds / x > gt.

    Every number is finite (NaN and inf are refused) and every numeric field has an upper bound `hi`, so
    a size no machine could hold is refused before anything is allocated. `resume=True` marks a field
    that may change when a run is resumed (the run's length, logging, checkpoint cadence); every other
    field shapes the checkpoint or its meaning and must stay as the run started. `data=True` marks a
    field naming the training data, whose files a resume checks are still what the run started on
    (`runtime/trust.py`)."""
    meta = {"help": help, "choices": choices, "lo": lo, "hi": hi, "gt": gt, "resume": resume, "data": data}
    return dataclasses.field(default=default, metadata=meta)


def default_micro_batch(batch: int, most: int = 8) -> int:
    """micro_batch_size none: the largest divisor of `batch` up to `most` (batch 4 -> 4, 12 -> 6, 16 -> 8, 7 -> 7),
    so a smaller batch never meets a micro-batch that does not divide it."""
    return max(d for d in range(1, min(batch, most) + 1) if batch % d == 0)


def base_type(annotation) -> tuple[type, bool]:
    """(type, optional) for annotations like int, float, str, bool, `float | None`."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0], True
    return annotation, False


def _to_bool(name: str, value) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
        return value.lower() in ("true", "1", "yes")
    raise ValueError("is not a boolean")


def _to_int(name: str, value) -> int:
    if isinstance(value, bool):
        raise ValueError("is not an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        with contextlib.suppress(ValueError):  # a 400-digit integer is an integer (out of range), not inf
            return int(value)
    try:
        as_float = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError("is not an integer") from None
    if not (math.isfinite(as_float) and as_float.is_integer()):
        raise ValueError("is not an integer")
    return int(as_float)


def _to_float(name: str, value) -> float:
    if isinstance(value, bool):
        raise ValueError("is not a number")
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError("is not a number") from None
    if not math.isfinite(number):
        raise ValueError("is not a finite number")
    return number


def _to_str(name: str, value) -> str:
    if isinstance(value, (list, dict, tuple, set)):
        raise ValueError("is not a single value")
    return str(value)


_CONVERT = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str}
_KINDS = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string"}


def allowed_values(kind: type, optional: bool, meta: dict) -> str:
    """What a field takes, for the "allowed:" of a value that is not of its type: `an integer >= 1 and <= 65536`."""
    if meta.get("choices") is not None:
        text = "one of " + ", ".join(map(str, meta["choices"]))
    else:
        bounds = [f"{op} {meta[key]}" for key, op in (("gt", ">"), ("lo", ">="), ("hi", "<="))
                  if meta.get(key) is not None]
        text = " ".join([_KINDS[kind], " and ".join(bounds)]).strip()
    return f"{text}, or none" if optional else text


def _coerce(name: str, value, annotation, meta: dict | None = None):
    kind, optional = base_type(annotation)
    allowed = allowed_values(kind, optional, meta or {})
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null")):
        if optional:
            return None
        raise UserError(f"{name}: a value is required; allowed: {allowed}")
    try:
        return _CONVERT[kind](name, value)
    except ValueError as e:  # every coercion error says what the field takes (`--clip-high abc` did not)
        raise UserError(f"{name}: {value!r:.60} {e}; allowed: {allowed}") from None


def _check(name: str, value, meta: dict) -> None:
    if value is None:
        return
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**30 and meta["hi"] is not None:
        raise UserError(f"{name}: an integer of {len(str(abs(value)))} digits is out of range; allowed: "
                        f"{allowed_values(int, False, meta)}")  # not all 400 digits of it
    if meta["choices"] is not None and value not in meta["choices"]:
        raise UserError(f"{name}: {value!r} is not allowed; allowed: {', '.join(map(str, meta['choices']))}")
    if meta["lo"] is not None and value < meta["lo"]:
        raise UserError(f"{name}: {value} is out of range; allowed: >= {meta['lo']}"
                        + (f" and <= {meta['hi']}" if meta["hi"] is not None else ""))
    if meta["hi"] is not None and value > meta["hi"]:
        raise UserError(f"{name}: {value} is out of range; allowed: <= {meta['hi']}"
                        + (f" and >= {meta['lo']}" if meta["lo"] is not None else ""))
    if meta["gt"] is not None and value <= meta["gt"]:
        raise UserError(f"{name}: {value} is out of range; allowed: > {meta['gt']}")


def build_config(cls, values: dict):
    """Coerce, range-check and construct `cls` from a {field: value} dict; unknown keys are errors."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise UserError(f"unknown config key {unknown[0]!r}; allowed keys: {', '.join(fields)}")
    kwargs = {}
    for name, value in values.items():
        kwargs[name] = _coerce(name, value, hints[name], fields[name].metadata)
        _check(name, kwargs[name], fields[name].metadata)
    return cls(**kwargs)  # `Validated.__post_init__`: every field (defaults too) checked, then finalize()


@functools.cache
def _fields_and_hints(cls) -> tuple[dict, dict]:
    return {f.name: f for f in dataclasses.fields(cls)}, typing.get_type_hints(cls)


class Validated:
    """The base of every trainer config (through `FaultConfig`): constructing one, `RLHFConfig(learning_rate=-1)`
    from Python as much as `build_config` from the CLI, coerces and checks every field and runs `finalize()`, so a
    bad value is the CLI's one-line UserError wherever the config comes from. `preset_domain` is the folder of
    its built-in presets (configs/<domain>/), which `from_preset` reads."""

    preset_domain = ""

    def __post_init__(self) -> None:
        fields, hints = _fields_and_hints(type(self))
        for name, f in fields.items():
            value = _coerce(name, getattr(self, name), hints[name], f.metadata)
            _check(name, value, f.metadata)
            setattr(self, name, value)
        if hasattr(self, "finalize"):
            self.finalize()

    @classmethod
    def from_preset(cls, preset: str, **overrides):
        """A built-in preset (or a YAML path) with `overrides` on top: `--preset NAME --key value` from Python."""
        return build_config(cls, {**read_preset(preset, cls.preset_domain), **overrides})


def read_preset(preset: str, domain: str, _seen: tuple = ()) -> dict:
    """A preset is a YAML file path, or the name of a built-in one under ppoforge/configs/<domain>/. A file may
    extend another with `preset: NAME` (a built-in name, or a path from the file's own folder): its keys
    override that preset's."""
    data = _read_yaml_mapping(preset, domain)
    base = data.pop("preset", None)
    if base is None:
        return data
    if not isinstance(base, str) or not base:
        raise UserError(f"preset: {preset}: its preset key is {base!r:.60}; allowed: a preset name or a YAML path")
    if Path(base).suffix and not Path(base).is_absolute() and Path(preset).suffix:
        base = str(Path(preset).parent / base)
    if base in _seen or len(_seen) > 8:
        raise UserError(f"preset: {' -> '.join([*_seen, preset, base])} extend each other in a circle; allowed: "
                        "a chain of presets that ends")
    return {**read_preset(base, domain, (*_seen, preset)), **data}


def preset_values(preset: str | None, config: str | None, domain: str) -> dict:
    """The config values of `--preset` and `--config` (each may extend a preset), the config file's winning."""
    return {**(read_preset(preset, domain) if preset else {}), **(read_preset(config, domain) if config else {})}


def _read_yaml_mapping(preset: str, domain: str) -> dict:
    path = Path(preset)
    if not path.suffix:
        builtin = resources.files("ppoforge") / "configs" / domain / f"{preset}.yaml"
        if not builtin.is_file():
            raise UserError(f"preset: no built-in preset {preset!r}; allowed: "
                            f"{', '.join(list_presets(domain))} or a path to a .yaml file")
        text = builtin.read_text()
    else:
        try:
            text = path.read_text()
        except OSError as e:
            raise UserError(f"preset: cannot read {path} ({e.strerror or e})") from None
        except UnicodeDecodeError as e:
            raise not_utf8("preset", path, e) from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise UserError(f"preset: {preset} is not valid YAML ({str(e).splitlines()[0]})") from None
    except ValueError as e:  # PyYAML's int() of an integer past sys.get_int_max_str_digits() digits
        raise UserError(f"preset: {preset} is not valid YAML ({str(e).split(':')[0]})") from None
    if not isinstance(data, dict):
        raise UserError(f"preset: {preset} must be a mapping of config keys to values")
    return data


def list_presets(domain: str) -> list[str]:
    folder = resources.files("ppoforge") / "configs" / domain
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


def config_to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg, path: Path, note: str | None = None) -> None:
    """The resolved config as YAML; `note` (how the run was launched: world size, per-rank batch) heads it
    as a comment, so reading it back gives the same fields."""
    head = f"# {note}\n" if note else ""
    atomic_write_text(Path(path), head + yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def parse_query(spec: str, body: str, where: str) -> tuple[str, dict]:
    """'NAME?k=v&...' (`body`, the part of `spec` after its prefix) -> (NAME, {k: YAML value}); errors
    name `where` and `spec`. The one spec syntax of `task:` prompts (lm/data/tasks.py) and of built-in
    environments (lm/envs/builtin.py)."""
    name, _, query = body.partition("?")
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise UserError(f"{where}: {spec!r}: the part after ? is not KEY=VALUE pairs joined by &") from None
    return name, {key: yaml.safe_load(value) if value else value for key, value in pairs}


def not_utf8(where: str, path, e: UnicodeDecodeError) -> UserError:
    """The one line for a YAML file (preset, config.yaml, pipeline) with a byte that is not UTF-8."""
    line = e.object.count(b"\n", 0, e.start) + 1
    return UserError(f"{where}: {path} is not UTF-8 text (line {line}, byte {e.start}); allowed: UTF-8 text "
                     "(re-save it as UTF-8)")


def read_saved_config(path: Path) -> dict:
    """The {field: value} mapping of a run dir's config.yaml."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError:
        raise UserError(f"no config.yaml in run dir {Path(path).parent}") from None
    except UnicodeDecodeError as e:
        raise not_utf8("resume", path, e) from None
    except yaml.YAMLError as e:
        raise UserError(f"resume: {path} is not valid YAML ({str(e).splitlines()[0]})") from None
    except ValueError as e:  # as in `read_preset`
        raise UserError(f"resume: {path} is not valid YAML ({str(e).split(':')[0]})") from None
    if not isinstance(data, dict):
        raise UserError(f"resume: {path} is not a mapping of config keys to values")
    return data


def load_saved_config(cls, path: Path):
    return build_config(cls, read_saved_config(path))


def resumable_fields(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.metadata.get("resume")]


def resume_config(cls, saved: dict, overrides: dict):
    """The saved run's config with `overrides` applied. Changing a field that shapes the checkpoint
    (a model, a size, the env, the layout...) is refused, all of them in one line; the fields marked
    `resume=True` (length, logging, checkpoint cadence) may change."""
    before = build_config(cls, saved)
    after = build_config(cls, {**saved, **overrides})
    allowed = set(resumable_fields(cls))
    refused = [f.name for f in dataclasses.fields(cls)
               if getattr(before, f.name) != getattr(after, f.name) and f.name not in allowed]
    if refused:
        shown = ", ".join(f"{n} ({getattr(before, n)!r} -> {getattr(after, n)!r})" for n in refused)
        raise UserError(f"resume: cannot change {shown} of a checkpointed run; allowed on resume: "
                        f"{', '.join(resumable_fields(cls))} (start a new run for the rest)")
    return after


def check_checkpoint_config(cfg, saved: dict | None, where: Path) -> None:
    """Refuse a resume whose config (the run dir's config.yaml, with what the command line may change) differs
    from the config saved inside its checkpoint on a field a resume may not change: a config.yaml edited by
    hand (the checkpoint's KL controller, seed and data order would go on with the old values while the file
    says otherwise), or a checkpoint copied in from another run. Exempt: the fields a resume may change, and the
    data fields, which `runtime/trust.py` checks by content (a data file moved and renamed in config.yaml is the
    same run). A checkpoint without a config (older ones) or a field one side lacks is not compared."""
    if not isinstance(saved, dict):
        return
    current = config_to_dict(cfg)
    exempt = {f.name for f in dataclasses.fields(cfg) if f.metadata.get("resume") or f.metadata.get("data")}
    differ = [(name, current[name], saved[name]) for name in current
              if name in saved and name not in exempt and current[name] != saved[name]]
    if not differ:
        return
    show = lambda v: repr(v) if isinstance(v, str) else str(v)  # noqa: E731 - one use, in the line below
    name, now, then = differ[0]
    more = "".join(f"; also {n} {show(a)} vs {show(b)}" for n, a, b in differ[1:])
    raise UserError(f"resume: {where} says {name} {show(now)} but the checkpoint's run used {show(then)}{more}; "
                    f"allowed: the config.yaml and checkpoint of one run (here {name}: {show(then)}), and on the "
                    f"command line the fields a resume may change ({', '.join(resumable_fields(type(cfg)))}); "
                    "a new run for the rest")
