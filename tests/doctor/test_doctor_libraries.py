"""The supported-versions table and the library / torch-wheel checks."""

import sys
from dataclasses import replace

from ppoforge.doctor.gpu import GpuFacts
from ppoforge.doctor.libraries import (
    WheelFacts,
    check_libraries,
    check_torch_wheel,
    gather_installed,
    torch_installs,
)
from ppoforge.doctor.versions import SUPPORTED, constraints, in_range, parse_version, spec, torch_index_url


def test_parse_version():
    assert parse_version("2.13.0+cpu") == (2, 13, 0)
    assert parse_version("4.46.0.dev0") == (4, 46, 0)
    assert parse_version("2.6.0rc1") == (2, 6, 0)
    assert parse_version("1.0") == (1, 0)


def test_in_range_and_spec():
    assert in_range("4.46.0", "4.46", "6") and in_range("5.24.0", "4.46", "6")
    assert not in_range("4.45.2", "4.46", "6") and not in_range("6.0.0", "4.46", "6")
    assert spec("transformers") == "transformers>=4.56,<6"
    assert constraints().splitlines() == [spec(n) for n in SUPPORTED]


def test_supported_floors_are_pyprojects():
    import re
    from pathlib import Path

    import tomllib

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    declared = {}
    for req in project["dependencies"] + [r for reqs in project["optional-dependencies"].values() for r in reqs]:
        match = re.match(r"([A-Za-z0-9_.-]+)\s*>=\s*([^,;\s]+)", req)
        if match:
            declared[match.group(1).lower()] = match.group(2)
    for name, (group, low, _) in SUPPORTED.items():
        if group != "optional":
            assert declared[name] == low, name


def test_torch_index_url_picks_the_newest_cuda_the_driver_runs():
    assert torch_index_url("12.4").endswith("/cu124")
    assert torch_index_url("12.5").endswith("/cu124")
    assert torch_index_url("13.1").endswith("/cu130")
    assert torch_index_url("11.4").endswith("/cu118")  # older than any build: the oldest one
    assert torch_index_url(None).endswith("/cu126")


GOOD = {"torch": "2.13.0+cpu", "numpy": "2.4.6", "gymnasium": "1.4.0", "pyyaml": "6.0.2",
        "tensorboard": "2.21.0", "matplotlib": "3.11.2", "transformers": "5.24.0", "peft": "0.21.2",
        "datasets": "5.2.0", "safetensors": "0.8.0", "accelerate": None}


def test_supported_libraries_are_ok():
    assert check_libraries("core", GOOD).status == "ok"
    r = check_libraries("lm", GOOD)
    assert r.status == "ok" and "accelerate absent (optional)" in r.evidence


def test_incompatible_library_version_fails_with_the_pin():
    r = check_libraries("lm", {**GOOD, "transformers": "4.30.2"})
    assert r.status == "fail" and "transformers 4.30.2 (supported >=4.56,<6)" in r.evidence
    assert "pip install 'transformers>=4.56,<6'" in r.fix and "ppoforge[lm]" in r.fix


def test_missing_library_fails_and_optional_out_of_range_warns():
    assert check_libraries("core", {**GOOD, "gymnasium": None}).status == "fail"
    r = check_libraries("lm", {**GOOD, "accelerate": "0.20.0"})
    assert r.status == "warn" and r.fix == "pip install 'accelerate>=0.34,<2'"


def test_gather_installed_sees_this_env():
    assert gather_installed()["torch"] is not None


CPU_BOX = GpuFacts(None, None, [], None, None, None, None, 0, None)
GPU_BOX = GpuFacts("12.8", None, ["/dev/nvidia0"], "/usr/bin/nvidia-smi", "570.86.10", "12.8", None, 1, None)
WHEEL = WheelFacts("2.13.0+cpu", "2.13.0+cpu", "/venv/lib/python3.11/site-packages/torch", "/venv", None,
                   CPU_BOX)


def test_cpu_wheel_on_cpu_box_is_ok():
    r = check_torch_wheel(WHEEL)
    assert r.status == "ok" and "(cpu)" in r.evidence


def test_cpu_wheel_on_a_gpu_machine_fails():
    r = check_torch_wheel(replace(WHEEL, gpu=replace(GPU_BOX, wheel_cuda=None, torch_count=0)))
    assert r.status == "fail" and "CPU-only wheel" in r.evidence and r.fix.endswith("whl/cu128")


def test_cuda_wheel_on_a_cpu_machine_warns():
    f = replace(WHEEL, version="2.13.0+cu128", dist_version="2.13.0+cu128",
                gpu=replace(CPU_BOX, wheel_cuda="12.8"))
    r = check_torch_wheel(f)
    assert r.status == "warn" and "whl/cpu" in r.fix


def test_pypi_cuda_wheel_without_a_gpu_warns_with_the_gpus_fix():
    # PyPI's torch 2.6.0 is the CUDA 12.4 build: __version__ 2.6.0+cu124, pip metadata 2.6.0 (no label)
    f = replace(WHEEL, version="2.6.0+cu124", dist_version="2.6.0", gpu=replace(CPU_BOX, wheel_cuda="12.4"))
    r = check_torch_wheel(f)
    assert r.status == "warn" and "runs on the CPU" in r.evidence and "--gpus all" in r.fix


def test_local_labels_are_not_a_version_mismatch():
    for version, dist in (("2.13.0+cpu", "2.13.0"), ("2.6.0+cu124", "2.6.0"), ("2.5.1+rocm6.2", "2.5.1")):
        assert "shadow" not in check_torch_wheel(replace(WHEEL, version=version, dist_version=dist)).evidence


def test_metadata_of_another_torch_fails():
    r = check_torch_wheel(replace(WHEEL, dist_version="2.7.1"))
    assert r.status == "fail" and "belongs to another install" in r.evidence and "pip uninstall" in r.fix


def _fake_torch(root, version):
    (root / "torch").mkdir(parents=True)
    (root / "torch" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    (root / f"torch-{version}.dist-info").mkdir()
    (root / f"torch-{version}.dist-info" / "METADATA").write_text(f"Name: torch\nVersion: {version}\n")
    return root


def test_a_real_double_install_is_found_by_paths(tmp_path):
    user, system = _fake_torch(tmp_path / "user-site", "2.7.1"), _fake_torch(tmp_path / "site-packages", "2.6.0")
    packages, infos = torch_installs([str(user), str(tmp_path / "missing"), str(system), str(user)])
    assert packages == (str(user / "torch"), str(system / "torch")) and len(infos) == 2
    r = check_torch_wheel(replace(WHEEL, packages=packages, dist_infos=infos))
    assert r.status == "fail" and "2 torch packages on sys.path" in r.evidence and "first one shadows" in r.evidence
    single = torch_installs([str(system)])
    assert check_torch_wheel(replace(WHEEL, packages=single[0], dist_infos=single[1])).status == "ok"


def test_this_interpreter_has_one_torch():
    packages, infos = torch_installs(sys.path)
    assert len(packages) == 1 and len(infos) == 1, (packages, infos)


def test_torch_replaced_by_a_dependency_resolution():
    # the container pinned a CUDA torch; a later `pip install` swapped in the CPU wheel
    r = check_torch_wheel(replace(WHEEL, expected="2.13.0+cu128"))
    assert r.status == "fail" and "replaced torch" in r.evidence and "torch==2.13.0" in r.fix
    assert check_torch_wheel(replace(WHEEL, expected="cu128")).status == "fail"
    assert check_torch_wheel(replace(WHEEL, expected="2.12.0")).status == "fail"
    assert check_torch_wheel(replace(WHEEL, expected="2.13.0+cpu")).status == "ok"
    assert check_torch_wheel(replace(WHEEL, expected="cpu")).status == "ok"
