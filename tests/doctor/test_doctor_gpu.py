"""GPU visibility and per-GPU checks on simulated machines: every 'why no GPU' with its fix."""

from dataclasses import replace

from ppoforge.doctor.gpu import (
    DeviceFacts,
    GpuFacts,
    arch_supported,
    check_gpu_device,
    check_gpu_visibility,
    driver_too_old,
    read_driver_version,
)

GPU_BOX = GpuFacts(wheel_cuda="12.6", wheel_hip=None, device_nodes=["/dev/nvidia0", "/dev/nvidia1"],
                   nvidia_smi="/usr/bin/nvidia-smi", driver="550.54.15", driver_cuda="12.4", visible=None,
                   torch_count=2, torch_error=None)
NO_GPU = replace(GPU_BOX, torch_count=0, torch_error="no CUDA GPUs are available")


def test_visible_gpus_are_ok():
    r = check_gpu_visibility(GPU_BOX, "auto")
    assert r.status == "ok" and "2 GPU(s)" in r.evidence and "driver 550.54.15" in r.evidence


def test_cpu_wheel_on_a_gpu_machine_fails_with_the_cuda_index_url():
    f = replace(NO_GPU, wheel_cuda=None, torch_error=None)
    r = check_gpu_visibility(f, "auto")
    assert r.status == "fail" and "CPU-only wheel" in r.evidence
    # driver supports CUDA 12.4: the newest wheel it can run is cu124
    assert "pip install --force-reinstall torch --index-url https://download.pytorch.org/whl/cu124" in r.fix


def test_container_without_gpus_says_docker_gpus_all():
    f = replace(NO_GPU, device_nodes=[], nvidia_smi=None, driver=None, driver_cuda=None,
                torch_error="Found no NVIDIA driver on your system")
    r = check_gpu_visibility(f, "auto")
    assert r.status == "warn" and "no /dev/nvidia*" in r.evidence and "--gpus all" in r.fix
    assert check_gpu_visibility(f, "cuda").status == "fail"  # asked for a GPU: a failure
    assert check_gpu_visibility(f, "cpu").status == "ok"  # not needed: the LM verdict on cpu holds without it


def test_empty_cuda_visible_devices():
    for value in ("", "-1"):
        r = check_gpu_visibility(replace(NO_GPU, visible=value), "auto")
        assert r.status == "fail" and f"CUDA_VISIBLE_DEVICES={value!r} hides every GPU" in r.evidence
        assert "unset CUDA_VISIBLE_DEVICES" in r.fix


def test_cuda_visible_devices_out_of_range():
    r = check_gpu_visibility(replace(NO_GPU, visible="3"), "auto")
    assert r.status == "fail" and "does not exist (only 2" in r.evidence
    assert "export CUDA_VISIBLE_DEVICES=0,1" in r.fix


def test_driver_older_than_the_wheel_cuda():
    f = replace(NO_GPU, driver="470.57.02", driver_cuda="11.4")
    r = check_gpu_visibility(f, "auto")
    assert r.status == "fail" and "supports CUDA 11.4, the wheel needs CUDA 12.6" in r.evidence
    assert "upgrade the NVIDIA driver" in r.fix and "whl/cu118" in r.fix


def test_old_driver_known_only_by_its_version():
    f = replace(NO_GPU, driver="470.57.02", driver_cuda=None)
    assert "older than 525.60.13" in driver_too_old(f)
    assert driver_too_old(replace(NO_GPU, driver="535.104.05", driver_cuda=None)) is None
    assert driver_too_old(replace(NO_GPU, driver_cuda="12.2")) is None  # minor-version compatibility


def test_unexplained_init_failure_shows_torch_error():
    r = check_gpu_visibility(NO_GPU, "auto")
    assert r.status == "fail" and "no CUDA GPUs are available" in r.evidence and "nvidia-smi" in r.fix


def test_read_driver_version(tmp_path):
    path = tmp_path / "version"
    path.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.54.15  Release Build\n")
    assert read_driver_version(str(path)) == "550.54.15"
    path.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 2023\n")
    assert read_driver_version(str(path)) == "535.104.05"
    assert read_driver_version(str(tmp_path / "missing")) is None


ARCHS = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]


def test_arch_supported():
    assert arch_supported((8, 6), ARCHS) == (True, "sm_86 kernels present")
    assert arch_supported((8, 9), ARCHS)[1] == "runs sm_86 kernels"  # same major, older minor: compatible
    assert arch_supported((12, 0), ARCHS + ["compute_90"])[0]  # PTX JIT
    assert arch_supported((12, 0), ARCHS) == (False, "no kernel image for sm_120")
    assert arch_supported((3, 7), ARCHS) == (False, "no kernel image for sm_37")


def _device(**kw):
    base = DeviceFacts(0, "NVIDIA A100-SXM4-80GB", 79.3, (8, 0), ARCHS, None, False, True)
    return replace(base, **kw)


def test_gpu_device_ok_reports_bf16_and_tf32():
    r = check_gpu_device(_device(), "fp32")
    assert r.name == "gpu0" and r.status == "ok"
    assert "bf16 native" in r.evidence and "TF32 matmul off, cuDNN on" in r.evidence


def test_arch_not_in_the_arch_list_fails_before_no_kernel_image():
    r = check_gpu_device(_device(name="NVIDIA RTX PRO 6000 Blackwell", capability=(12, 0)), "fp32")
    assert r.status == "fail" and "no kernel image for sm_120" in r.evidence
    assert "sm_120" in r.fix and "whl/cu128" in r.fix


def test_kernel_launch_failure():
    r = check_gpu_device(_device(launch_error="CUDA error: an illegal memory access"), "fp32")
    assert r.status == "fail" and "FAILED: CUDA error" in r.evidence


def test_bf16_on_a_t4_is_emulated_whatever_is_bf16_supported_says():
    t4 = _device(name="Tesla T4", capability=(7, 5), memory_gib=14.6)
    assert check_gpu_device(t4, "fp32").status == "ok"
    r = check_gpu_device(t4, "bf16")
    assert r.status == "warn" and "emulated" in r.evidence and "--precision fp16" in r.fix
