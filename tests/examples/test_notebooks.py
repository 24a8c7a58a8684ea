"""The example notebooks run headlessly from top to bottom (nbclient) with tiny settings and show what
they promise: inline curves (a PNG output) and, for RLHF, a before/after table of completions."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _execute(name: str, cwd: Path) -> nbformat.NotebookNode:
    nb = nbformat.read(EXAMPLES / name, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}).execute()
    return nb


def _outputs(nb, kind: str) -> list:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if kind in o.get("data", {})]


def _text(nb) -> str:
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)


@pytest.mark.slow
def test_control_notebook_trains_plots_and_evaluates(tmp_path, monkeypatch):
    monkeypatch.setenv("PPOFORGE_NB_STEPS", "2048")
    monkeypatch.setenv("PPOFORGE_NB_RUNS", str(tmp_path / "runs"))
    nb = _execute("control_ppo.ipynb", tmp_path)
    assert len(_outputs(nb, "image/png")) == 1
    assert "2,048 steps" in _text(nb) and "deterministic: mean return" in _text(nb)
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert (run_dir / "checkpoint.pt").is_file()


@pytest.mark.slow
def test_rlhf_notebook_trains_plots_and_shows_before_after(tmp_path, monkeypatch):
    from ppoforge.lm.models.tiny import save_tiny_lm

    model = save_tiny_lm(tmp_path / "tiny-lm")
    monkeypatch.setenv("PPOFORGE_NB_MODEL", str(model))
    monkeypatch.setenv("PPOFORGE_NB_UPDATES", "2")
    monkeypatch.setenv("PPOFORGE_NB_RUNS", str(tmp_path / "runs"))
    nb = _execute("rlhf_demo.ipynb", tmp_path)
    assert len(_outputs(nb, "image/png")) == 1
    (table,) = _outputs(nb, "text/html")
    assert "score before" in table["data"]["text/html"] and "score after" in table["data"]["text/html"]
    assert "2 updates, last mean score" in _text(nb) and "held-out mean score" in _text(nb)


def test_notebooks_are_committed_without_outputs():
    for path in EXAMPLES.glob("*.ipynb"):
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        assert all(not c.get("outputs") and c.get("execution_count") is None
                   for c in nb.cells if c.cell_type == "code"), f"{path.name} carries outputs"
