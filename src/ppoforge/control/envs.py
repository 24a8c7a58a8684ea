"""Vector environments: gymnasium's native vectorized implementation when the env has one
(CartPole's `vector_entry_point` steps all copies in one numpy call), a SyncVectorEnv otherwise.

Both use gymnasium 1.x's default next-step autoreset: the step after an episode ends returns the
reset observation with reward 0 and its action ignored. The rollout marks those steps invalid, and the
step that ended returns the true final observation — exactly what a truncation bootstrap needs.
"""

from __future__ import annotations

import difflib
import functools

import gymnasium as gym
import numpy as np

from ppoforge.errors import UserError


def check_env_id(env_id: str) -> None:
    if env_id in gym.registry:
        return
    close = difflib.get_close_matches(env_id, list(gym.registry), n=3)
    hint = f"did you mean {', '.join(close)}?" if close else "see gymnasium.pprint_registry()"
    raise UserError(f"env_id: {env_id!r} is not a registered gymnasium environment; {hint}")


def make_vector_env(env_id: str, num_envs: int) -> gym.vector.VectorEnv:
    check_env_id(env_id)
    try:
        if gym.registry[env_id].vector_entry_point:
            envs = gym.make_vec(env_id, num_envs=num_envs, vectorization_mode="vector_entry_point")
        else:
            # functools.partial (not make_vec's closure) keeps the vector env picklable for checkpoints.
            envs = gym.vector.SyncVectorEnv([functools.partial(gym.make, env_id) for _ in range(num_envs)])
    except (ImportError, gym.error.DependencyNotInstalled) as e:
        raise UserError(f"env_id: {env_id} needs a package that is not installed ({e})") from None
    space = envs.single_action_space
    if not isinstance(space, (gym.spaces.Discrete, gym.spaces.Box)):
        envs.close()
        raise UserError(f"env_id: {env_id} has a {type(space).__name__} action space; "
                        "allowed: Discrete or Box")
    if len(envs.single_observation_space.shape or ()) != 1:
        envs.close()
        raise UserError(f"env_id: {env_id} has observations of shape {envs.single_observation_space.shape}; "
                        "allowed: flat vectors (an MLP policy)")
    return envs


def snapshots_exactly(envs: gym.vector.VectorEnv) -> bool:
    """True when pickling the vector env captures the simulator state (classic control, native vector
    envs). EzPickle envs (MuJoCo, Box2D) pickle their constructor arguments only: a restored copy must
    be reset, so a resumed run restarts its in-flight episodes."""
    subs = envs.envs if isinstance(envs, gym.vector.SyncVectorEnv) else []
    return not any(isinstance(env.unwrapped, gym.utils.EzPickle) for env in subs)


def action_bounds(envs: gym.vector.VectorEnv) -> tuple[np.ndarray, np.ndarray] | None:
    """(low, high) of a Box action space, for clipping what is sent to the env; None for Discrete."""
    space = envs.single_action_space
    return (space.low, space.high) if isinstance(space, gym.spaces.Box) else None
