# Every target bootstraps .venv itself on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install test demo tour bench bench-host lint mutation test-latest gpu-wheels

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

# host time per eager op call (pytest-benchmark): bench/results/<device>/host_time.json
bench-host: $(STAMP)
	$(PY) -m bench.host_time

# liger-kernel, pure Python, for the GPU run's Python 3.12 (bench/gpu_check.sh installs the
# wheels of .whl/ first; carry .whl with the run)
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
		liger-kernel==0.8.5

# plants each bug of tests/mutations.py in a copy of the tree and runs its tests (.ci/run too)
mutation: $(STAMP)
	$(PY) -m tests.mutations

lint: $(STAMP)
	$(VENV)/bin/ruff check wedlm_kernels reference model_min tests examples bench

# The newest releases pip resolves for the package today (no constraints file: the newest
# Triton and numpy), installed (not editable) in a venv of their own: the interpreter kernel
# tests and the op tests, with few hypothesis examples, then `python -m model_min demo` from
# another directory (.ci/run too). torch stays pinned: an unpinned torch resolves to a
# multi-GB CUDA build.
LATEST := .venv-latest
LATEST_TESTS := tests/test_philox.py $(wildcard tests/test_*_kernel.py) \
	tests/test_select_tokens.py tests/test_paged_attention.py tests/test_reorder_window.py \
	tests/test_rope_kv_append.py tests/test_commit_window.py tests/test_silu_mul.py
test-latest:
	$(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install -q -c constraints.txt torch
	$(LATEST)/bin/python -m pip install -q ".[test]"
	$(LATEST)/bin/python -m pip list 2>/dev/null | grep -E -i "^(torch|triton|numpy) "
	HYPOTHESIS_PROFILE=smoke $(LATEST)/bin/python -m pytest -q $(LATEST_TESTS)
	# the installed package (not an editable one) from another directory: model_min's demo
	cd $$(mktemp -d) && $(CURDIR)/$(LATEST)/bin/python -m model_min demo --max-new-tokens 12 \
		--no-progress
