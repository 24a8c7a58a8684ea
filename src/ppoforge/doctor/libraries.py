"""Installed library versions against `versions.SUPPORTED`, and whether torch is the wheel you meant.

Versions come from package metadata (`importlib.metadata`), never from importing the library, so this
is fast and works when an import would crash. The torch-wheel check catches a dependency resolution
that swapped torch underneath you: a CPU wheel on a GPU machine, a CUDA wheel on a CPU one, two torch
installs shadowing each other, or a torch other than the one the environment pinned in
`PPOFORGE_EXPECT_TORCH` (e.g. `2.13.0+cu128`, or just `cpu` / `cu128`; the container build sets it).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ppoforge.doctor.gpu import GpuFacts
from ppoforge.doctor.report import CheckResult, fail, ok, warn
from ppoforge.doctor.versions import SUPPORTED, in_range, installed_version, spec, torch_index_url


def gather_installed() -> dict[str, str | None]:
    return {name: installed_version(name) for name in SUPPORTED}


def check_libraries(group: str, installed: dict[str, str | None]) -> CheckResult:
    """`libraries_core` / `libraries_lm`: every library of the group installed and in range.

    Optional libraries are reported with the lm group: out of range is a warning, absent is fine.
    """
    name = f"libraries_{group}"
    names = [n for n, (g, _, _) in SUPPORTED.items() if g == group or (group == "lm" and g == "optional")]
    seen, bad, odd = [], [], []
    for lib in names:
        kind, low, high = SUPPORTED[lib]
        version = installed.get(lib)
        if version is None:
            seen.append(f"{lib} absent" + (" (optional)" if kind == "optional" else ""))
            if kind != "optional":
                bad.append(lib)
            continue
        fits = in_range(version, low, high)
        seen.append(f"{lib} {version}" + ("" if fits else f" (supported {spec(lib).removeprefix(lib)})"))
        if not fits:
            (odd if kind == "optional" else bad).append(lib)
    evidence = ", ".join(seen)
    if bad:
        pins = " ".join(f"'{spec(lib)}'" for lib in bad)
        return fail(name, evidence, f"pip install {pins}" + ("  (all LM extras: pip install 'ppoforge[lm]')"
                                                             if group == "lm" else ""))
    if odd:
        return warn(name, evidence, "pip install " + " ".join(f"'{spec(lib)}'" for lib in odd))
    return ok(name, evidence)


@dataclass
class WheelFacts:
    version: str              # torch.__version__ (what was imported), e.g. 2.6.0+cu124
    dist_version: str | None  # pip's metadata for the torch distribution, e.g. 2.6.0 (PyPI drops the label)
    location: str             # where the imported torch lives
    prefix: str               # sys.prefix of this interpreter
    expected: str | None      # PPOFORGE_EXPECT_TORCH
    gpu: GpuFacts
    packages: tuple[str, ...] = ()    # every `torch/` package dir on sys.path, in import order
    dist_infos: tuple[str, ...] = ()  # every torch-*.dist-info / .egg-info on sys.path


def torch_installs(paths: list[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(torch package dirs, torch dist-info dirs) found on the import path `paths`, deduplicated.

    Two of either is a real double install: the first package shadows the other, and pip's metadata
    may describe the one that is not imported."""
    packages, infos = [], []
    for entry in dict.fromkeys(str(Path(p).resolve()) for p in paths if p and Path(p).is_dir()):
        if (Path(entry) / "torch" / "__init__.py").is_file():
            packages.append(str(Path(entry) / "torch"))
        infos += sorted(str(d) for d in Path(entry).glob("torch-*.*-info") if d.is_dir())
    return tuple(packages), tuple(infos)


def gather_wheel(gpu: GpuFacts) -> WheelFacts:
    packages, infos = torch_installs(sys.path)
    return WheelFacts(torch.__version__, installed_version("torch"), str(Path(torch.__file__).parent),
                      sys.prefix, os.environ.get("PPOFORGE_EXPECT_TORCH"), gpu, packages, infos)


def public_version(version: str) -> str:
    """The version without its local label: '2.6.0+cu124' -> '2.6.0' (PyPI's metadata has none)."""
    return version.split("+", 1)[0]


def _shadowing(f: WheelFacts) -> str | None:
    """Why two torch installs shadow each other, or None: judged by paths, and by the public versions."""
    if len(f.packages) > 1:
        return f"{len(f.packages)} torch packages on sys.path ({', '.join(f.packages)}): the first one shadows the rest"
    if len(f.dist_infos) > 1:
        return f"{len(f.dist_infos)} torch installs' metadata on sys.path ({', '.join(f.dist_infos)})"
    if f.dist_version and public_version(f.dist_version) != public_version(f.version):
        return (f"pip metadata says torch {f.dist_version} but torch {f.version} is imported: the metadata "
                "belongs to another install")
    return None


def _local_tag(f: WheelFacts) -> str:
    """'cpu', 'cu128', 'rocm6.2': the wheel flavour, from the build facts rather than the version text."""
    if f.gpu.wheel_hip:
        return f"rocm{f.gpu.wheel_hip}"
    return "cu" + f.gpu.wheel_cuda.replace(".", "") if f.gpu.wheel_cuda else "cpu"


def _expected_mismatch(f: WheelFacts) -> str | None:
    want = f.expected.strip()
    tag = _local_tag(f)
    if "." in want.split("+")[0] or want[:1].isdigit():  # a version, maybe with +tag
        base, _, want_tag = want.partition("+")
        if public_version(f.version) != base or (want_tag and want_tag != tag):
            return f"PPOFORGE_EXPECT_TORCH={want} but torch {f.version} ({tag}) is installed"
    elif want != tag:
        return f"PPOFORGE_EXPECT_TORCH={want} but the installed torch {f.version} is a {tag} wheel"
    return None


def check_torch_wheel(f: WheelFacts) -> CheckResult:
    name = "torch_wheel"
    tag = _local_tag(f)
    index = torch_index_url(f.gpu.driver_cuda)
    evidence = f"torch {f.version} ({tag}) from {f.location}"
    shadowing = _shadowing(f)
    if shadowing:
        return fail(name, f"{evidence}; {shadowing}",
                    "pip uninstall -y torch (repeat until none is left), then reinstall it")
    if f.expected and _expected_mismatch(f):
        return fail(name, f"{evidence}; {_expected_mismatch(f)}: a dependency resolution replaced torch",
                    f"pip install --force-reinstall 'torch=={f.expected.split('+')[0]}' --index-url "
                    f"{index if 'cu' in f.expected else 'https://download.pytorch.org/whl/cpu'}; install "
                    "later packages with -c constraints.txt (python -m ppoforge.doctor.versions)")
    if tag == "cpu" and f.gpu.hardware:
        return fail(name, evidence + "; this machine has an NVIDIA GPU but torch is a CPU-only wheel",
                    f"pip install --force-reinstall torch --index-url {index}")
    if tag != "cpu" and not f.gpu.hardware and not f.gpu.torch_count:
        return warn(name, evidence + "; a GPU wheel on a machine without a visible GPU: it runs on the CPU "
                    "(a PyTorch-CUDA image started without GPUs, or gigabytes of unused CUDA libraries pulled "
                    "in by a dependency's resolution)",
                    "in a container: docker run --gpus all ...; on a CPU-only machine: pip install "
                    "--force-reinstall torch --index-url https://download.pytorch.org/whl/cpu")
    return ok(name, evidence + ("; matches PPOFORGE_EXPECT_TORCH" if f.expected else ""))
