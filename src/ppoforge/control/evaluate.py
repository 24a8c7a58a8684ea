"""Evaluate a trained control run: episodes with the greedy and the sampled policy, mean ± std return.
The environment is called through the user-code boundary of control/envs.py, as in training."""

from __future__ import annotations

from pathlib import Path

import gymnasium as gym
import numpy as np
import torch

from ppoforge.config import load_saved_config
from ppoforge.control.agent import ActorCritic, NumpyPolicy
from ppoforge.control.config import ControlConfig
from ppoforge.control.envs import checked_reset, checked_step
from ppoforge.control.trainer import CHECKPOINT
from ppoforge.core.stats import RunningMeanStd
from ppoforge.runtime.checkpoint import load_checkpoint
from ppoforge.runtime.usercode import call_user


def load_agent(run_dir: Path) -> tuple[ControlConfig, ActorCritic, RunningMeanStd | None]:
    run_dir = Path(run_dir)
    cfg = load_saved_config(ControlConfig, run_dir / "config.yaml")
    state = load_checkpoint(run_dir / CHECKPOINT)
    agent = ActorCritic.from_state_dict(state["agent"])
    obs_rms = None
    if state["runner"]["obs_rms"] is not None:
        obs_rms = RunningMeanStd()
        obs_rms.load_state_dict(state["runner"]["obs_rms"])
    return cfg, agent, obs_rms


def run_episodes(cfg: ControlConfig, agent: ActorCritic, obs_rms: RunningMeanStd | None, episodes: int,
                 deterministic: bool, seed: int) -> list[float]:
    env = call_user(lambda: gym.make(cfg.env_id, disable_env_checker=True), f"environment {cfg.env_id}: making it")
    policy = NumpyPolicy(agent, np.random.default_rng(seed))
    space = env.action_space
    returns = []
    for ep in range(episodes):
        obs = checked_reset(env, cfg.env_id, seed + ep)
        total, done = 0.0, False
        while not done:
            x = obs[None].astype(np.float32)
            if obs_rms is not None:
                x = obs_rms.normalize(x, cfg.clip_obs)
            if deterministic:
                with torch.inference_mode():
                    action = agent.act_deterministic(torch.from_numpy(x))[0].numpy()
            else:
                action = policy.act(x)[0][0]
            if isinstance(space, gym.spaces.Box):
                action = np.clip(action, space.low, space.high)
            obs, reward, terminated, truncated = checked_step(env, cfg.env_id, action)
            total += float(reward)
            done = terminated or truncated
        returns.append(total)
    env.close()
    return returns


def evaluate(run_dir: Path, episodes: int, seed: int = 10_000) -> dict[str, list[float]]:
    cfg, agent, obs_rms = load_agent(run_dir)
    return {mode: run_episodes(cfg, agent, obs_rms, episodes, mode == "deterministic", seed)
            for mode in ("deterministic", "sampled")}
