"""Storage: will the checkpoints be written, survive, and load again? And where does the HF cache live?

Inside a container (/.dockerenv, /run/.containerenv, cgroup hints) a runs dir that is not a mounted
volume lives in the container's writable layer and vanishes with it. The mount holding a path is the
longest mount point in /proc/self/mountinfo that prefixes it. The checkpoint round-trip goes through
runtime/checkpoint.py exactly as a resume does (torch.load with weights_only=True).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ppoforge.doctor.report import CheckResult, fail, ok, warn
from ppoforge.doctor.versions import at_least
from ppoforge.errors import UserError
from ppoforge.runtime.checkpoint import load_checkpoint, rng_state, save_checkpoint

GIB = 2**30
LAYER_FS = ("overlay", "aufs", "fuse-overlayfs", "vfs", "devicemapper")  # a container's own layer
VOLATILE_FS = ("tmpfs", "ramfs")


def container_hint() -> str | None:
    """Why we think we are in a container, or None."""
    for path in ("/.dockerenv", "/run/.containerenv"):
        if os.path.exists(path):
            return path
    kind = os.environ.get("container")  # noqa: SIM112 - systemd/podman spell it in lower case
    if kind:
        return f"container={kind}"
    try:
        cgroup = Path("/proc/1/cgroup").read_text()
    except OSError:
        cgroup = ""
    for word in ("docker", "kubepods", "containerd", "libpod", "lxc"):
        if word in cgroup:
            return f"/proc/1/cgroup mentions {word}"
    return None


@dataclass
class Mount:
    point: str
    fstype: str
    source: str


def parse_mountinfo(text: str) -> list[Mount]:
    mounts = []
    for line in text.splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or not tail:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        mounts.append(Mount(point, tail[0], tail[1] if len(tail) > 1 else ""))
    return mounts


def mount_of(path: str, mounts: list[Mount]) -> Mount | None:
    """The mount holding `path` (an absolute, resolved path); the last of stacked mounts wins."""
    best = None
    for m in mounts:
        inside = m.point == "/" or path == m.point or path.startswith(m.point.rstrip("/") + "/")
        if inside and (best is None or len(m.point) >= len(best.point)):
            best = m
    return best


def read_mounts() -> list[Mount]:
    try:
        return parse_mountinfo(Path("/proc/self/mountinfo").read_text())
    except OSError:
        return []


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _writable(path: Path) -> str | None:
    """None when we can create a file in `path` (or create `path`); else the error."""
    base = _existing(path)
    try:
        probe = tempfile.mkdtemp(dir=base, prefix=".ppoforge-doctor-")
    except OSError as e:
        return f"cannot create files in {base} ({e.strerror or e})"
    os.rmdir(probe)
    return None


@dataclass
class DirFacts:
    path: str              # absolute
    error: str | None      # why it is not writable
    free_bytes: int
    mount: Mount | None
    container: str | None  # container hint


def gather_dir(path: str | Path, container: str | None) -> DirFacts:
    full = Path(path).expanduser().resolve()
    free = shutil.disk_usage(_existing(full)).free
    return DirFacts(str(full), _writable(full), free, mount_of(str(full), read_mounts()), container)


def persistence(f: DirFacts) -> tuple[str, str]:
    """(status, why) for whether files written under f.path outlive the container (or the boot)."""
    m = f.mount
    where = f"{m.point} ({m.fstype} {m.source})" if m else "unknown mount"
    if m and m.fstype in VOLATILE_FS:
        return "fail", f"on {where}: in memory, lost when the container stops or the machine reboots"
    if not f.container:
        return "ok", f"on {where}"
    if m is None or m.point == "/":
        if m is None or m.fstype in LAYER_FS:
            return "fail", f"in the container's writable layer ({where}): it vanishes with the container"
        return "warn", f"on the container's root filesystem {where}, not a mounted volume: may vanish with it"
    return "ok", f"on mounted volume {where}"


def check_runs_dir(f: DirFacts) -> CheckResult:
    name = "runs_dir"
    state, where = persistence(f)
    evidence = (f"{f.path}: {'writable' if f.error is None else f.error}; "
                f"{f.free_bytes / GIB:.1f} GiB free; {where}")
    if f.container:
        evidence += f" (container: {f.container})"
    volume_fix = f"docker run -v /host/runs:{f.path} ... (or --runs-root a path on a mounted volume)"
    if f.error is not None:
        return fail(name, evidence, f"--runs-root a writable dir, or mkdir -p {f.path} && chown $(id -u) "
                    f"{f.path}" + ("; in a container: " + volume_fix if f.container else ""))
    space_fix = "free some space, or --runs-root on another disk"
    if f.free_bytes < GIB:
        return fail(name, evidence + "; < 1 GiB free: checkpoint writes will fail", space_fix)
    if state == "fail":
        return fail(name, evidence, volume_fix if f.container else "--runs-root a path on a disk")
    if state == "warn":
        return warn(name, evidence, volume_fix)
    if f.free_bytes < 5 * GIB:
        return warn(name, evidence + "; < 5 GiB free: LM checkpoints may not fit", space_fix)
    return ok(name, evidence)


# ---- Hugging Face cache ---------------------------------------------------------------------------
def hf_home() -> tuple[str, bool]:
    """(HF_HOME, set explicitly?) following huggingface_hub's precedence."""
    if os.environ.get("HF_HOME"):
        return os.environ["HF_HOME"], True
    xdg = os.environ.get("XDG_CACHE_HOME", "~/.cache")
    return str(Path(xdg).expanduser() / "huggingface"), False


HUB_ENDPOINT = "https://huggingface.co"  # huggingface_hub's default; HF_ENDPOINT overrides it


def offline_vars(env: dict[str, str]) -> list[str]:
    """The environment variables that switch the hub off (HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE set to 1)."""
    return [k for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE") if env.get(k, "").lower() in ("1", "true", "yes")]


def hub_reachability(env: dict[str, str], timeout: float = 2.0) -> tuple[bool, str]:
    """(reachable, what was seen): a real HEAD request to the hub endpoint (HF_ENDPOINT, else huggingface.co)
    with a short timeout; none when HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE says the hub is off. Any HTTP
    answer means the hub is reachable; no answer (refused, DNS, timeout, TLS) means offline."""
    import urllib.error  # the request only: urllib loads when the doctor asks the hub
    import urllib.request  # the request only

    offline = offline_vars(env)
    if offline:
        return False, f"{', '.join(offline)}=1, not asked"
    endpoint = env.get("HF_ENDPOINT") or HUB_ENDPOINT
    try:
        with urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout) as r:
            return True, f"{endpoint} answered HTTP {r.status}"
    except urllib.error.HTTPError as e:  # an answer, if not a 2xx one: the hub is there
        return True, f"{endpoint} answered HTTP {e.code}"
    except (OSError, ValueError) as e:  # URLError, timeouts, refused connections, a malformed endpoint
        reason = getattr(e, "reason", e)
        return False, f"{endpoint} did not answer within {timeout:g} s ({type(reason).__name__}: {reason})"


def check_hf_cache(f: DirFacts, explicit: bool, env: dict[str, str], hub: tuple[bool, str]) -> CheckResult:
    """Where the HF cache lives, whether it persists, and whether the hub answers (`hub_reachability`:
    online only after a real request answered)."""
    name = "hf_cache"
    cache = Path(env.get("HF_HUB_CACHE") or Path(f.path) / "hub")
    models = len(list(cache.glob("models--*"))) if cache.is_dir() else 0
    reachable, seen = hub
    evidence = (f"HF_HOME {f.path} ({'set' if explicit else 'default'}); hub cache {cache}: {models} model(s); "
                + (f"online ({seen})" if reachable else f"offline ({seen}): only cached models load"))
    if f.error is not None:
        return warn(name, f"{evidence}; {f.error}", "export HF_HOME=<a writable dir>")
    state, where = persistence(f)
    if state != "ok":
        return warn(name, f"{evidence}; {where}, so models are downloaded again in every new container",
                    f"docker run -v ~/.cache/huggingface:{f.path} ... (or export HF_HOME=<a mounted path>)")
    return ok(name, f"{evidence}; {where}")


# ---- checkpoint round trip ------------------------------------------------------------------------
def _adam_state(model: torch.nn.Module) -> dict:
    """The layout of `Adam.state_dict()` after one step, built by hand: constructing a torch.optim
    optimizer first imports torch._dynamo (~2 s), too slow for --quick. The smoke run saves a real one."""
    state = {i: {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
             for i, p in enumerate(model.parameters())}
    group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-5, "weight_decay": 0, "amsgrad": False,
             "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": True,
             "decoupled_weight_decay": False, "params": list(state)}
    return {"state": state, "param_groups": [group]}


def _sample_state() -> dict:
    """What a trainer saves: weights, Adam state, RNG states, a numpy Generator state, config, scaler."""
    model = torch.nn.Linear(4, 2)
    return {"agent": model.state_dict(), "optimizer": _adam_state(model), "rng": rng_state(),
            "policy_rng": np.random.default_rng(0).bit_generator.state, "precision": {},
            "update": 3, "config": {"env_id": "CartPole-v1", "target_kl": None, "lr": 2.5e-4}}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def check_checkpoint_roundtrip(workdir: Path, state: dict | None = None) -> CheckResult:
    name = "checkpoint_roundtrip"
    state = _sample_state() if state is None else state
    path = Path(workdir) / "roundtrip" / "checkpoint.pt"
    default = "weights_only=True" if at_least(torch.__version__, "2.6") else "weights_only=False"
    try:
        save_checkpoint(path, state)
        loaded = load_checkpoint(path)
    except (UserError, OSError, RuntimeError) as e:
        return fail(name, f"torch {torch.__version__} (torch.load default {default}): {e}",
                    "a checkpoint holds a type weights_only loading refuses: report it as a ppoforge bug "
                    "(with ppoforge doctor --json); ppoforge never loads with weights_only=False")
    evidence = (f"torch {torch.__version__} (torch.load default {default}): saved and reloaded a "
                f"trainer-shaped checkpoint ({path.stat().st_size / 1024:.0f} KiB) with weights_only=True")
    if not same(state, loaded):
        return fail(name, evidence + ", but the reloaded state differs", "report it as a ppoforge bug")
    return ok(name, evidence + ", identical")
