"""Print what identifies the base image's torch: torch and its CUDA stack (nvidia-*, triton), by version and files.

    python docker/torch_fingerprint.py > /tmp/torch.before     # before installing anything
    ...                                                         # pip install ...
    python docker/torch_fingerprint.py | diff /tmp/torch.before -

The Dockerfile runs it around its installs, so a build in which pip replaced, upgraded or rebuilt torch
or one of its CUDA libraries (nvidia-*, triton) fails there and then, not at the first CUDA call on a
GPU box. Files are compared by the hash of each distribution's RECORD (which lists every file's hash).
Torch's pure-Python requirements (filelock, jinja2, ...) are left out: the lock may move them.
Only the standard library: it runs in the bare base image, before anything is installed.
"""

import hashlib
import re
import sys
from importlib import metadata


def fingerprint() -> list[str]:
    torches = [d for d in metadata.distributions() if (d.metadata["Name"] or "").lower() == "torch"]
    if len(torches) != 1:
        sys.exit(f"expected exactly one torch distribution, found {len(torches)}")
    lines = [f"torch distributions: {len(torches)}"]
    required = {re.match(r"[A-Za-z0-9._-]+", r).group().lower() for r in torches[0].requires or []}
    names = ["torch"] + sorted(n for n in required if n.startswith("nvidia-") or n in ("triton", "pytorch-triton"))
    for name in names:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional requirement (an extra, another platform's marker) that is not installed
        record = dist.read_text("RECORD") or ""
        lines.append(f"{name} {dist.version} RECORD sha256:{hashlib.sha256(record.encode()).hexdigest()[:16]}")
    return lines


if __name__ == "__main__":
    print("\n".join(fingerprint()))
