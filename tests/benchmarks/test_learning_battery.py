"""benchmarks/learning_battery.py: a task continued with --work scores only the snapshots it has not scored."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import learning_battery  # noqa: E402


class CountingEvaluator:
    def __init__(self):
        self.calls = []

    def score(self, snapshot):
        self.calls.append(snapshot)
        return {"accuracy": 0.25 * len(self.calls), "exact": len(self.calls), "n": 4}


def test_scores_are_remembered_by_the_snapshots_content(tmp_path):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    a.write_bytes(b"weights of a")
    b.write_bytes(b"weights of a")  # the same bytes: the same score
    ev, cache = CountingEvaluator(), tmp_path / "scores_4.json"
    score = learning_battery.scorer(ev, cache)
    assert [score(None)["accuracy"], score(a)["accuracy"], score(b)["accuracy"], score(None)["accuracy"]] == [
        0.25, 0.5, 0.5, 0.25]
    later = CountingEvaluator()  # a new process, as `run --work` is: read from the file
    again = learning_battery.scorer(later, cache)
    b.write_bytes(b"weights of b")  # a snapshot trained again is scored again
    assert again(a)["accuracy"] == 0.5 and again(b)["accuracy"] == 0.25 and later.calls == [b]
