"""ControlConfig: every knob of control PPO, with CleanRL's `ppo.py` CartPole defaults."""

from __future__ import annotations

from dataclasses import dataclass

from ppoforge.config import param
from ppoforge.errors import UserError
from ppoforge.runtime.device import check_device_name
from ppoforge.runtime.metrics import REPORT_TO_HELP, report_sinks
from ppoforge.runtime.precision import PRECISION_CHOICES
from ppoforge.runtime.resilience import FaultConfig

MAX_ROLLOUT = 2**26  # transitions per rollout (num_envs * num_steps); its buffers are allocated up front


@dataclass
class ControlConfig(FaultConfig):
    preset_domain = "control"  # its built-in presets: configs/control/ (`from_preset`)
    env_id: str = param("CartPole-v1", "gymnasium environment id")
    total_steps: int = param(500_000, "environment steps to train for (all envs together)",
                             lo=1, hi=10**12, resume=True)
    seed: int = param(1, "seed for torch, numpy, python and the environments", lo=0, hi=2**32 - 1)
    num_envs: int = param(4, "parallel environments in the vector env", lo=1, hi=65_536)
    num_steps: int = param(128, "steps per environment per rollout", lo=1, hi=10_000_000)
    learning_rate: float = param(2.5e-4, "Adam learning rate", gt=0, hi=10.0)
    anneal_lr: bool = param(True, "linearly anneal the learning rate to 0 over training")
    gamma: float = param(0.99, "discount factor", lo=0.0, hi=1.0)
    gae_lambda: float = param(0.95, "GAE lambda", lo=0.0, hi=1.0)
    update_epochs: int = param(4, "PPO epochs over each rollout", lo=1, hi=10_000)
    num_minibatches: int = param(4, "minibatches per epoch", lo=1, hi=10_000_000)
    norm_adv: bool = param(True, "normalize advantages per minibatch")
    clip_coef: float = param(0.2, "PPO surrogate clipping epsilon", gt=0, hi=100.0)
    clip_vloss: bool = param(True, "clip the value loss around the old values (by clip_coef)")
    ent_coef: float = param(0.01, "entropy bonus coefficient", lo=0.0, hi=1e4)
    vf_coef: float = param(0.5, "value loss coefficient", lo=0.0, hi=1e4)
    max_grad_norm: float = param(0.5, "global gradient-norm clip", gt=0, hi=1e9)
    target_kl: float | None = param(None, "stop the epochs of an update early once approx-KL exceeds this",
                                    gt=0, hi=1e6)
    hidden_size: int = param(64, "width of the two hidden layers of actor and critic", lo=1, hi=1 << 20)
    normalize_obs: bool = param(False, "running mean/std observation normalization")
    normalize_reward: bool = param(False, "scale rewards by the running std of the discounted return")
    clip_obs: float = param(10.0, "clip normalized observations to +-this", gt=0, hi=1e9)
    clip_reward: float = param(10.0, "clip normalized rewards to +-this", gt=0, hi=1e9)
    reward_clip: float | None = param(None, "clip raw environment rewards to +-this, counted in "
                                      "guard/rewards_clipped (none: off); a non-finite reward skips the update",
                                      gt=0, hi=1e12)
    hand_gradients: bool = param(True, "on CPU in fp32, take minibatch gradients from the hand-derived numpy "
                                 "path (control/handgrad.py, ~3x faster, tested equal to autograd); false: autograd",
                                 resume=True)
    device: str = param("auto", "auto (cuda if visible, else cpu), cpu, cuda or cuda:N", resume=True)
    precision: str = param("fp32", "fp32; bf16 (autocast; CPU or CUDA); fp16 (CUDA, with a GradScaler); auto: bf16 "
                           "where the device has it natively (GPU >= sm80, CPU with AMX or AVX512-BF16), else fp32",
                           choices=PRECISION_CHOICES)
    torch_threads: int = param(1, "torch intra-op and numpy BLAS threads (tiny MLPs run fastest on one)",
                               lo=1, hi=4096, resume=True)
    checkpoint_every: int = param(50, "save a checkpoint every this many updates (and at the end)",
                                  lo=1, hi=10**9, resume=True)
    tensorboard: bool = param(True, "also write TensorBoard event files", resume=True)
    report_to: str = param("tensorboard", REPORT_TO_HELP, resume=True)
    progress: bool = param(True, "show a live progress bar", resume=True)

    def finalize(self) -> None:
        report_sinks(self.report_to)
        check_device_name(self.device)
        if self.batch_size > MAX_ROLLOUT:
            raise UserError(f"num_envs: {self.num_envs} x num_steps {self.num_steps} = {self.batch_size:,} transitions "
                            f"per rollout; allowed: <= {MAX_ROLLOUT:,}")
        if self.batch_size < self.num_minibatches:
            raise UserError(f"num_minibatches: {self.num_minibatches} exceeds the batch size "
                            f"num_envs * num_steps = {self.batch_size}")
        if self.total_steps < self.batch_size:
            raise UserError(f"total_steps: {self.total_steps} is less than one rollout "
                            f"(num_envs * num_steps = {self.batch_size}); allowed: >= {self.batch_size}")

    @property
    def batch_size(self) -> int:
        return self.num_envs * self.num_steps

    @property
    def num_updates(self) -> int:
        return self.total_steps // self.batch_size
