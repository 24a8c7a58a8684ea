"""Metrics sinks: JSONL (the source of truth, always), TensorBoard and Weights & Biases as `report_to`
asks (TRL's field), and a learning-curve PNG.

Metric names are namespaced (`charts/`, `losses/`, `objective/`, `policy/`, `loss/`, `val/`, `perf/`)
and documented in docs/metrics.md. JSONL lines are appended and flushed per log call, so a killed
run keeps every line it logged; on resume the file is truncated back to the checkpoint's step first.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

from ppoforge.config import config_to_dict, save_config
from ppoforge.errors import UserError
from ppoforge.runtime import trust
from ppoforge.runtime.rundir import atomic_write_text

REPORT_TO = ("tensorboard", "wandb", "none")
REPORT_TO_HELP = ("where metrics go besides metrics.jsonl (always written): tensorboard, wandb (Weights & Biases: "
                  "pip install 'ppoforge[wandb]'; WANDB_MODE=offline writes RUN/wandb), none, or a comma-separated "
                  "list (TRL's report_to)")


def _plain(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)
    return value


def report_sinks(report_to: str, tensorboard: bool = True) -> tuple[str, ...]:
    """`report_to` ("tensorboard", "wandb", "none" or a comma-separated list) as the sinks it names; the older
    `tensorboard: false` takes TensorBoard out. A name not allowed is a UserError naming the field."""
    names = [n.strip() for n in report_to.split(",") if n.strip()]
    bad = [n for n in names if n not in REPORT_TO]
    if bad or not names:
        raise UserError(f"report_to: {bad[0] if bad else report_to!r} is not allowed; allowed: "
                        f"{', '.join(REPORT_TO)}, or a comma-separated list of them")
    return tuple(n for n in dict.fromkeys(names) if n != "none" and (n != "tensorboard" or tensorboard))


class MetricsLogger:
    """Write `{"step": s, **metrics}` lines to metrics.jsonl and scalars to each of `sinks` (TensorBoard under
    RUN/tb, a Weights & Biases run under RUN/wandb with `cfg` as its config)."""

    def __init__(self, run_dir: Path, sinks: tuple[str, ...] = ("tensorboard",), cfg=None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tb = self._wandb = None
        if "wandb" in sinks:  # first: a missing package is refused before anything is opened
            self._wandb = _wandb_run(Path(run_dir), cfg)
        self._file = self.path.open("a")
        if "tensorboard" in sinks:
            from torch.utils.tensorboard import SummaryWriter  # loads tensorboard only for runs that write to it

            self._tb = SummaryWriter(str(Path(run_dir) / "tb"))

    def log(self, step: int, metrics: dict) -> None:
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        scalars = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
        if self._tb:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb:
            self._wandb.log(scalars, step=step)

    def log_text(self, step: int, tag: str, markdown: str) -> None:
        if self._tb:
            self._tb.add_text(tag, markdown, step)

    def close(self) -> None:
        self._file.close()
        if self._tb:
            self._tb.close()
        if self._wandb:
            self._wandb.finish()


def _wandb_run(run_dir: Path, cfg):
    """A Weights & Biases run in RUN/wandb named after the run dir, resumed when the run dir is (its id is
    the run dir's name); WANDB_MODE / WANDB_PROJECT as wandb reads them."""
    try:
        import wandb  # optional extra: only runs that report to W&B need it
    except ImportError:
        raise UserError("report_to: wandb needs the wandb package; fix: pip install 'ppoforge[wandb]', or "
                        "report_to tensorboard") from None
    (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
    path = str(run_dir.resolve())
    run_id = re.sub(r"[^\w.-]", "-", run_dir.name)[:50] + "-" + hashlib.sha1(path.encode()).hexdigest()[:8]
    return wandb.init(dir=path, name=run_dir.name, id=run_id, resume="allow",
                      config=config_to_dict(cfg) if cfg is not None else None)


class NullLogger:
    """The logger of a rank that writes nothing (under torchrun rank 0 alone writes the run dir)."""

    def log(self, step: int, metrics: dict) -> None:
        pass

    def log_text(self, step: int, tag: str, markdown: str) -> None:
        pass

    def close(self) -> None:
        pass


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop lines logged after `last_step` (they belong to updates a resume will redo)."""
    path = Path(path)
    if not path.exists():
        return
    rows = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= last_step]
    path.write_text("".join(r + "\n" for r in rows))


def open_run_dir(run_dir: Path, cfg, note: str, step: int, logs: tuple[str, ...] = ("metrics.jsonl",),
                 main: bool = True) -> MetricsLogger | NullLogger:
    """What every trainer writes before its first update, on rank 0 alone (`main`): the resolved config
    (`note`: how the ranks split the batch), on a fresh run (`step` 0) the fingerprints of the code and
    data files it names (`trust.record`), and each of `logs` cut back to `step` (a resumed run rewrites
    what came after its checkpoint). Returns the run's logger; a NullLogger on the other ranks."""
    if not main:
        return NullLogger()
    save_config(cfg, run_dir / "config.yaml", note=note)
    if step == 0:
        trust.record(run_dir, cfg)
    for name in logs:
        truncate_metrics(run_dir / name, step)
    return MetricsLogger(run_dir, report_sinks(cfg.report_to, cfg.tensorboard), cfg)


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line]


def first_and_last(metrics_path: Path, key: str) -> tuple[float, float] | None:
    """(first, last) logged value of `key` (e.g. `eval/scores`: held-out before and after), None if fewer
    than two were logged."""
    values = [r[key] for r in read_metrics(metrics_path) if isinstance(r.get(key), (int, float))]
    return (values[0], values[-1]) if len(values) > 1 else None


def write_summary(run_dir: Path, trainer: str, steps: int, unit: str, stopped_by: str | None,
                  export: Path | None, metrics: dict, **extra) -> dict:
    """summary.json, one schema for every trainer (docs/metrics.md): `trainer`, `steps` counted in `unit`
    (update, step), `stopped_by` (a signal, or None), `export` (the exported model's folder, None when the
    run stopped before the end), `extra` (a trainer's own counts), then the last logged metrics. Returns it."""
    summary = {"trainer": trainer, "steps": steps, "unit": unit, "stopped_by": stopped_by,
               "export": None if export is None else str(export), **extra,
               **{k: _plain(v) for k, v in metrics.items()}}
    atomic_write_text(Path(run_dir) / "summary.json", json.dumps(summary, indent=1) + "\n")
    return summary


def plot_curves(metrics_path: Path, keys: list[str], out_png: Path, title: str = "") -> Path | None:
    """One subplot per key that appears in the log, x = step. Returns the PNG path, or None. An `eval/`
    key is drawn as its measured points (a line between two evaluations would read as progress nobody
    measured), with error bars where the log has `KEY_lo` and `KEY_hi`."""
    import matplotlib  # plotting only: matplotlib loads when a plot is drawn, not with the trainer

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display needed
    from matplotlib.ticker import MaxNLocator  # plotting only, as matplotlib above

    rows = read_metrics(metrics_path)
    present = [k for k in keys if any(isinstance(r.get(k), (int, float)) for r in rows)]
    if not present:
        return None
    fig, axes = plt.subplots(1, len(present), figsize=(4.5 * len(present), 3.4), squeeze=False)
    for ax, key in zip(axes[0], present, strict=True):
        pts = [r for r in rows if isinstance(r.get(key), (int, float))]
        x, y = [r["step"] for r in pts], [r[key] for r in pts]
        if key.startswith("eval/"):
            bars = [[v - r.get(f"{key}_lo", v) for r, v in zip(pts, y, strict=True)],
                    [r.get(f"{key}_hi", v) - v for r, v in zip(pts, y, strict=True)]]
            ax.errorbar(x, y, yerr=bars, fmt="o", ms=5, capsize=3, lw=1.2)
        else:
            ax.plot(x, y, lw=1.5)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no 1.25 between updates
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return Path(out_png)
