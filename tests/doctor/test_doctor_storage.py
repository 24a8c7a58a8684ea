"""Runs dir persistence (mountinfo, containers), the HF cache, and the checkpoint round trip."""

from dataclasses import dataclass, replace

import torch

from ppoforge.doctor import storage
from ppoforge.doctor.storage import (
    DirFacts,
    Mount,
    check_checkpoint_roundtrip,
    check_hf_cache,
    check_runs_dir,
    gather_dir,
    mount_of,
    parse_mountinfo,
)

GIB = 2**30
MOUNTINFO = """\
612 540 0:59 / / rw,relatime master:262 - overlay overlay rw,lowerdir=/var/lib/docker/overlay2/l/X
613 612 0:62 / /proc rw,nosuid - proc proc rw
700 612 259:2 /home/me/runs /work/runs rw,relatime - ext4 /dev/nvme0n1p2 rw
701 612 259:2 /home/me/my\\040data /data/my\\040data rw,relatime - ext4 /dev/nvme0n1p2 rw
702 612 0:70 / /scratch rw - tmpfs tmpfs rw,size=1024k
"""


def test_parse_mountinfo_and_find_the_mount_of_a_path():
    mounts = parse_mountinfo(MOUNTINFO)
    assert mounts[0] == Mount("/", "overlay", "overlay")
    assert mount_of("/work/runs/cartpole-1", mounts).point == "/work/runs"
    assert mount_of("/work/runsX", mounts).point == "/"  # a prefix of the name is not a parent dir
    assert mount_of("/data/my data/x", mounts).point == "/data/my data"
    assert mount_of("/scratch", mounts).fstype == "tmpfs"


RUNS = DirFacts("/work/runs", None, 200 * GIB, Mount("/work/runs", "ext4", "/dev/nvme0n1p2"), "/.dockerenv")


def test_mounted_volume_in_a_container_is_ok():
    r = check_runs_dir(RUNS)
    assert r.status == "ok" and "mounted volume /work/runs" in r.evidence


def test_unmounted_checkpoint_dir_in_a_container_fails():
    r = check_runs_dir(replace(RUNS, path="/app/runs", mount=Mount("/", "overlay", "overlay")))
    assert r.status == "fail" and "vanishes with the container" in r.evidence
    assert "docker run -v /host/runs:/app/runs" in r.fix


def test_container_root_that_is_not_an_overlay_warns():
    r = check_runs_dir(replace(RUNS, mount=Mount("/", "ext4", "/dev/vda")))
    assert r.status == "warn" and "not a mounted volume" in r.evidence


def test_tmpfs_fails_even_outside_a_container():
    r = check_runs_dir(replace(RUNS, container=None, mount=Mount("/scratch", "tmpfs", "tmpfs")))
    assert r.status == "fail" and "in memory" in r.evidence


def test_outside_a_container_the_root_fs_is_fine():
    assert check_runs_dir(replace(RUNS, container=None, mount=Mount("/", "ext4", "/dev/sda1"))).status == "ok"


def test_not_writable_or_full_fails():
    r = check_runs_dir(replace(RUNS, error="cannot create files in /work (Read-only file system)"))
    assert r.status == "fail" and "--runs-root" in r.fix
    assert check_runs_dir(replace(RUNS, free_bytes=GIB // 2)).status == "fail"
    assert check_runs_dir(replace(RUNS, free_bytes=3 * GIB)).status == "warn"


def test_gather_dir_on_a_real_dir(tmp_path):
    f = gather_dir(tmp_path / "runs" / "not-yet", container=None)
    assert f.error is None and f.free_bytes > 0 and f.mount is not None
    assert not (tmp_path / "runs").exists()  # probing writability leaves nothing behind


def test_container_hint_from_env(monkeypatch):
    monkeypatch.setattr(storage.os.path, "exists", lambda p: False)
    monkeypatch.setenv("container", "podman")
    assert storage.container_hint() == "container=podman"


def test_hf_cache_offline_and_unmounted(tmp_path):
    (tmp_path / "hub" / "models--Qwen--Qwen2-0.5B").mkdir(parents=True)
    f = DirFacts(str(tmp_path), None, 50 * GIB, Mount("/", "ext4", "/dev/sda1"), None)
    r = check_hf_cache(f, explicit=True, env={"HF_HUB_OFFLINE": "1"}, hub=(False, "HF_HUB_OFFLINE=1, not asked"))
    assert r.status == "ok" and "1 model(s)" in r.evidence and "offline (HF_HUB_OFFLINE=1" in r.evidence
    in_container = replace(f, container="/.dockerenv", mount=Mount("/", "overlay", "overlay"))
    r = check_hf_cache(in_container, explicit=False, env={}, hub=(True, "https://huggingface.co answered HTTP 200"))
    assert r.status == "warn" and "downloaded again" in r.evidence and "HF_HOME" in r.fix


def test_checkpoint_round_trip(tmp_path):
    r = check_checkpoint_roundtrip(tmp_path)
    assert r.status == "ok" and "identical" in r.evidence and "weights_only=True" in r.evidence


@dataclass
class NotAllowed:  # weights_only loading refuses arbitrary classes
    x: int = 1


def test_checkpoint_with_a_pickled_object_fails(tmp_path):
    r = check_checkpoint_roundtrip(tmp_path, state={"agent": {"w": torch.ones(2)}, "extra": NotAllowed()})
    assert r.status == "fail" and "not a readable ppoforge checkpoint" in r.evidence
    assert "ppoforge bug" in r.fix
