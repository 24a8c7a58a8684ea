"""Where tensors are made: a static check, since no test here runs on a GPU. A CPU run cannot tell a CPU
tensor from a CUDA one, so a tensor factory without `device=` in the code that feeds collectives, metric
reductions and model ops (lm/, runtime/, control/) crashes only on CUDA / NCCL ("Expected all tensors to
be on the same device", NCCL refusing a CPU tensor). Every such factory names its device, or says on its
line why it is deliberately on the host: `# cpu: <why>` (built on the host and moved in one copy, a host
float, a CPU-only path), or on the line above it when the call fills its line. A new factory without
either fails here."""

import ast
from pathlib import Path

import ppoforge

PACKAGES = ("lm", "runtime", "control")
FACTORIES = {"tensor", "zeros", "ones", "full", "arange", "as_tensor", "empty"}
ROOT = Path(ppoforge.__file__).parent


def undeviced_factories(source: str) -> list[int]:
    """Line numbers of `torch.<factory>(...)` calls with no `device=` and no `# cpu:` on their lines (or the
    line above)."""
    lines = source.splitlines()
    out = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and node.func.attr in FACTORIES):
            continue
        if any(k.arg == "device" for k in node.keywords):
            continue
        if not any("# cpu:" in lines[i - 1] for i in range(max(node.lineno - 1, 1), node.end_lineno + 1)):
            out.append(node.lineno)
    return out


def test_the_check_flags_a_factory_without_a_device_and_takes_the_allow_comment():
    src = ("import torch\nx = torch.tensor([1.0])\ny = torch.zeros(2, device=d)\n"
           "z = torch.full((2,), 0.0)  # cpu: built on the host, moved below\nu = 1\nw = torch.ones(\n  3)\n"
           "# cpu: a host float\nv = torch.tensor(1.0)\n")
    assert undeviced_factories(src) == [2, 6]


def test_every_tensor_factory_names_its_device_or_says_why_it_is_on_the_cpu():
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    assert len(files) > 30
    bad = [f"{p.relative_to(ROOT.parent)}:{n}" for p in files for n in undeviced_factories(p.read_text())]
    assert not bad, ("tensor factories without device= (add it, or `# cpu: <why>` on the line): " + ", ".join(bad))
