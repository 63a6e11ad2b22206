# Two entry points for a fresh machine: `make study` (the main job; core install only) and `make test`
# (installs the dev extra too).
VENV ?= .venv
PY := $(VENV)/bin/python
# Real WikiText-2 text used by tests, benchmarks and presets (see ../shared/data/wikitext/README.md).
export QKGEOM_WIKITEXT_DIR ?= $(abspath ../shared/data/wikitext)

.PHONY: setup test lint study bench

# The main job's install: the package and its core dependencies (torch, numpy, pandas, matplotlib, ...).
$(VENV)/.core: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch's CPU build: from a configured index or local wheel if one has it, else from PyTorch's CPU
	# index (PyPI's plain 2.13.0 is a CUDA build of several GB); macOS has only the plain build
	$(PY) -m pip install -q 'torch==2.13.0+cpu' 2>/dev/null \
	  || $(PY) -m pip install -q 'torch==2.13.0+cpu' --index-url https://download.pytorch.org/whl/cpu \
	  || $(PY) -m pip install -q torch==2.13.0
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

study: $(VENV)/.core
	$(VENV)/bin/qkgeom study smoke

bench: setup
	$(PY) bench/train_throughput.py
