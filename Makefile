# Every target bootstraps .venv itself on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install test demo tour bench lint mutation

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: an unpinned torch resolves to a multi-GB CUDA build
	$(PY) -m pip install -q -c constraints.txt torch
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) -m model_min demo

tour: $(STAMP)
	$(PY) examples/tour.py

bench: $(STAMP)
	$(PY) -m bench.decoder_cpu
	$(PY) -m bench.ops_window

# plants each bug of tests/mutations.py in a copy of the tree and runs its tests (.ci/run too)
mutation: $(STAMP)
	$(PY) -m tests.mutations

lint: $(STAMP)
	$(VENV)/bin/ruff check wedlm_kernels reference model_min tests examples bench
