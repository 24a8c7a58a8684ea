"""Vector environments: gymnasium's native vectorized implementation when the env has one
(CartPole's `vector_entry_point` steps all copies in one numpy call), a SyncVectorEnv otherwise.

Both use gymnasium 1.x's default next-step autoreset: the step after an episode ends returns the
reset observation with reward 0 and its action ignored. The rollout marks those steps invalid, and the
step that ended returns the true final observation — exactly what a truncation bootstrap needs.

An environment is user code, as a reward function is (runtime/usercode.py): its constructor, `reset`,
`step` and its pickling for a checkpoint go through `call_user`, and `checked_reset` / `checked_step`
validate what comes back — observations of the space's shape, rewards and flags one per copy, every
number finite within float32 (the dtype the rollout stores). Anything else, and whatever the code
raises (`sys.exit` included), is one `UserError` naming the environment (exit 2); the trainer
checkpoints the last completed update as for any failure. These checks take the place of gymnasium's
passive env checker (`gym.make(..., disable_env_checker=True)`), whose warnings about the same faults
came before the one line, and which never raised.
"""

from __future__ import annotations

import difflib
import functools

import gymnasium as gym
import numpy as np

from ppoforge.config import FLOAT32_MAX
from ppoforge.errors import UserError
from ppoforge.runtime.usercode import call_user


def check_env_id(env_id: str) -> None:
    if env_id in gym.registry:
        return
    close = difflib.get_close_matches(env_id, list(gym.registry), n=3)
    hint = f"did you mean {', '.join(close)}?" if close else "see gymnasium.pprint_registry()"
    raise UserError(f"env_id: {env_id!r} is not a registered gymnasium environment; {hint}")


def _build(env_id: str, num_envs: int) -> gym.vector.VectorEnv:
    try:
        if gym.registry[env_id].vector_entry_point:
            return gym.make_vec(env_id, num_envs=num_envs, vectorization_mode="vector_entry_point")
        # functools.partial (not make_vec's closure) keeps the vector env picklable for checkpoints.
        return gym.vector.SyncVectorEnv([functools.partial(gym.make, env_id, disable_env_checker=True)
                                         for _ in range(num_envs)])
    except (ImportError, gym.error.DependencyNotInstalled) as e:
        raise UserError(f"env_id: {env_id} needs a package that is not installed ({e})") from None


def make_vector_env(env_id: str, num_envs: int) -> gym.vector.VectorEnv:
    check_env_id(env_id)
    envs = call_user(lambda: _build(env_id, num_envs), f"environment {env_id}: making it")
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


def _short(value) -> str:
    text = " ".join(repr(value).split())  # one line: numpy prints arrays over several
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _array(value, shape: tuple, kinds: str, where: str, what: str) -> np.ndarray:
    """`value` as an array of `shape` whose dtype kind is one of `kinds` (b bool, i/u int, f float), every
    number finite within float32; else one UserError naming `where` and what it returned. Runs at every
    step: the checks that pass cost two numpy calls; the message is built only for a failure."""
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError):  # ragged lists, objects numpy cannot hold
        arr = None
    if arr is None or arr.dtype.kind not in kinds or arr.shape != shape:
        got = f"{what} of shape {arr.shape}" if arr is not None and arr.dtype.kind in kinds else \
            f"{what} {_short(value)}"
        raise UserError(f"{where} returned {got}; allowed: {'True/False flags' if kinds == 'biu' else 'numbers'} "
                        f"of shape {shape}")
    # float32 (and float16) finite is within float32; a float64 1e308 is finite but inf once stored as float32
    if arr.dtype.kind == "f" and arr.size and not (
            np.isfinite(arr).all() if arr.itemsize <= 4 else np.abs(arr).max() <= FLOAT32_MAX):
        bad = ~(np.isfinite(arr) & (np.abs(arr) <= FLOAT32_MAX))
        at = np.unravel_index(np.flatnonzero(bad)[0], shape)
        raise UserError(f"{where} returned {what} with {float(arr[at]):g} at index {tuple(int(i) for i in at)} of "
                        f"shape {shape}; allowed: finite numbers within float32's +-{FLOAT32_MAX:.1e}")
    return arr


def _shapes(envs: gym.vector.VectorEnv | gym.Env) -> tuple[tuple, tuple]:
    """(one value per copy, one observation): ((N,), (N, obs_dim)) for a vector env, ((), (obs_dim,)) for
    one env (`ppoforge eval`)."""
    if isinstance(envs, gym.vector.VectorEnv):
        return (envs.num_envs,), (envs.num_envs, *envs.single_observation_space.shape)
    return (), envs.observation_space.shape


def checked_reset(envs: gym.vector.VectorEnv | gym.Env, name: str, seed: int | None) -> np.ndarray:
    """`envs.reset(seed=seed)`'s observations, (N, obs_dim) (one env: (obs_dim,)): the environment `name`'s
    code called and its output checked at the user-code boundary."""
    where = f"environment {name}: reset"
    out = call_user(lambda: envs.reset(seed=seed), where)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise UserError(f"{where} returned {_short(out)}; allowed: (observations, info)")
    return _array(out[0], _shapes(envs)[1], "biuf", where, "observations")


def checked_step(envs: gym.vector.VectorEnv | gym.Env, name: str, action: np.ndarray) -> tuple[np.ndarray, ...]:
    """`envs.step(action)` as (observations (N, obs_dim), rewards (N,), terminated (N,) bool, truncated
    (N,) bool) (one env: no N): the environment `name`'s code called and its output checked at the
    user-code boundary."""
    where = f"environment {name}: step"
    out = call_user(lambda: envs.step(action), where)
    if not (isinstance(out, tuple) and len(out) == 5):
        raise UserError(f"{where} returned {_short(out)}; allowed: (observations, rewards, terminated, "
                        "truncated, info)")
    n, obs = _shapes(envs)
    return (_array(out[0], obs, "biuf", where, "observations"), _array(out[1], n, "biuf", where, "rewards"),
            _array(out[2], n, "biu", where, "terminated").astype(bool, copy=False),
            _array(out[3], n, "biu", where, "truncated").astype(bool, copy=False))
