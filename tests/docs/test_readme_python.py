"""The README's Python snippet runs as written, shortened only as the recipes are: the hub model named there
replaced by a tiny random model built here (no network), total_updates by 1, in a fresh folder."""

import re
from pathlib import Path

from ppoforge.lm.models.tiny import save_tiny_lm

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_python_snippet_trains_and_exports(tmp_path, monkeypatch):
    blocks = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.S) if "from ppoforge import" in b]
    assert blocks, "the README has no Python API snippet"  # (its reward files are the recipes' test's)
    monkeypatch.chdir(tmp_path)
    tiny = save_tiny_lm(tmp_path / "tiny")
    for i, block in enumerate(blocks):
        assert '"Qwen/Qwen2.5-0.5B-Instruct"' in block and "total_updates=50" in block, block
        code = block.replace('"Qwen/Qwen2.5-0.5B-Instruct"', repr(str(tiny))).replace("total_updates=50",
                                                                                      "total_updates=1")
        exec(compile(code, f"README.md python block {i}", "exec"), {"__name__": "readme"})  # noqa: S102
    assert (tmp_path / "runs" / "grpo" / "summary.json").is_file()
    assert (tmp_path / "grpo-merged" / "config.json").is_file()  # merged: loads in plain transformers
