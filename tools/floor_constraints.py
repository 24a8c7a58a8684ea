"""Print a pip constraints file that pins every dependency pyproject.toml declares to its floor.

    python tools/floor_constraints.py > .venv-floor/constraints.txt
    pip install -c .venv-floor/constraints.txt -e '.[dev]'

`make test-floor` uses it: the suite then runs on torch 2.6 (the seed's image) and the lowest version of
every other direct dependency that pyproject.toml admits, so a floor we declare is a floor we test.
pip has no `--resolution lowest`; pinning `name==floor` for direct dependencies is what uv's
`--resolution lowest-direct` does. Extras named on the command line (default: dev, which includes lm)
are followed, `ppoforge[...]` self-references included.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*)$")


def direct_requirements(project: dict, extras: list[str]) -> list[str]:
    """The project's dependencies plus those of `extras`, following `name[extra]` self-references."""
    optional, name = project.get("optional-dependencies", {}), project["name"]
    out, todo, seen = list(project.get("dependencies", [])), list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for req in optional.get(extra, []):
            match = REQUIREMENT.match(req)
            if match and match.group(1) == name:
                todo += [e.strip() for e in match.group(2).strip("[]").split(",")]
            else:
                out.append(req)
    return out


def floor_pins(requirements: list[str]) -> list[str]:
    """`name>=X,...` -> `name==X`; a requirement without a lower bound is an error (nothing to test)."""
    pins = []
    for req in requirements:
        match = REQUIREMENT.match(req.split(";")[0])
        floor = re.search(r">=\s*([^,\s]+)", match.group(3))
        if floor is None:
            raise SystemExit(f"{req!r} declares no lower bound: give it one in pyproject.toml")
        pins.append(f"{match.group(1).lower()}=={floor.group(1)}")
    return sorted(set(pins))


def main(argv: list[str]) -> None:
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    print("\n".join(floor_pins(direct_requirements(project, argv or ["dev"]))))


if __name__ == "__main__":
    main(sys.argv[1:])
