"""Metrics sinks (issue 39): report_to (TRL's field) picks TensorBoard and/or Weights & Biases beside
metrics.jsonl; a W&B offline run dir holds the logged metrics; the learning-curve PNG's step axis is whole
numbers."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from matplotlib.figure import Figure

from ppoforge.config import build_config
from ppoforge.errors import UserError
from ppoforge.lm.rl.config import RLHFConfig
from ppoforge.runtime.metrics import open_run_dir, plot_curves, report_sinks


def _need_wandb():
    """wandb is in the dev extra: missing, the test fails saying so, except in the floor venv (`make venv-floor`
    writes its constraints.txt), built before wandb joined dev, where it is skipped with the reason."""
    if importlib.util.find_spec("wandb") is not None:
        return
    if (Path(sys.prefix) / "constraints.txt").is_file():
        pytest.skip("wandb is not installed in this floor venv (pip install 'ppoforge[wandb]'; make venv-floor "
                    "installs it with dev)")
    pytest.fail("wandb is not installed: pip install 'ppoforge[wandb]' (the dev extra has it)")


def test_report_to_names_the_sinks_and_refuses_others():
    assert report_sinks("tensorboard") == ("tensorboard",)
    assert report_sinks("wandb, tensorboard") == ("wandb", "tensorboard")
    assert report_sinks("tensorboard,wandb", tensorboard=False) == ("wandb",)  # the older switch still works
    assert report_sinks("none") == ()
    with pytest.raises(UserError, match="report_to: 'mlflow' is not allowed; allowed: tensorboard, wandb, none"):
        build_config(RLHFConfig, {"report_to": "mlflow"})


def test_report_to_none_writes_metrics_jsonl_alone(tmp_path):
    logger = open_run_dir(tmp_path, build_config(RLHFConfig, {"report_to": "none"}), "", 0)
    logger.log(1, {"objective/scores": 0.5})
    logger.close()
    assert (tmp_path / "metrics.jsonl").is_file() and not (tmp_path / "tb").exists() and \
        not (tmp_path / "wandb").exists()


def test_wandb_offline_run_holds_the_metrics(tmp_path, monkeypatch):
    _need_wandb()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = build_config(RLHFConfig, {"report_to": "tensorboard,wandb", "learning_rate": 3e-5})
    logger = open_run_dir(tmp_path, cfg, "", 0)
    for step in (1, 2):
        logger.log(step, {"objective/scores": 0.25 * step, "rewards/vader/mean": 0.1 * step})
    logger.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))  # what `wandb sync` uploads later
    assert len(runs) == 1, list((tmp_path / "wandb").iterdir())
    data = runs[0].read_bytes()
    # history (and summary) items: key (field 2), value_json; each step's value in logging order
    assert list(dict.fromkeys(_items(data, "objective/scores", b"\x12"))) == [0.25, 0.5]
    assert list(dict.fromkeys(_items(data, "rewards/vader/mean", b"\x12"))) == [0.1, 0.2]
    assert _items(data, "learning_rate", b"\n") == [3e-05]  # config items: key (field 1), value_json
    assert list((tmp_path / "tb").iterdir())  # TensorBoard too


def _items(data: bytes, key: str, tag: bytes) -> list:
    """The JSON values stored under `key` in a .wandb file's protobuf records: `tag` + length + key, then
    value_json (field 16: 0x82 0x01) + length + JSON. wandb 0.31 ships no reader for its own files."""
    head = tag + bytes([len(key)]) + key.encode() + b"\x82\x01"
    out, i = [], data.find(head)
    while i >= 0:
        start = i + len(head) + 1
        out.append(json.loads(data[start:start + data[i + len(head)]]))
        i = data.find(head, start)
    return out


def test_the_learning_curves_step_axis_is_whole_numbers(tmp_path, monkeypatch):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "objective/scores": s / 10}) + "\n"
                                                    for s in (1, 2)))
    ticks = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: ticks.extend(fig.axes[0].get_xticks()))
    plot_curves(tmp_path / "metrics.jsonl", ["objective/scores"], tmp_path / "c.png")
    inside = [t for t in ticks if 1 <= t <= 2]
    assert inside and all(float(t).is_integer() for t in ticks), ticks  # was 1.0, 1.2, 1.4, ...
