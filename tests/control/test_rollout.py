"""Rollout collection: next-step autoreset is masked, truncation keeps the final observation."""

import gymnasium as gym
import numpy as np
import pytest
import torch

from ppoforge.control.agent import ActorCritic, NumpyPolicy
from ppoforge.control.rollout import EnvRunner


def _runner(max_steps=10, **kw):
    envs = gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="vector_entry_point",
                        max_episode_steps=max_steps)
    defaults = dict(seed=0, gamma=0.99, normalize_obs=False, normalize_reward=False, clip_obs=10.0, clip_reward=10.0)
    return EnvRunner(envs, **{**defaults, **kw})


class ConstantPolicy:
    """Pushes left forever with a fixed value; CartPole truncates at max_steps before falling (10 steps)."""

    def act(self, obs):
        n = obs.shape[0]
        return np.zeros(n, np.int64), np.zeros(n, np.float32), np.zeros(n, np.float32)

    def value(self, obs):
        return np.zeros(obs.shape[0], np.float32)


def test_truncation_keeps_final_obs_and_masks_the_reset_step():
    runner = _runner(max_steps=5)
    ro = runner.collect(ConstantPolicy(), num_steps=12)
    # Steps 0..4 are one episode; step 4 truncates (time limit), step 5 is the autoreset step.
    assert ro.ended[4].all() and not ro.terminated[4].any()
    assert not ro.valid[5].any() and ro.valid[:5].all() and ro.valid[6:11].all()
    assert (ro.rewards[5] == 0).all()
    # obs[5] is the real final observation of the episode (it continues the trajectory), not a reset state:
    # pushing left keeps decreasing the cart velocity, so x_dot at step 5 is below x_dot at step 4.
    assert (ro.obs[5, :, 1] < ro.obs[4, :, 1]).all()
    assert (np.abs(ro.obs[6, :, 1]) < 0.05).all()  # and the step after starts from a fresh reset
    assert [length for _, length in runner.new_episodes] == [5, 5, 5, 5]


def test_termination_is_not_a_truncation():
    runner = _runner(max_steps=500)
    ro = runner.collect(ConstantPolicy(), num_steps=30)  # the pole falls after ~10 steps
    assert ro.terminated.any()
    np.testing.assert_array_equal(ro.terminated, ro.ended)


def test_normalizers_update_and_clip():
    runner = _runner(max_steps=500, normalize_obs=True, normalize_reward=True, clip_obs=0.5, clip_reward=10.0)
    agent = ActorCritic(4, 2, continuous=False)
    ro = runner.collect(NumpyPolicy(agent, np.random.default_rng(0)), num_steps=50)
    assert np.abs(ro.obs).max() <= 0.5
    assert runner.obs_rms.count > 50 and runner.ret_rms.count > 50
    assert not np.allclose(ro.rewards[ro.valid], 1.0)  # scaled by the return std


def test_state_dict_roundtrip_continues_identically():
    torch.manual_seed(0)
    agent = ActorCritic(4, 2, continuous=False)
    a, b = _runner(max_steps=20, normalize_obs=True), _runner(max_steps=20, normalize_obs=True)
    a.collect(NumpyPolicy(agent, np.random.default_rng(0)), 17)
    b.load_state_dict(a.state_dict())
    ro_a = a.collect(NumpyPolicy(agent, np.random.default_rng(5)), 23)
    ro_b = b.collect(NumpyPolicy(agent, np.random.default_rng(5)), 23)
    np.testing.assert_array_equal(ro_a.obs, ro_b.obs)
    np.testing.assert_array_equal(ro_a.rewards, ro_b.rewards)


class CounterEnv(gym.Env, gym.utils.EzPickle):
    """Like MuJoCo envs, pickles only its constructor arguments: its state is lost on restore."""

    observation_space = gym.spaces.Box(-1e9, 1e9, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self):
        gym.utils.EzPickle.__init__(self)
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.array([0.0], np.float32), {}

    def step(self, action):
        self.t += 1
        return np.array([self.t], np.float32), 1.0, False, self.t >= 50, {}


def test_ezpickle_envs_restart_episodes_on_restore():
    import functools

    envs = gym.vector.SyncVectorEnv([functools.partial(CounterEnv) for _ in range(2)])
    runner = EnvRunner(envs, seed=0, gamma=0.99, normalize_obs=False, normalize_reward=False,
                       clip_obs=10.0, clip_reward=10.0)
    runner.collect(ConstantPolicy(), num_steps=7)
    assert runner.obs[0, 0] == 7
    fresh = EnvRunner(gym.vector.SyncVectorEnv([functools.partial(CounterEnv) for _ in range(2)]), seed=0,
                      gamma=0.99, normalize_obs=False, normalize_reward=False, clip_obs=10.0, clip_reward=10.0)
    fresh.load_state_dict(runner.state_dict())
    assert fresh.obs[0, 0] == 0 and not fresh.reset_pending.any()  # a new episode, consistently reset
    ro = fresh.collect(ConstantPolicy(), num_steps=3)
    assert ro.valid.all() and ro.obs[:, 0, 0].tolist() == [0.0, 1.0, 2.0]


class _Counter(gym.Env):
    """obs = [steps since reset], reward 1 per step, never terminates: only a time limit ends it."""

    observation_space = gym.spaces.Box(0, 100, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.array([0.0], np.float32), {}

    def step(self, action):
        self.t += 1
        return np.array([float(self.t)], np.float32), 1.0, False, False, {}


class _KnownValue(ConstantPolicy):
    """V(s) = 10 + s."""

    def act(self, obs):
        action, logp, _ = super().act(obs)
        return action, logp, self.value(obs)

    def value(self, obs):
        return (10.0 + obs[:, 0]).astype(np.float32)


def test_time_limit_bootstraps_from_the_final_observation_end_to_end():
    """The trainer's wiring (collect -> rollout_advantages -> _flatten): with a time limit of 5 the 5th
    step's advantage bootstraps from V(final obs), and the autoreset step is not in the batch."""
    from ppoforge.control.envs import make_vector_env
    from ppoforge.control.trainer import _flatten, rollout_advantages

    gym.register("ppoforge-test/Counter-v0", entry_point=_Counter, max_episode_steps=5)
    try:
        runner = EnvRunner(make_vector_env("ppoforge-test/Counter-v0", 1), seed=0, gamma=0.9, normalize_obs=False,
                           normalize_reward=False, clip_obs=10.0, clip_reward=10.0)
        ro = runner.collect(_KnownValue(), num_steps=8)
    finally:
        del gym.registry["ppoforge-test/Counter-v0"]
    gamma, lam = 0.9, 0.8
    adv, ret = rollout_advantages(ro, gamma, lam)
    v = lambda s: 10.0 + s  # noqa: E731
    assert ro.obs[:6, 0, 0].tolist() == [0, 1, 2, 3, 4, 5] and ro.ended[4, 0] and not ro.terminated[4, 0]
    # s4 = 4: r = 1, truncated, final obs 5 -> A4 = 1 + gamma * V(5) - V(4); the chain stops there
    assert adv[4, 0] == pytest.approx(1 + gamma * v(5) - v(4))
    delta3 = 1 + gamma * v(4) - v(3)
    assert adv[3, 0] == pytest.approx(delta3 + gamma * lam * adv[4, 0])
    batch = _flatten(ro, adv, ret, torch.device("cpu"))
    assert not ro.valid[5, 0] and batch["obs"].shape[0] == 7  # 8 steps, the reset step dropped
    assert batch["adv"][:5].tolist() == pytest.approx(adv[:5, 0].tolist())
    assert batch["adv"][5:].tolist() == pytest.approx(adv[6:, 0].tolist())  # step 5 skipped
