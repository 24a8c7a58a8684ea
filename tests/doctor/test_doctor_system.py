"""Python / torch build and CPU checks."""

from dataclasses import replace

import torch

from ppoforge.doctor.system import (
    CpuFacts,
    TorchFacts,
    cgroup_cpu_quota,
    check_cpu,
    check_python_torch,
    gather_torch,
    malloc_in_use,
    matmul_gflops,
    read_cpuinfo,
)

BUILD = TorchFacts("3.11.7", "2.13.0+cu128", "12.8", None, 91002, True)


def test_this_build_is_ok():
    r = check_python_torch(gather_torch())
    assert r.status == "ok" and f"torch {torch.__version__}" in r.evidence and "C++11 ABI" in r.evidence


def test_cuda_build_evidence():
    r = check_python_torch(BUILD)
    assert r.status == "ok" and "CUDA 12.8 wheel" in r.evidence and "cuDNN 91002" in r.evidence


def test_torch_below_2_6_warns_about_bin_loads():
    r = check_python_torch(replace(BUILD, torch="2.5.1+cu124"))
    assert r.status == "warn" and "refuses to load .bin" in r.evidence and "torch>=2.6" in r.fix


def test_old_python_fails():
    assert check_python_torch(replace(BUILD, python="3.9.18")).status == "fail"


def test_read_cpuinfo(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
                    "flags\t\t: fpu sse avx512f avx512_bf16 amx_bf16 amx_tile\n\nprocessor\t: 1\n")
    model, flags = read_cpuinfo(str(path))
    assert model == "Intel(R) Xeon(R) Platinum 8480+" and {"amx_bf16", "avx512_bf16"} <= flags
    assert read_cpuinfo(str(tmp_path / "missing"))[1] == set()


CPU = CpuFacts(8, 8, "Intel Xeon", {"avx512f", "amx_bf16"}, 100.0, 400.0)


def test_cpu_with_amx_is_ok_and_shows_the_measured_rates():
    r = check_cpu(CPU, "bf16", "cpu")
    assert r.status == "ok" and "amx_bf16" in r.evidence
    assert "fp32 100 GFLOP/s, bf16 400 GFLOP/s (4.0x)" in r.evidence


def test_bf16_on_a_cpu_without_the_fast_path_warns():
    slow = replace(CPU, flags={"avx2"}, bf16_gflops=20.0)
    r = check_cpu(slow, "bf16", "cpu")
    assert r.status == "warn" and "emulated" in r.evidence and r.fix == "--precision fp32 on this CPU"
    assert check_cpu(slow, "fp32", "cpu").status == "ok"  # not asked for bf16: nothing to warn about
    assert check_cpu(slow, "bf16", "cuda").status == "ok"  # bf16 runs on the GPU


def test_single_core_warns():
    assert check_cpu(replace(CPU, cores=1), "fp32", "cpu").status == "warn"


def test_the_cpu_check_names_the_malloc_and_how_to_preload_jemalloc(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert malloc_in_use(str(maps)) == "glibc" and malloc_in_use(str(tmp_path / "none")) == "glibc"
    maps.write_text(maps.read_text() + "7f02-7f03 r-xp 0 08:01 2 /usr/lib/x86_64-linux-gnu/libjemalloc.so.2\n")
    assert malloc_in_use(str(maps)) == "jemalloc"
    assert "malloc: glibc (where memory binds, preload jemalloc: LD_PRELOAD=libjemalloc.so.2)" in check_cpu(
        replace(CPU, jemalloc="libjemalloc.so.2"), "fp32", "cpu").evidence
    assert "install libjemalloc2" in check_cpu(CPU, "fp32", "cpu").evidence
    r = check_cpu(replace(CPU, allocator="jemalloc"), "fp32", "cpu")
    assert r.status == "ok" and r.evidence.endswith("; malloc: jemalloc")


def test_matmul_gflops_measures_something():
    assert matmul_gflops(torch.float32, n=64, seconds=0.01) > 0


def test_cgroup_quota_limits_the_usable_cpus(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_quota(str(tmp_path)) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(str(tmp_path)) is None
    r = check_cpu(replace(CPU, quota=1.5), "fp32", "cpu")
    assert r.status == "warn" and "1.5 usable of 8 logical CPUs (cgroup quota 1.5)" in r.evidence
