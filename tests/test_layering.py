"""The package's layers, read from its imports: each package imports only the layers below it, no module
imports another in a circle, and an import inside a function says why it is there.

Layers, bottom to top (docs/architecture.md draws them):

    errors
    core                    pure tensor math
    config, runtime         the config framework; device, precision, checkpoints, metrics, distributed
    control, lm.data, lm.models
    lm.envs, lm.supervised
    lm.rl
    doctor, pipeline, notebook, api   api: the Python trainers (ppoforge.X, lazily)
    cli_args                the command line's parsers
    cli
    config_reference        docs/configuration.md and docs/cli.md, generated from the parsers and configs
    __main__

`config` and `runtime` share a layer (FaultConfig is declared with `param`; saving a config writes
atomically): between them only the circles are refused.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import ppoforge

SRC = Path(ppoforge.__file__).parent
LAYERS = [
    {"errors"},
    {"core"},
    {"config", "runtime"},
    {"control", "lm.data", "lm.models"},
    {"lm.envs", "lm.supervised"},
    {"lm.rl"},
    {"doctor", "pipeline", "notebook", "api"},
    {"cli_args"},
    {"cli"},
    {"config_reference"},
    {"__main__"},
]
RANK = {group: i for i, layer in enumerate(LAYERS) for group in layer}
LM_PACKAGES = ("data", "models", "envs", "supervised", "rl")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def group(module: str) -> str:
    """ppoforge.lm.rl.trainer -> lm.rl; ppoforge.runtime.fsdp -> runtime; ppoforge.cli -> cli."""
    parts = module.split(".")[1:]
    if parts[:1] == ["lm"] and len(parts) > 1 and parts[1] in LM_PACKAGES:
        return f"lm.{parts[1]}"
    return parts[0] if parts else "ppoforge"


def imported_modules(node: ast.AST, known: set[str]) -> list[str]:
    """The ppoforge modules an import statement loads (`from ppoforge.lm.models import smollm2` loads
    ppoforge.lm.models.smollm2)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.startswith("ppoforge")]
    names = [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else []
    if isinstance(node, ast.ImportFrom) and (node.module, names) == ("ppoforge", ["__version__"]):
        return []  # the version string: the root package's one plain value, read from any layer
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ppoforge"):
        subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known]
        return subs or [node.module]
    return []


def _graph() -> tuple[dict[str, set[str]], list[tuple[str, int, str]]]:
    files = {module_name(p): p for p in SRC.rglob("*.py")}
    edges: dict[str, set[str]] = defaultdict(set)
    unexplained = []
    for name, path in files.items():
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text)
        for node in ast.walk(tree):
            for target in imported_modules(node, set(files)):
                edges[name].add(target)
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and not _explained(lines, node.lineno):
                    unexplained.append((name, node.lineno, lines[node.lineno - 1].strip()))
    return edges, sorted(set(unexplained))


def _explained(lines: list[str], lineno: int) -> bool:
    """A comment on the import's line, or on the line above the block of imports it belongs to."""
    i = lineno - 1
    while i >= 0 and _import_line(lines[i]):
        if "#" in lines[i]:
            return True
        i -= 1
    return i >= 0 and lines[i].strip().startswith("#")


def _import_line(line: str) -> bool:
    s = line.strip()
    return s.startswith(("import ", "from ")) or s == ")" or (s.endswith(",") and " " not in s.rstrip(","))


def test_each_package_imports_only_the_layers_below_it():
    edges, _ = _graph()
    upward = sorted(f"{src} imports {dst} ({group(src)} -> {group(dst)})"
                    for src, targets in edges.items() for dst in targets
                    if group(src) != group(dst) and RANK[group(dst)] >= RANK[group(src)]
                    and not {group(src), group(dst)} <= LAYERS[2])
    assert not upward, "\n".join(upward)


def test_no_module_imports_another_in_a_circle():
    edges, _ = _graph()
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [node, nxt]) if nxt in stack else
                              f"{node} -> {nxt}")
            elif nxt not in state:
                visit(nxt, stack + [node])
        state[node] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module, [])
    # a package's __init__ importing nothing of its own: ppoforge.lm.rl -> ppoforge.lm.rl.x is no circle
    assert not cycles, "\n".join(cycles)


def test_every_import_inside_a_function_says_why():
    _, unexplained = _graph()
    assert not unexplained, "imports inside functions need a comment (an optional extra, a real cycle, CLI " \
        "start-up):\n" + "\n".join(f"{m}:{n}: {line}" for m, n, line in unexplained)


def test_the_rules_catch_an_upward_import_and_a_circle(tmp_path):
    """The checks themselves: a models -> rl import is upward; a -> b -> a is a circle."""
    assert RANK[group("ppoforge.lm.rl.trainer")] > RANK[group("ppoforge.lm.models.sampler")]
    assert group("ppoforge.lm.envs.episodes") == "lm.envs" and group("ppoforge.cli") == "cli"
    tree = ast.parse("from ppoforge.lm.models import smollm2\nimport ppoforge.core.kl\n")
    known = {"ppoforge.lm.models.smollm2"}
    assert [m for node in tree.body for m in imported_modules(node, known)] == [
        "ppoforge.lm.models.smollm2", "ppoforge.core.kl"]
    assert _explained(["def f():", "    # optional extra", "    import textarena"], 3)
    assert not _explained(["def f():", "    x = 1", "    import textarena"], 3)
