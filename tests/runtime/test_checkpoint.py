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
