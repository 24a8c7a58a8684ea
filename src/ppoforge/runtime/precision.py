"""The mixed-precision policy, in one place for every trainer.

- `fp32`: no autocast.
- `bf16`: autocast to bfloat16, on CUDA and on CPU (AMX makes it ~4x faster there). No scaler needed.
- `fp16`: autocast to float16 with a GradScaler; CUDA only (CPU fp16 autocast is slow and unscaled).

Trainers call `precision.autocast()` around forwards and `precision.step(...)` for the
backward-free part of an optimizer step (unscale, clip, step, scaler update).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ppoforge.errors import UserError

PRECISION_CHOICES = ("fp32", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


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

    def step(self, optimizer: torch.optim.Optimizer, params, max_grad_norm: float | None) -> torch.Tensor:
        """Unscale (fp16), clip the global grad norm, step, update the scaler. Returns the pre-clip norm."""
        if self.scaler:
            self.scaler.unscale_(optimizer)
        if max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm, foreach=True)
        else:
            norm = torch.zeros(())
        if self.scaler:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
        return norm

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler and state:
            self.scaler.load_state_dict(state)


def make_precision(name: str, device: torch.device) -> Precision:
    if name not in PRECISION_CHOICES:
        raise UserError(f"precision: {name!r} is not allowed; allowed: {', '.join(PRECISION_CHOICES)}")
    if name == "fp16":
        if device.type != "cuda":
            raise UserError("precision: fp16 needs a CUDA device (it relies on GradScaler); "
                            "use bf16 on CPU")
        return Precision(name, device, torch.amp.GradScaler("cuda"))
    return Precision(name, device)
