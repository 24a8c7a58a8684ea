"""docs/configuration.md and docs/cli.md are what `python -m ppoforge.config_reference` prints: a field, preset or
option changed without regenerating them fails here."""

from pathlib import Path

import pytest

from ppoforge import config_reference

DOCS = Path(__file__).resolve().parents[1] / "docs"


@pytest.mark.parametrize("page, generate, command", [
    ("configuration.md", config_reference.configuration, "python -m ppoforge.config_reference > docs/configuration.md"),
    ("cli.md", config_reference.cli, "python -m ppoforge.config_reference cli > docs/cli.md"),
])
def test_the_checked_in_reference_is_the_generated_one(page, generate, command):
    assert (DOCS / page).read_text() == generate() + "\n", f"docs/{page} is out of date: run `{command}`"


def test_the_reference_lists_every_field_with_its_presets_values():
    text = config_reference.configuration()
    assert "| `--learning-rate` | float | 0.0001 | a finite number > 0 and <= 10.0 |" in text
    assert "demo: 0.0002" in text.split("| `--learning-rate` | float | 0.0001")[1].split("\n")[0]
    assert "| `--max-steps` | int or none | none | an integer >= 1 and <= 1000000000000, or none |" in text
