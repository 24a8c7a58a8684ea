"""Collecting rollouts from a vector env: observation/reward normalization and episode bookkeeping.

`EnvRunner` owns everything that lives across rollouts — the envs, the current observation, the
normalizers, per-env episode accumulators — and can save and restore all of it for exact resume.
Rollout arrays are numpy and time-major, (T, N, ...).

Autoreset (gymnasium 1.x next-step mode): when step t ends an episode, obs[t + 1] is the true final
observation, so values[t + 1] = V(final obs) bootstraps a truncation; step t + 1 itself is the reset
step and is marked invalid (`valid[t + 1] = False`): its reward is 0 and its action was ignored.
Every call into the environment (`reset`, `step`, pickling it) crosses the user-code boundary of
control/envs.py: what it raises or returns wrong is one line naming it.
"""

from __future__ import annotations

import pickle
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from ppoforge.control.agent import Policy
from ppoforge.control.envs import action_bounds, checked_reset, checked_step, snapshots_exactly
from ppoforge.core.stats import RunningMeanStd
from ppoforge.runtime.usercode import call_user


@dataclass
class Rollout:
    obs: np.ndarray         # (T, N, obs_dim) float32, normalized as the policy saw them
    actions: np.ndarray     # (T, N) int or (T, N, act_dim) float32, unclipped
    logp: np.ndarray        # (T, N) float32
    values: np.ndarray      # (T, N) float32
    rewards: np.ndarray     # (T, N) float32, normalized if enabled
    terminated: np.ndarray  # (T, N) bool
    ended: np.ndarray       # (T, N) bool: terminated or truncated
    valid: np.ndarray       # (T, N) bool: False on autoreset steps
    next_value: np.ndarray  # (N,) V(obs after the last step)


class EnvRunner:
    def __init__(self, envs, seed: int, gamma: float, normalize_obs: bool, normalize_reward: bool,
                 clip_obs: float, clip_reward: float, gather=None, name: str = "environment"):
        self.envs, self.gamma, self.name = envs, gamma, name  # name: the env id, in the boundary's errors
        # the normalizers see every rank's envs under torchrun (`distributed.all_gather_np`: rows in the
        # global env order), so their statistics are the single-process ones on every rank
        self.gather = gather or (lambda a: a)
        self.clip_obs, self.clip_reward = clip_obs, clip_reward
        self.n = envs.num_envs
        obs_dim = envs.single_observation_space.shape[0]
        self.obs_rms = RunningMeanStd((obs_dim,)) if normalize_obs else None
        self.ret_rms = RunningMeanStd(()) if normalize_reward else None
        self.bounds = action_bounds(envs)
        raw = checked_reset(envs, name, seed)
        envs.action_space.seed(seed)
        self.obs = self._normalize_obs(raw)
        self.reset_pending = np.zeros(self.n, bool)
        self.return_acc = np.zeros(self.n, np.float64)
        self.ep_return = np.zeros(self.n, np.float64)
        self.ep_length = np.zeros(self.n, np.int64)
        self.finished: deque[tuple[float, int]] = deque(maxlen=100)  # (return, length), most recent last
        self.new_episodes: list[tuple[float, int]] = []  # finished during the last collect()

    def _normalize_obs(self, raw: np.ndarray) -> np.ndarray:
        if self.obs_rms is None:
            return raw.astype(np.float32, copy=False)
        self.obs_rms.update(self.gather(raw))
        return self.obs_rms.normalize(raw, self.clip_obs)

    def _normalize_reward(self, reward: np.ndarray, ended: np.ndarray, valid: np.ndarray) -> np.ndarray:
        if self.ret_rms is None:
            return reward.astype(np.float32, copy=False)
        self.return_acc = self.return_acc * self.gamma + reward
        acc, valid_all = self.gather(self.return_acc), self.gather(valid)
        if valid_all.any():
            self.ret_rms.update(acc[valid_all])
        self.return_acc[ended] = 0.0
        scaled = reward / np.sqrt(self.ret_rms.var + 1e-8)
        return np.clip(scaled, -self.clip_reward, self.clip_reward).astype(np.float32)

    def collect(self, policy: Policy, num_steps: int) -> Rollout:
        self.new_episodes = []
        obs_buf = np.empty((num_steps, *self.obs.shape), np.float32)
        logp_buf, value_buf, reward_buf = (np.empty((num_steps, self.n), np.float32) for _ in range(3))
        term_buf, ended_buf = np.empty((num_steps, self.n), bool), np.empty((num_steps, self.n), bool)
        valid_buf = np.ones((num_steps, self.n), bool)
        actions = []
        for t in range(num_steps):
            obs_buf[t] = self.obs
            action, logp_buf[t], value_buf[t] = policy.act(self.obs)
            actions.append(action)
            env_action = action if self.bounds is None else np.clip(action, *self.bounds)
            raw, reward, terminated, truncated = checked_step(self.envs, self.name, env_action)
            ended = terminated | truncated
            if self.reset_pending.any():  # those envs just reset: not a real transition
                valid = valid_buf[t] = ~self.reset_pending
                reward, terminated, ended = reward * valid, terminated & valid, ended & valid
            self.ep_return += reward
            self.ep_length += valid_buf[t]
            if ended.any():
                self._finish_episodes(ended)
            reward_buf[t] = self._normalize_reward(reward, ended, valid_buf[t])
            term_buf[t], ended_buf[t] = terminated, ended
            self.reset_pending = ended
            self.obs = self._normalize_obs(raw)
        return Rollout(obs_buf, np.stack(actions), logp_buf, value_buf, reward_buf, term_buf, ended_buf,
                       valid_buf, policy.value(self.obs))

    def _finish_episodes(self, ended: np.ndarray) -> None:
        for i in np.flatnonzero(ended):
            self.new_episodes.append((float(self.ep_return[i]), int(self.ep_length[i])))
            self.finished.append(self.new_episodes[-1])
            self.ep_return[i], self.ep_length[i] = 0.0, 0

    def state_dict(self) -> dict:
        return {
            # Gymnasium envs hold numpy state and Generators; pickling is the only general snapshot.
            "envs": torch.frombuffer(bytearray(call_user(lambda: pickle.dumps(self.envs),
                                                         f"environment {self.name}: pickling it (the checkpoint)")),
                                     dtype=torch.uint8),
            "obs": torch.from_numpy(self.obs.copy()),
            "reset_pending": torch.from_numpy(self.reset_pending.copy()),
            "return_acc": torch.from_numpy(self.return_acc.copy()),
            "ep_return": torch.from_numpy(self.ep_return.copy()),
            "ep_length": torch.from_numpy(self.ep_length.copy()),
            "finished": [list(x) for x in self.finished],
            "obs_rms": self.obs_rms.state_dict() if self.obs_rms else None,
            "ret_rms": self.ret_rms.state_dict() if self.ret_rms else None,
        }

    def load_state_dict(self, state: dict, restore_envs: bool = True, seed_offset: int = 0) -> None:
        """`restore_envs=False` (a run under torchrun: the checkpoint holds rank 0's environments only)
        keeps this runner's environments and starts fresh episodes, seeded by the step count + offset."""
        if restore_envs:
            self.envs.close()
            self.envs = pickle.loads(state["envs"].numpy().tobytes())  # our own checkpoint, written by us
        self.finished = deque((tuple(x) for x in state["finished"]), maxlen=100)
        if self.obs_rms:
            self.obs_rms.load_state_dict(state["obs_rms"])
        if self.ret_rms:
            self.ret_rms.load_state_dict(state["ret_rms"])
        if not restore_envs or not snapshots_exactly(self.envs):
            # The simulator state was not in the pickle: start fresh episodes (seeded by the step count).
            seed = int(state["ep_length"].sum()) + len(self.finished) + seed_offset
            self.obs = self._normalize_obs(checked_reset(self.envs, self.name, seed))
            return
        self.obs = state["obs"].numpy().copy()
        self.reset_pending = state["reset_pending"].numpy().copy()
        self.return_acc = state["return_acc"].numpy().copy()
        self.ep_return = state["ep_return"].numpy().copy()
        self.ep_length = state["ep_length"].numpy().copy()
