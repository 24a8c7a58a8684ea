"""Control PPO, top to bottom: collect -> advantages -> update -> log -> checkpoint.

Implements the 13 core details of "The 37 Implementation Details of PPO" (Huang et al. 2022) —
vector envs, orthogonal init, Adam eps 1e-5, LR annealing, GAE, shuffled minibatches, per-minibatch
advantage normalization, clipped surrogate, value clipping, entropy bonus, global grad-norm clip,
approx-KL/clipfrac diagnostics, separate actor and critic — and the continuous-action ones (state-
independent log-std, obs and reward normalization with clipping, action clipping with the unclipped
action stored). Deliberate deviation from CleanRL: time-limit truncations bootstrap from V(final obs).
Under torchrun each rank steps its slice of the `num_envs` environments (seeded by their global index,
actions drawn from the global batch's random numbers), minibatch losses are weighted by each rank's
share of the global minibatch, advantages are normalized with global statistics and the gradients are
all-reduced once per step (`runtime/distributed.py`); the hand-derived gradients are single-process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from threadpoolctl import threadpool_limits

from ppoforge.config import config_to_dict
from ppoforge.control.agent import ActorCritic, make_policy
from ppoforge.control.config import ControlConfig
from ppoforge.control.envs import make_vector_env
from ppoforge.control.rollout import EnvRunner, Rollout
from ppoforge.control.update import UpdateStats, make_step, ppo_update
from ppoforge.core.advantages import gae
from ppoforge.runtime import distributed, rundir, runloop, runstate, trust
from ppoforge.runtime.checkpoint import resume_from, seed_everything
from ppoforge.runtime.device import resolve_device
from ppoforge.runtime.metrics import open_run_dir, plot_curves, write_summary
from ppoforge.runtime.precision import make_precision
from ppoforge.runtime.progress import Progress
from ppoforge.runtime.resilience import NonFiniteGuard, RunGuard
from ppoforge.runtime.timeouts import call_with_timeout

CHECKPOINT = "checkpoint.pt"


@dataclass
class TrainResult:
    run_dir: Path
    global_step: int
    updates: int
    recent_returns: list[float]   # the last <= 100 finished episodes, oldest first
    stopped_by: str | None        # a signal name when interrupted


def rollout_advantages(ro: Rollout, gamma: float, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """GAE advantages and returns, (T, N). next_values[t] = V(obs after step t): on a truncation that is
    the final observation (see rollout.py), so the time limit bootstraps; after the last step, V(next obs)."""
    next_values = np.concatenate([ro.values[1:], ro.next_value[None]], 0)
    adv, ret = gae(*(torch.from_numpy(x) for x in (ro.rewards, ro.values, next_values, ro.terminated, ro.ended)),
                   gamma=gamma, lam=lam)
    return adv.numpy(), ret.numpy()


def _flatten(ro: Rollout, adv: np.ndarray, ret: np.ndarray, device: torch.device) -> dict[str, torch.Tensor]:
    """Valid transitions only, as (M, ...) tensors on the training device."""
    keep = ro.valid.reshape(-1)
    cols = {"obs": ro.obs, "actions": ro.actions, "logp": ro.logp, "values": ro.values, "adv": adv, "ret": ret}
    return {k: torch.from_numpy(v.reshape(keep.shape[0], *v.shape[2:])[keep]).to(device) for k, v in cols.items()}


def explained_variance(pred: np.ndarray, target: np.ndarray) -> float:
    var = np.var(target)
    return float("nan") if var == 0 else float(1 - np.var(target - pred) / var)


class ControlTrainer:
    """Holds the run's state; `run()` trains until total_steps, a stop signal, or an error."""

    def __init__(self, cfg: ControlConfig, run_dir: Path):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        torch.set_num_threads(cfg.torch_threads)
        # numpy's BLAS too (rollout policy, hand-derived gradients): at 128 x 64 a second BLAS thread
        # only waits, and on a busy machine it made the hand-gradient update 4x slower
        threadpool_limits(cfg.torch_threads, user_api="blas")
        seed_everything(cfg.seed)
        self.device = resolve_device(cfg.device)
        self.world = distributed.init(cfg.dist_timeout, self.device)
        self.run_dir = Path(distributed.rank0_value(str(self.run_dir)))
        self.envs_shard = distributed.shard(cfg.num_envs, "num_envs")  # this rank's environments
        self.precision = make_precision(cfg.precision, self.device)
        envs = make_vector_env(cfg.env_id, self.envs_shard.stop - self.envs_shard.start)
        space = envs.single_action_space
        continuous = space.shape != ()
        act_dim = int(np.prod(space.shape)) if continuous else int(space.n)
        self.agent = ActorCritic(envs.single_observation_space.shape[0], act_dim, continuous,
                                 cfg.hidden_size).to(self.device)
        self.optimizer = torch.optim.Adam(self.agent.parameters(), lr=cfg.learning_rate, eps=1e-5,
                                          **({"fused": True} if self.device.type in ("cpu", "cuda") else {}))
        self.runner = EnvRunner(envs, cfg.seed + self.envs_shard.start, cfg.gamma, cfg.normalize_obs,
                                cfg.normalize_reward, cfg.clip_obs, cfg.clip_reward,  # env i: seed + global i
                                gather=distributed.all_gather_np if distributed.collectives() else None,
                                name=cfg.env_id)
        self.policy_rng = np.random.default_rng(cfg.seed)
        self.policy = make_policy(self.agent, distributed.sliced_rng(self.policy_rng, self.envs_shard, cfg.num_envs))
        distributed.broadcast_params(self.agent.parameters())
        distributed.reseed(cfg.seed)
        self.guard = NonFiniteGuard(cfg.nonfinite_patience, cfg.nonfinite_action)
        self.step = make_step(self.agent, self.optimizer, self.precision, cfg, self.guard)
        self.update = 0  # completed updates
        self.lr_scale = 1.0  # lowered by each non-finite rollback
        self.optimizing = False  # has the current update stepped the optimizer (see runtime/resilience.py)
        self.checkpoint = self.run_dir / CHECKPOINT
        self.run_guard = RunGuard(self, self.checkpoint, trust.resume_command("control", self.run_dir, cfg))

    # ---- checkpoint (runtime/runstate.py) ---------------------------------------------------------
    def state_dict(self) -> dict:
        return {"agent": self.agent.state_dict(), "optimizer": self.optimizer.state_dict(),
                "precision": self.precision.state_dict(), "config": config_to_dict(self.cfg),
                "world_size": self.world.size, **self.step_state()}

    def step_state(self) -> dict:
        """What an update changes besides the weights and the optimizer: the run state, the environments
        and the policy's RNG (RunGuard copies the whole state, small enough, in its place)."""
        return {"runner": self.runner.state_dict(), "policy_rng": self.policy_rng.bit_generator.state,
                **runstate.step_state(self)}

    def resume(self) -> None:
        resume_from(self, self.checkpoint)

    def load(self, state: dict) -> None:
        self.agent.load_state_dict(state["agent"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.precision.load_state_dict(state["precision"])
        # under torchrun rank 0's environments are not the others': every rank restarts its episodes
        distributed_run = self.world.size > 1 or state["world_size"] > 1
        self.runner.load_state_dict(state["runner"], restore_envs=not distributed_run,
                                    seed_offset=self.envs_shard.start)
        self.policy_rng.bit_generator.state = state["policy_rng"]
        runstate.load_step_state(self, state)

    def rollback(self) -> None:
        runstate.rollback(self, [self.run_dir / "metrics.jsonl"], steps_per_update=self.cfg.batch_size)

    # ---- training ---------------------------------------------------------------------------------
    def run(self) -> TrainResult:
        """Train to total_steps (or a stop signal): `open_run`, the updates with `after_update`, `close_run`,
        `summarize` (`runtime/runloop.py`; the Python API's `step()` runs them one update at a time)."""
        return runloop.run(self, self.cfg.num_updates, self.cfg.checkpoint_every)

    def open_run(self) -> None:
        """Before this process's first update: the run dir's config and logs, the progress bar (and on a fresh run
        with rollbacks a checkpoint to go back to)."""
        cfg, main = self.cfg, self.world.is_main  # rank 0 alone writes the run dir
        self.logger = open_run_dir(self.run_dir, cfg, distributed.describe(cfg.num_envs, "envs"),
                                   self.update * cfg.batch_size, main=main)
        self.progress = Progress(cfg.num_updates * cfg.batch_size, self.update * cfg.batch_size,
                                 enabled=cfg.progress and main, unit="step")
        self.last: dict = {}  # the last metrics of each name
        try:
            if self.update == 0 and cfg.nonfinite_action == "rollback":
                self.run_guard.save()  # a rollback needs a checkpoint to go back to
        except BaseException:
            self.close_run()
            raise

    def after_update(self, metrics: dict) -> None:
        self.last.update(metrics)
        self.logger.log(self.update * self.cfg.batch_size, metrics)
        self.progress.advance(self.cfg.batch_size, sps=metrics["charts/SPS"], ret=metrics.get("charts/episodic_return"))

    def finish(self) -> None:
        """No export: the agent is the checkpoint's."""

    def close_run(self) -> None:
        self.progress.close()
        self.logger.close()

    def summarize(self, stopped: str | None, export: None = None) -> TrainResult:
        result = TrainResult(self.run_dir, self.update * self.cfg.batch_size, self.update,
                             [r for r, _ in self.runner.finished], stopped)
        if self.world.is_main:
            write_summary(self.run_dir, "control", result.global_step, "env_step", stopped, None, self.last,
                          updates=result.updates)
        return result

    def plot(self) -> None:
        """learning_curve.png from metrics.jsonl (rank 0)."""
        if self.world.is_main:
            plot_curves(self.run_dir / "metrics.jsonl", ["charts/episodic_return", "losses/value_loss",
                        "losses/approx_kl"], self.run_dir / "learning_curve.png", title=self.cfg.env_id)

    def train_one_update(self) -> dict:
        cfg = self.cfg
        start = time.perf_counter()
        anneal = (1.0 - self.update / cfg.num_updates) if cfg.anneal_lr else 1.0
        self.optimizer.param_groups[0]["lr"] = cfg.learning_rate * self.lr_scale * anneal
        ro = distributed.checked(call_with_timeout, lambda: self.runner.collect(self.policy, cfg.num_steps),
                                 cfg.call_timeout, f"a rollout of {cfg.num_steps} steps of {cfg.env_id}")
        rewards = torch.from_numpy(ro.rewards)  # (T, N): the guard sees every rank's, and decides alike
        if distributed.collectives():
            rewards = distributed.all_gather(rewards.T.contiguous()).T
        finite, rewards = self.guard.rewards_ok(rewards, cfg.reward_clip)
        ro.rewards = (rewards[:, self.envs_shard] if distributed.collectives() else rewards).numpy()
        adv, ret = rollout_advantages(ro, cfg.gamma, cfg.gae_lambda)
        batch = _flatten(ro, adv, ret, self.device)
        self.optimizing = True
        stats = ppo_update(self.step, batch, cfg) if finite else UpdateStats(*[float("nan")] * 6)
        metrics = {f"losses/{k}": v for k, v in stats._asdict().items()}
        metrics.update(self.guard.counts)
        self.update += 1
        keep = ro.valid
        metrics["losses/explained_variance"] = explained_variance(ro.values[keep], ret[keep])
        metrics["charts/learning_rate"] = self.optimizer.param_groups[0]["lr"]
        episodes = distributed.gather_rows(self.runner.new_episodes)  # every rank's environments
        if episodes:
            metrics["charts/episodic_return"] = float(np.mean([r for r, _ in episodes]))
            metrics["charts/episodic_length"] = float(np.mean([n for _, n in episodes]))
        metrics["charts/SPS"] = cfg.batch_size / (time.perf_counter() - start)
        metrics["perf/world_size"] = self.world.size  # envs per rank: num_envs / this
        return metrics


def train(cfg: ControlConfig, run_dir: Path, resume: bool = False) -> TrainResult:
    """Train (or, with resume, continue) a run in `run_dir`, then draw its learning curve."""
    with rundir.hold(run_dir):  # one run at a time in a run dir
        trainer = ControlTrainer(cfg, run_dir)
        if resume:
            trainer.resume()
        result = trainer.run()
        trainer.plot()
    return result
