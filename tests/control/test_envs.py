"""A control environment is user code (control/envs.py): whatever it raises, `sys.exit` included, and
whatever it returns wrong (observations of another shape or type, NaN or inf observations or rewards, a
reward float32 cannot hold, a step that is not a 5-tuple) is one line naming the environment, exit 2,
with the last completed update checkpointed — through `gym.make` (a SyncVectorEnv of the user's class)
and through a vector entry point (the user's own VectorEnv)."""

import json
import sys

import gymnasium as gym
import numpy as np
import pytest
import torch

from ppoforge.cli import main

TINY = ["--num-envs", "2", "--num-steps", "16", "--num-minibatches", "2", "--update-epochs", "2",
        "--progress", "false", "--tensorboard", "false", "--device", "cpu", "--total-steps", "128"]
FAULT_AT = 40  # each copy's 40th step: update 3 of 4 (16 steps per copy and update)
OBS = gym.spaces.Box(-10.0, 10.0, (4,), np.float32)


def _fault(mode: str, obs, reward: float):
    """(obs, reward) as `mode` spoils them, or raises as it says."""
    if mode == "raise":
        raise ValueError("the simulator lost its connection")
    if mode == "exit":
        sys.exit(0)
    spoiled = {"shape": (np.zeros(3, np.float32), reward), "type": ("a string", reward),
               "nan_obs": (np.full(obs.shape, np.nan, np.float32), reward), "inf_reward": (obs, np.inf),
               "huge_reward": (obs, 1e308)}
    return spoiled[mode]


class Faulty(gym.Env):
    """A well-behaved 4-vector walk until its FAULT_AT-th step, then `mode`."""

    observation_space, action_space = OBS, gym.spaces.Discrete(2)

    def __init__(self, mode: str):
        self.mode, self.steps = mode, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(4, np.float32), {}

    def step(self, action):
        self.steps += 1
        obs, reward = np.full(4, 0.01 * (self.steps % 7), np.float32), 1.0
        if self.steps >= FAULT_AT:
            obs, reward = _fault(self.mode, obs, reward)
        return obs, reward, False, False, {}


class FaultyVec(gym.vector.VectorEnv):
    """The same as a user's own VectorEnv (a vector entry point): no gymnasium code between it and us."""

    # gymnasium 1.0 (the floor) has no AutoresetMode: next-step autoreset is its only behaviour
    metadata = {"autoreset_mode": gym.vector.AutoresetMode.NEXT_STEP} if hasattr(gym.vector, "AutoresetMode") else {}

    def __init__(self, num_envs: int, mode: str):
        self.num_envs, self.mode, self.steps = num_envs, mode, 0
        self.single_observation_space, self.single_action_space = OBS, gym.spaces.Discrete(2)
        self.observation_space = gym.vector.utils.batch_space(OBS, num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, num_envs)

    def reset(self, *, seed=None, options=None):
        return np.zeros((self.num_envs, 4), np.float32), {}

    def step(self, actions):
        self.steps += 1
        obs, reward = np.full((self.num_envs, 4), 0.01 * (self.steps % 7), np.float32), np.ones(self.num_envs)
        flags = np.zeros(self.num_envs, bool)
        if self.steps >= FAULT_AT:
            if self.mode == "four_tuple":  # the gym 0.21 API
                return obs, reward, flags, {}
            if self.mode == "flags":
                return obs, reward, np.zeros(self.num_envs + 1, bool), flags, {}
            one, r = _fault(self.mode, obs[0], reward[0])
            if self.mode in ("shape", "type"):
                obs = one if self.mode == "type" else np.zeros((self.num_envs, 3), np.float32)
            elif self.mode == "nan_obs":
                obs[1] = one
            else:
                reward[1] = r
        return obs, reward, flags, flags, {}


def _register(kind: str, mode: str) -> str:
    env_id = f"ppoforge-test/Faulty_{kind}_{mode}-v0"
    if kind == "make":
        gym.register(env_id, entry_point=Faulty, kwargs={"mode": mode}, max_episode_steps=1000)
    else:
        gym.register(env_id, entry_point=Faulty, vector_entry_point=FaultyVec, kwargs={"mode": mode})
    return env_id


@pytest.mark.parametrize("kind, mode, said", [
    ("make", "raise", "step raised ValueError: the simulator lost its connection"),
    ("make", "exit", "step raised SystemExit: 0; allowed: return a result, or raise an Exception to fail"),
    ("make", "shape", "step raised ValueError: "),  # gymnasium's SyncVectorEnv cannot stack it
    ("make", "type", "step raised ValueError: "),
    ("make", "nan_obs", "step returned observations with nan at index (0, 0) of shape (2, 4); allowed: "
                        "finite numbers within float32's +-3.4e+38"),
    ("make", "inf_reward", "step returned rewards with inf at index (0,) of shape (2,)"),
    ("make", "huge_reward", "step returned rewards with 1e+308 at index (0,) of shape (2,)"),
    ("vector", "exit", "step raised SystemExit: 0"),
    ("vector", "shape", "step returned observations of shape (2, 3); allowed: numbers of shape (2, 4)"),
    ("vector", "type", "step returned observations str 'a string'; allowed: numbers of shape (2, 4)"),
    ("vector", "nan_obs", "step returned observations with nan at index (1, 0) of shape (2, 4)"),
    ("vector", "inf_reward", "step returned rewards with inf at index (1,) of shape (2,)"),
    ("vector", "four_tuple", "step returned tuple (array("),
    ("vector", "flags", "step returned terminated of shape (3,); allowed: True/False flags of shape (2,)"),
])
def test_a_faulty_environment_is_one_line_naming_it_and_update_2_is_kept(capsys, tmp_path, kind, mode, said):
    env_id, run = _register(kind, mode), tmp_path / "run"
    try:
        code = main(["train", "control", "--env-id", env_id, *TINY, "--run-dir", str(run)])
    finally:
        del gym.registry[env_id]
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert code == 2 and len(err) == 1, captured
    assert err[0].startswith(f"ppoforge: error: environment {env_id}: {said}"), err[0]
    assert err[0].endswith(f"checkpoint at update 2: continue with ppoforge train control --resume {run}"), err[0]
    assert torch.load(run / "checkpoint.pt", weights_only=True)["update"] == 2
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [32, 64]


def test_an_environment_that_fails_when_it_is_made_or_reset_is_one_line(capsys, tmp_path):
    class Unbuildable(Faulty):
        def __init__(self, mode):
            raise RuntimeError("no licence for the simulator")

    class Unresettable(Faulty):
        def reset(self, *, seed=None, options=None):
            return np.zeros(4, np.float32)  # the gym 0.21 API: no info

    for cls, said in ((Unbuildable, "making it raised RuntimeError: no licence for the simulator"),
                      (Unresettable, "reset raised ValueError")):
        env_id = f"ppoforge-test/{cls.__name__}-v0"
        gym.register(env_id, entry_point=cls, kwargs={"mode": "none"})
        try:
            code = main(["train", "control", "--env-id", env_id, *TINY, "--run-dir", str(tmp_path / cls.__name__)])
        finally:
            del gym.registry[env_id]
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith(f"ppoforge: error: environment {env_id}: {said}"), err


def test_ppoforge_eval_calls_the_environment_through_the_same_boundary(capsys, tmp_path):
    env_id, run = _register("make", "nan_obs"), tmp_path / "run"
    try:
        assert main(["train", "control", "--env-id", env_id, *TINY, "--run-dir", str(run)]) == 2
        capsys.readouterr()
        code = main(["eval", str(run), "--episodes", "1"])  # its episode reaches the 40th step too
    finally:
        del gym.registry[env_id]
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"ppoforge: error: environment {env_id}: step returned observations with nan at "
                                 "index (0,) of shape (4,); allowed: finite numbers within float32's +-3.4e+38"], err
