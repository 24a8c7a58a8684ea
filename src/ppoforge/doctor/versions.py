"""The library versions ppoforge supports: one table, read by `ppoforge doctor` and the container build.

`SUPPORTED` maps a distribution name to (group, lowest supported, first unsupported). Groups: `core`
(control PPO needs it), `lm` (LM RLHF needs it), `optional` (used when present). Lower bounds are
pyproject.toml's (a test holds them equal) and `make test-floor` runs the suite on exactly them; upper
bounds are the next major version nobody has tested yet. No torch import here, so a Dockerfile step
can use it (`python -m ppoforge.doctor.versions > constraints.txt`) in a bare env.
"""

from __future__ import annotations

import re
from importlib import metadata

# name: (group, min inclusive, max exclusive or None)
SUPPORTED: dict[str, tuple[str, str, str | None]] = {
    "torch": ("core", "2.6", "3"),
    "numpy": ("core", "2.0", "3"),
    "gymnasium": ("core", "1.0", "2"),
    "pyyaml": ("core", "6.0", "7"),
    "tensorboard": ("core", "2.14", "3"),
    "matplotlib": ("core", "3.9", "4"),
    "transformers": ("lm", "4.56", "6"),
    "peft": ("lm", "0.13", "1"),
    "datasets": ("lm", "2.19", "6"),
    "safetensors": ("lm", "0.4.3", "1"),
    "accelerate": ("optional", "0.34", "2"),
}

# torch below this loads checkpoints with weights_only=False by default and transformers refuses to
# load `.bin` weights with it (CVE-2025-32434).
TORCH_SAFE_LOAD = "2.6"


def parse_version(text: str) -> tuple[int, ...]:
    """Leading numeric release parts: '2.13.0+cpu' -> (2, 13, 0); '4.46.0.dev0' -> (4, 46, 0)."""
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = re.match(r"\d+", piece)
        if not digits:
            break
        parts.append(int(digits.group()))
        if digits.group() != piece:  # '0rc1': keep 0, stop at the pre-release tag
            break
    return tuple(parts)


def at_least(version: str, minimum: str) -> bool:
    return parse_version(version) >= parse_version(minimum)


def in_range(version: str, low: str, high: str | None) -> bool:
    v = parse_version(version)
    return v >= parse_version(low) and (high is None or v < parse_version(high))


def spec(name: str) -> str:
    """pip requirement text for the supported range, e.g. 'transformers>=4.46,<6'."""
    _, low, high = SUPPORTED[name]
    return f"{name}>={low}" + (f",<{high}" if high else "")


def installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


# CUDA builds on download.pytorch.org, oldest first; a driver runs wheels built for its CUDA or older.
CUDA_WHEELS = (("11.8", "cu118"), ("12.1", "cu121"), ("12.4", "cu124"), ("12.6", "cu126"),
               ("12.8", "cu128"), ("12.9", "cu129"), ("13.0", "cu130"))


def torch_index_url(driver_cuda: str | None) -> str:
    """The PyTorch wheel index for the newest CUDA build this driver can run (cu126 when unknown)."""
    tag = "cu126"
    if driver_cuda:
        fitting = [t for cuda, t in CUDA_WHEELS if parse_version(cuda) <= parse_version(driver_cuda)]
        tag = fitting[-1] if fitting else CUDA_WHEELS[0][1]
    return f"https://download.pytorch.org/whl/{tag}"


def constraints() -> str:
    """A pip constraints file (`pip install -c`) pinning every supported range."""
    return "\n".join(spec(name) for name in SUPPORTED) + "\n"


if __name__ == "__main__":
    print(constraints(), end="")
