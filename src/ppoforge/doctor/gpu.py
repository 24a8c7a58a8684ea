"""GPU visibility (and *why not* when there is none), then one check per visible GPU.

Facts come from the machine without torch's help where possible: /dev/nvidia* nodes, `nvidia-smi` on
PATH, the driver version in /proc/driver/nvidia/version, the driver's CUDA version from libcuda's
`cuDriverGetVersion`. torch alone cannot say whether a missing GPU is a CPU wheel, a container started
without `--gpus`, a hiding CUDA_VISIBLE_DEVICES or an old driver; these facts can, and each has its fix.
bf16 is judged by compute capability >= 8.0, not `torch.cuda.is_bf16_supported()` (True on a T4, where
it is emulated).
"""

from __future__ import annotations

import ctypes
import glob
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from ppoforge.doctor.report import CheckResult, fail, ok, warn
from ppoforge.doctor.versions import parse_version, torch_index_url

# Oldest driver for each CUDA major (CUDA minor-version compatibility), from NVIDIA's release notes.
MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}


@dataclass
class GpuFacts:
    wheel_cuda: str | None     # torch.version.cuda
    wheel_hip: str | None      # torch.version.hip
    device_nodes: list[str]    # /dev/nvidia0, /dev/nvidia1, ... (/dev/kfd on ROCm)
    nvidia_smi: str | None     # path of nvidia-smi, when on PATH
    driver: str | None         # kernel driver version, e.g. 550.54.15
    driver_cuda: str | None    # newest CUDA the driver supports, e.g. 12.4
    visible: str | None        # CUDA_VISIBLE_DEVICES; None when unset
    torch_count: int           # GPUs torch sees
    torch_error: str | None    # torch.cuda.init()'s error, when it failed

    @property
    def hardware(self) -> bool:
        return bool(self.device_nodes or self.nvidia_smi or self.driver)


def read_driver_version(path: str = "/proc/driver/nvidia/version") -> str | None:
    try:
        match = re.search(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)", Path(path).read_text())
    except OSError:
        return None
    return match.group(1) if match else None


def read_driver_cuda() -> str | None:
    """The driver's CUDA version via libcuda, without initializing a context."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int()
    if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None
    return f"{version.value // 1000}.{version.value % 1000 // 10}"


def _torch_cuda() -> tuple[int, str | None]:
    if not (torch.version.cuda or torch.version.hip):
        return 0, None
    try:
        torch.cuda.init()
    except Exception as e:  # noqa: BLE001 - the message is the evidence
        return 0, str(e).strip().splitlines()[0][:200]
    return torch.cuda.device_count(), None


def gather_gpu() -> GpuFacts:
    nodes = sorted(glob.glob("/dev/nvidia[0-9]*"), key=lambda p: int(re.sub(r"\D", "", p)))
    if torch.version.hip and os.path.exists("/dev/kfd"):
        nodes.append("/dev/kfd")
    count, error = _torch_cuda()
    return GpuFacts(torch.version.cuda, torch.version.hip, nodes, shutil.which("nvidia-smi"),
                    read_driver_version(), read_driver_cuda(), os.environ.get("CUDA_VISIBLE_DEVICES"),
                    count, error)


def _visible_reasons(f: GpuFacts) -> list[tuple[str, str]]:
    if f.visible is None:
        return []
    if f.visible.strip() in ("", "-1"):
        return [(f"CUDA_VISIBLE_DEVICES={f.visible!r} hides every GPU",
                 "unset CUDA_VISIBLE_DEVICES (or export CUDA_VISIBLE_DEVICES=0)")]
    gpus = len([n for n in f.device_nodes if n.startswith("/dev/nvidia")])
    indices = [int(i) for i in f.visible.split(",") if i.strip().isdigit()]
    if gpus and any(i >= gpus for i in indices):
        return [(f"CUDA_VISIBLE_DEVICES={f.visible} names a GPU that does not exist "
                 f"(only {gpus}: indices 0..{gpus - 1})",
                 f"export CUDA_VISIBLE_DEVICES={','.join(str(i) for i in range(gpus))}")]
    return []


def driver_too_old(f: GpuFacts) -> str | None:
    """Why the driver cannot run this wheel's CUDA, or None when it can (or nothing is known)."""
    if not f.wheel_cuda:
        return None
    need = parse_version(f.wheel_cuda)
    if f.driver_cuda and parse_version(f.driver_cuda)[:1] < need[:1]:
        return f"the driver supports CUDA {f.driver_cuda}, the wheel needs CUDA {f.wheel_cuda}"
    minimum = MIN_DRIVER.get(need[0]) if need else None
    if f.driver and minimum and parse_version(f.driver) < parse_version(minimum):
        return f"driver {f.driver} is older than {minimum}, the minimum for CUDA {need[0]}.x wheels"
    return None


def why_no_gpu(f: GpuFacts) -> list[tuple[str, str]]:
    """Every reason torch sees no GPU, each with its fix, most basic first."""
    reasons = []
    if not f.hardware:
        reasons.append(("no /dev/nvidia* device and no nvidia-smi (a container started without GPUs, or "
                        "a host without an NVIDIA driver)",
                        "docker run --gpus all ... (needs nvidia-container-toolkit on the host)"))
    if not (f.wheel_cuda or f.wheel_hip):
        reasons.append(("torch is a CPU-only wheel",
                        f"pip install --force-reinstall torch --index-url {torch_index_url(f.driver_cuda)}"))
    reasons += _visible_reasons(f)
    old = driver_too_old(f)
    if old:
        reasons.append((old, f"upgrade the NVIDIA driver, or install a wheel it can run: pip install "
                        f"--force-reinstall torch --index-url {torch_index_url(f.driver_cuda)}"))
    if not reasons:
        reasons.append((f"torch.cuda failed to initialize ({f.torch_error or 'no error message'})",
                        "run nvidia-smi; if it errors too, reload the driver or reboot the host "
                        "(dmesg | grep -i nvrm shows why)"))
    return reasons


def check_gpu_visibility(f: GpuFacts, device: str) -> CheckResult:
    name = "gpu_visibility"
    flavour = f"ROCm {f.wheel_hip}" if f.wheel_hip else f"CUDA {f.wheel_cuda or '-'}"
    context = (f"driver {f.driver or '?'} (CUDA {f.driver_cuda or '?'}), {flavour} wheel, "
               if f.hardware else "") + f"CUDA_VISIBLE_DEVICES={'unset' if f.visible is None else f.visible}"
    if f.torch_count:
        return ok(name, f"{f.torch_count} GPU(s) visible to torch; {context}")
    reasons = why_no_gpu(f)
    evidence = f"no GPU visible to torch: {'; '.join(r for r, _ in reasons)}; {context}"
    fix = "; ".join(fx for _, fx in reasons)
    if device.startswith("cuda") or f.hardware:
        return fail(name, evidence, fix)
    if device == "cpu":  # not needed: the LM verdict on the CPU must not wait on a GPU it was told to skip
        return ok(name, evidence + " (not needed: --device cpu)")
    return warn(name, evidence + "; ppoforge runs on CPU", f"nothing to fix for CPU work; for a GPU: {fix}")


# ---- per GPU --------------------------------------------------------------------------------------
@dataclass
class DeviceFacts:
    index: int
    name: str
    memory_gib: float
    capability: tuple[int, int]
    arch_list: list[str]       # torch.cuda.get_arch_list(): the kernels the wheel ships
    launch_error: str | None   # a real kernel launch; None when it ran and gave the right answer
    tf32_matmul: bool
    tf32_cudnn: bool


def _launch(index: int) -> str | None:
    try:
        x = torch.ones(1024, device=f"cuda:{index}")
        value = (x * 2).sum().item()  # .item() synchronizes, so an async launch error surfaces here
    except Exception as e:  # noqa: BLE001 - the message is the evidence
        return str(e).strip().splitlines()[0][:200]
    return None if value == 2048 else f"wrong result {value} (expected 2048)"


def gather_device(index: int) -> DeviceFacts:
    props = torch.cuda.get_device_properties(index)
    return DeviceFacts(index, props.name, props.total_memory / 2**30, (props.major, props.minor),
                       torch.cuda.get_arch_list(), _launch(index), torch.backends.cuda.matmul.allow_tf32,
                       torch.backends.cudnn.allow_tf32)


def _sm(arch: str) -> int:
    return int(re.sub(r"\D", "", arch.split("_", 1)[1]))


def arch_supported(capability: tuple[int, int], arch_list: list[str]) -> tuple[bool, str]:
    """Can this wheel run kernels on this GPU: exact SASS, same-major older SASS, or PTX to JIT?"""
    sm = capability[0] * 10 + capability[1]
    sass = sorted(_sm(a) for a in arch_list if a.startswith("sm_"))
    ptx = sorted(_sm(a) for a in arch_list if a.startswith("compute_"))
    if not sass and not ptx:
        return True, "arch list not in sm_XX form (ROCm?), not checked"
    if sm in sass:
        return True, f"sm_{sm} kernels present"
    if any(s // 10 == capability[0] and s < sm for s in sass):
        return True, f"runs sm_{max(s for s in sass if s // 10 == capability[0] and s < sm)} kernels"
    if any(p <= sm for p in ptx):
        return True, f"JIT-compiles compute_{max(p for p in ptx if p <= sm)} PTX (slow first launch)"
    return False, f"no kernel image for sm_{sm}"


def check_gpu_device(f: DeviceFacts, precision: str) -> CheckResult:
    name = f"gpu{f.index}"
    major, minor = f.capability
    fits, how = arch_supported(f.capability, f.arch_list)
    bf16 = "native" if major >= 8 else "emulated (compute capability < 8.0)"
    evidence = (f"{f.name}, {f.memory_gib:.1f} GiB, compute capability {major}.{minor}; wheel arch list "
                f"{' '.join(f.arch_list)}: {how}; kernel launch "
                f"{'ok' if f.launch_error is None else 'FAILED: ' + f.launch_error}; bf16 {bf16}; "
                f"TF32 matmul {'on' if f.tf32_matmul else 'off'}, cuDNN {'on' if f.tf32_cudnn else 'off'}")
    if not fits:
        return fail(name, evidence, f"install a torch wheel built for sm_{major}{minor} (sm_100/sm_120 need "
                    "cu128 or newer): pip install --force-reinstall torch --index-url "
                    "https://download.pytorch.org/whl/cu128")
    if f.launch_error is not None:
        return fail(name, evidence, "run nvidia-smi (Xid errors: dmesg | grep -i xid); try another GPU with "
                    "CUDA_VISIBLE_DEVICES; reboot the host if the GPU fell off the bus")
    if precision == "bf16" and major < 8:
        return warn(name, evidence, "--precision fp16 on this GPU (bf16 is emulated and slow here)")
    return ok(name, evidence)
