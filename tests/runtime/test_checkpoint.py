"""Atomic checkpoint writes, weights_only loads, and RNG capture."""

import random

import numpy as np
import pytest
import torch

from ppoforge.errors import UserError
from ppoforge.runtime.checkpoint import (
    atomic_write_bytes,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)


def test_roundtrip_loads_with_weights_only(tmp_path):
    state = {"w": torch.arange(3.0), "step": 7, "nested": {"a": [1, 2.5, "x"]}, "rng": rng_state()}
    save_checkpoint(tmp_path / "ck.pt", state)
    loaded = torch.load(tmp_path / "ck.pt", weights_only=True)  # what torch >= 2.6 does by default
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 7 and loaded["nested"]["a"][2] == "x"


def test_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    target = tmp_path / "ck.pt"
    save_checkpoint(target, {"version": 1})

    def broken(f):
        f.write(b"partial")
        raise RuntimeError("disk died")

    with pytest.raises(RuntimeError):
        atomic_write_bytes(target, broken)
    assert load_checkpoint(target) == {"version": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]


def test_missing_or_garbage_checkpoint_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no checkpoint"):
        load_checkpoint(tmp_path / "none.pt")
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="not a readable"):
        load_checkpoint(tmp_path / "bad.pt")


def test_rng_state_restores_every_generator(tmp_path):
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    save_checkpoint(tmp_path / "rng.pt", rng_state())
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    set_rng_state(load_checkpoint(tmp_path / "rng.pt"))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


# ---- a real full disk: a 2 MiB tmpfs --------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs mounted at tmp_path/disk (root only; skipped where mounting is not permitted)."""
    import subprocess

    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip() or mounted.returncode}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_full_disk_during_torch_save_is_no_space_left_and_keeps_the_old_checkpoint(small_disk):
    import errno

    from ppoforge.errors import EXIT_FAULT, classify

    target = small_disk / "checkpoint.pt"
    save_checkpoint(target, {"w": torch.zeros(1000), "update": 1})
    with pytest.raises(OSError) as e:
        save_checkpoint(target, {"w": torch.zeros(2**20), "update": 2})  # 4 MiB of weights on a 2 MiB disk
    assert e.value.errno == errno.ENOSPC
    code, line = classify(e.value)
    assert code == EXIT_FAULT and line.startswith(f"no space left writing {target} (No space left on device)")
    assert load_checkpoint(target)["update"] == 1  # the old one, intact
    assert [p.name for p in small_disk.iterdir()] == ["checkpoint.pt"]  # no temp file left to fill the disk


def test_a_run_whose_checkpoint_no_longer_fits_says_so_and_which_update_it_kept(small_disk):
    from ppoforge.errors import classify
    from ppoforge.runtime.resilience import RunGuard

    class Growing:  # the surface RunGuard needs; its weights outgrow the disk in update 2
        def __init__(self):
            self.w, self.update, self.optimizing = torch.zeros(1000), 0, False

        def state_dict(self):
            return {"w": self.w.clone(), **self.step_state()}

        def step_state(self):
            return {"update": self.update}

    trainer = Growing()
    guard = RunGuard(trainer, small_disk / "checkpoint.pt", "ppoforge train x --resume RUN")
    with guard.update():
        trainer.update += 1
        guard.save()
    with pytest.raises(OSError) as e, guard.update():
        trainer.w, trainer.update = torch.zeros(2**20), 2
        guard.save()
    line = classify(e.value)[1]
    assert line.startswith(f"no space left writing {small_disk / 'checkpoint.pt'}"), line
    assert line.endswith("; checkpoint at update 1: continue with ppoforge train x --resume RUN")
    assert load_checkpoint(small_disk / "checkpoint.pt")["update"] == 1
