"""Device selection: `auto` picks cuda when a GPU is visible, else cpu."""

from __future__ import annotations

import torch

from ppoforge.errors import UserError

DEVICE_CHOICES = ("auto", "cpu", "cuda")


def check_device_name(name: str) -> None:
    """Config-time check of a device string (existence is checked later, by resolve_device)."""
    if name.split(":")[0] not in DEVICE_CHOICES:
        raise UserError(f"device: {name!r} is not allowed; allowed: auto, cpu, cuda, cuda:N")


def resolve_device(name: str) -> torch.device:
    """Turn a config string (auto, cpu, cuda, cuda:N) into a torch.device, checking it exists."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"device: {name!r} is not a device; allowed: auto, cpu, cuda, cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device: {name!r} asked for but torch sees no CUDA GPU "
                        "(run `ppoforge doctor` to see why); use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"device: {name!r} is not supported; allowed: auto, cpu, cuda, cuda:N")
    return device
