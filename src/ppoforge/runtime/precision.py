"""The mixed-precision policy, in one place for every trainer.

- `fp32`: no autocast.
- `bf16`: autocast to bfloat16, on CUDA and on CPU. No scaler needed.
- `fp16`: autocast to float16 with a GradScaler; CUDA only (CPU fp16 autocast is slow and unscaled).
- `auto`: bf16 where the hardware computes it natively — a GPU of compute capability >= 8.0, a CPU
  with AMX or AVX-512-BF16 — else fp32. Without those CPU flags oneDNN emulates bf16: measured on an
  AMD EPYC (Zen 3, AVX2 only) a 512x512 bf16 matmul ran at 1 GFLOP/s against 94 in fp32, and a
  bf16 PPO run was ~100x slower than the same run in fp32.

Trainers call `precision.autocast()` around forwards and `precision.step(...)` for the
backward-free part of an optimizer step (unscale, clip, step, scaler update).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ppoforge.errors import UserError
from ppoforge.runtime.device import native_bf16

PRECISION_CHOICES = ("auto", "fp32", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
def resolve_precision(name: str, device: torch.device) -> str:
    """`auto` -> bf16 where `device` computes it natively, else fp32; other names unchanged."""
    if name != "auto":
        return name
    return "bf16" if native_bf16(device) else "fp32"


@dataclass
class Precision:
    name: str
    device: torch.device
    scaler: torch.amp.GradScaler | None = None

    @property
    def dtype(self) -> torch.dtype | None:
        return _DTYPES.get(self.name)

    def autocast(self):
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def weight_cache(self):
        """An autocast region around all the micro-batches of one optimizer step. Autocast caches its
        casts of trainable (leaf) weights until the outermost region exits, so fp32 master weights are
        cast once per step instead of once per micro-batch. Inside it, run forwards under `autocast()`
        and the loss and backward under `full_precision()`, exactly as they would run outside."""
        return self.autocast()

    def full_precision(self):
        """Autocast off (inside a `weight_cache` region too)."""
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, enabled=False)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def clip(self, optimizer: torch.optim.Optimizer, params, max_grad_norm: float | None) -> torch.Tensor:
        """Unscale (fp16) and clip the global grad norm; returns the pre-clip norm (a tensor, no sync)."""
        if self.scaler:
            self.scaler.unscale_(optimizer)
        if max_grad_norm is None:
            return torch.zeros((), device=self.device)
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm, foreach=True)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP shards: a replicated DTensor

    def apply(self, optimizer: torch.optim.Optimizer, skip: bool = False) -> None:
        """The optimizer step (the scaler's, under fp16), or none with `skip` (the guard refused it)."""
        if self.scaler:
            if not skip:
                self.scaler.step(optimizer)
            self.scaler.update()
        elif not skip:
            optimizer.step()

    def step(self, optimizer: torch.optim.Optimizer, params, max_grad_norm: float | None) -> torch.Tensor:
        """Unscale (fp16), clip the global grad norm, step, update the scaler. Returns the pre-clip norm."""
        norm = self.clip(optimizer, params, max_grad_norm)
        self.apply(optimizer)
        return norm

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler and state:
            self.scaler.load_state_dict(state)


def make_precision(name: str, device: torch.device) -> Precision:
    """The policy for `name` on `device` (`auto` resolved here: `Precision.name` is never auto)."""
    if name not in PRECISION_CHOICES:
        raise UserError(f"precision: {name!r} is not allowed; allowed: {', '.join(PRECISION_CHOICES)}")
    name = resolve_precision(name, device)
    if name == "fp16":
        if device.type != "cuda":
            raise UserError("precision: fp16 needs a CUDA device (it relies on GradScaler); "
                            "use bf16 on CPU")
        return Precision(name, device, torch.amp.GradScaler("cuda"))
    return Precision(name, device)
