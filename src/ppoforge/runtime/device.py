"""Device selection (`auto` picks cuda when a GPU is visible, else cpu) and what a device computes natively."""

from __future__ import annotations

import platform
from pathlib import Path

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


CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo flags of native bf16 dot products


def read_cpuinfo(path: str = "/proc/cpuinfo") -> tuple[str, set[str]]:
    """(model name, flags) of the first CPU; flags are empty where there is no /proc/cpuinfo (macOS)."""
    model, flags = "", set()
    try:
        text = Path(path).read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not model:
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return model or platform.processor() or "unknown", flags


def native_bf16(device: torch.device) -> bool:
    """Does `device` compute bf16 natively? A GPU of compute capability >= 8.0; a CPU with AMX or
    AVX-512-BF16 (elsewhere oneDNN emulates it, far slower than fp32)."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    return bool(set(CPU_BF16_FLAGS) & read_cpuinfo()[1])
