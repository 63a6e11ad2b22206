# Two entry points for a fresh machine: `make study` (the main job; core install only) and `make test`
# (installs the dev extra too).
VENV ?= .venv
PY := $(VENV)/bin/python
# Real WikiText-2 text used by tests, benchmarks and presets (see ../shared/data/wikitext/README.md).
export QKGEOM_WIKITEXT_DIR ?= $(abspath ../shared/data/wikitext)

.PHONY: setup floors-torch test test-floors lint study bench

# torch $(2)'s CPU build into the venv of python $(1): from a configured index or local wheel if one has
# it, else from PyTorch's CPU index, else PyPI's plain build (on Linux a CUDA build of several GB, which
# runs on a CPU as well; macOS has only the plain build)
define install_torch
	$(1) -m pip install -q 'torch==$(2)+cpu' 2>/dev/null \
	  || $(1) -m pip install -q 'torch==$(2)+cpu' --index-url https://download.pytorch.org/whl/cpu \
	  || $(1) -m pip install -q torch==$(2)
endef
TORCH := 2.13.0

# The main job's install: the package and its core dependencies (torch, numpy, pandas, matplotlib, ...).
$(VENV)/.core: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(call install_torch,$(PY),$(TORCH))
	$(PY) -m pip install -q -e .
	touch $@

# Tests, lint and the integrations they exercise (ray, lightning, mlflow, wandb, ...): the dev extra.
$(VENV)/.installed: $(VENV)/.core
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

setup: $(VENV)/.installed

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# the suite in one process per core, at most 4 (its tests use ~1.1 cores each on average: on 2 cores
# 14 min against 19 one after another); worksteal evens out the long end-to-end files
test: lint
	$(PY) -m pytest -q -n auto --maxprocesses 4 --dist worksteal

# The same tests under the lowest versions pyproject.toml allows (.ci/floors.txt, torch included), in a
# venv of their own: the parts that read what those libraries compute (statistics and the committed
# records, pretrained architectures, families, stored tables, the Trainer and Lightning callbacks and the
# trackers, the Trainer example, portable kernels, torch's settings, our GPT and its interventions).
# QKGEOM_FLOORS makes tests/e2e/test_install.py check that the venv holds exactly the pinned versions.
FLOORS_VENV ?= .venv-floors
FLOOR_TESTS ?= tests/e2e/test_install.py tests/e2e/test_examples.py tests/analysis tests/probing tests/families \
  tests/integrations tests/ground/test_portable.py tests/ground/test_device.py tests/training/test_model.py \
  tests/training/test_interventions.py
TORCH_FLOOR := $(shell sed -n 's/^torch==//p' .ci/floors.txt)
# torch first, on its own (CI installs it beside `make setup`: it touches nothing of the checkout's)
$(FLOORS_VENV)/.torch: .ci/floors.txt
	python3 -m venv $(FLOORS_VENV)
	$(FLOORS_VENV)/bin/python -m pip install -q --upgrade pip
	$(call install_torch,$(FLOORS_VENV)/bin/python,$(TORCH_FLOOR))
	touch $@

$(FLOORS_VENV)/.installed: pyproject.toml $(FLOORS_VENV)/.torch
	$(FLOORS_VENV)/bin/python -m pip install -q -c .ci/floors.txt -e '.[dev]'
	touch $@

floors-torch: $(FLOORS_VENV)/.torch

test-floors: $(FLOORS_VENV)/.installed
	QKGEOM_FLOORS=1 $(FLOORS_VENV)/bin/python -m pytest -q -n auto --maxprocesses 4 --dist worksteal $(FLOOR_TESTS)

study: $(VENV)/.core
	$(VENV)/bin/qkgeom study smoke

bench: setup
	$(PY) bench/train_throughput.py
