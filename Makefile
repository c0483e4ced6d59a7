# Two commands: `make demo` (main job) and `make test`. Both create .venv on first use.
# torch is installed first from TORCH_SPEC (unless .venv already imports one), so pip keeps
# that build when it installs the package. The default pins the version the suite runs on;
# which build it fetches (CPU or CUDA) depends on the machine and the pip index: see
# docs/install.md.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
DEMO_SECONDS ?= 60

.PHONY: install demo test test-fast lint bench gpu-check-cpu gpu-deps clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m mode.demo --seconds $(DEMO_SECONDS)

# Tests run on every core (pytest-xdist); the fast tier leaves out the tests marked slow
# (multi-process, subprocess, torch.compile, Triton interpreter).
test: install
	$(PY) -m pytest -q -n auto --dist worksteal --durations=15

test-fast: install
	$(PY) -m pytest -q -n auto --dist worksteal -m "not slow"

lint: install
	$(VENV)/bin/ruff check mode tests benchmarks

bench: install
	$(PY) -m benchmarks.bench_blocks

# benchmarks/gpu_check.sh's steps on this CPU at small sizes (catches typos before a GPU run).
gpu-check-cpu: install
	OUT=$(CURDIR)/benchmarks/results/gpu-cpu-try bash benchmarks/gpu_check.sh --cpu-try

# Pure-Python packages a bare GPU machine may lack, into .gpu_deps/ to travel with the tree
# (gpu_check.sh puts it on PYTHONPATH). Wheels for this machine's Python version.
gpu-deps: install
	$(PY) -m pip install -q --no-deps --target .gpu_deps omegaconf "antlr4-python3-runtime==4.9.*" pyyaml \
		pytest pluggy iniconfig packaging hypothesis sortedcontainers attrs

clean:
	rm -rf $(VENV) runs .pytest_cache
