#!/usr/bin/env bash
# The GPU checks in one prepared run: the cuda-marked tests, then the CUDA benchmarks.
#
#   bash bench/gpu_check.sh            # on a machine with an NVIDIA GPU, from any directory
#   bash bench/gpu_check.sh --dry-run  # print the commands it would run, run nothing
#
# Made for a machine without network access whose Python already has torch, triton and
# pytest (no install step: the checkout is put on PYTHONPATH). Every step has its own
# `timeout`, and the steps are capped by one deadline, so the whole script ends within
# TOTAL_BUDGET_S seconds (under 8 minutes). Everything it prints also goes to
# $OUT/gpu_check.log. Results: $OUT/gpu_results.tar.gz holds bench/results/<device>/
# (extract it in the repository root), and the result files themselves are copied to $OUT
# as long as $OUT keeps at most 8 files. $OUT defaults to ${TMPDIR:-/tmp}/gpu_check_out.
#
# Test files: those under tests/ that mention `mark.cuda`, each in its own pytest process
# (a CUDA error in one file cannot poison the next), with `-m cuda -x`. A file whose
# imports need a module this Python lacks (hypothesis, transformers, ...) is skipped and
# named in the log; if tests/conftest.py itself cannot be imported, no test runs.
#
# Selecting what runs (the whole list does not fit in one 8-minute run): SKIP_TESTS=1 runs
# no test; BENCHES="bench.sweep ARGS;bench.paged_attention" replaces the benchmark list
# (entries separated by ';'). The default list, by priority: the decode step, the window
# sweeps of a Qwen3-8B-shaped random model (peaked, then flat logits; they check
# model_min.auto_window), then the microbenchmarks.
#
# Wheels in $REPO/.whl/ (pure-Python packages the machine lacks, such as liger-kernel for
# model_min's fused norms; `pip download --no-deps` them there) are installed into the
# staging folder first and put on PYTHONPATH.

set -u -o pipefail

# ---- what runs: edit here -------------------------------------------------------------
# Benchmarks in order of priority (a module and its arguments; each also gets --out-dir DIR).
# The decode-step benchmark comes first; those after it run while time is left.
SWEEP_8B="--batch-sizes 1 4 16 64 --windows 4 8 16 32 --thresholds 0.4 --modes streaming ar --max-new-tokens 32 --repeats 1 --cuda-graph --ignore-eos"
CUDA_BENCHES=("bench.decode_step --quick"
              "bench.sweep --model random:qwen3-8b-peaked $SWEEP_8B"
              "bench.sweep --model random:qwen3-8b-flat $SWEEP_8B"
              bench.paged_attention bench.select_tokens bench.ops_window)
if [[ -n ${BENCHES-} ]]; then
    IFS=';' read -r -a CUDA_BENCHES <<<"$BENCHES"
fi
TOTAL_BUDGET_S=440               # the whole script (8 minutes = 480 s)
TEST_BUDGET_S=200                # all cuda test files together, import probe included
TEST_FILE_LIMIT_S=150            # one test file
BENCH_LIMIT_S=150                # one benchmark
BENCH_RESERVE_S=200              # kept free for the benchmarks while tests run
PACK_RESERVE_S=20                # kept free for packing the results
PER_TEST_TIMEOUT_S=120           # per test, when the pytest-timeout plugin is installed
PYTHON=${PYTHON:-python3}
# -----------------------------------------------------------------------------------------

DRY_RUN=0
for arg in "$@"; do
    case $arg in
        --dry-run) DRY_RUN=1 ;;
        -h | --help) sed -n '2,29p' "$0"; exit 0 ;;
        *) echo "unknown argument: $arg (use --dry-run or --help)" >&2; exit 2 ;;
    esac
done

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 2
OUT=${OUT:-${TMPDIR:-/tmp}/gpu_check_out}
LOG=$OUT/gpu_check.log
STAGE=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
DEADLINE=$TOTAL_BUDGET_S
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

if ((!DRY_RUN)); then
    mkdir -p "$OUT"
    exec > >(tee -a "$LOG") 2>&1
    TEE_PID=$!
fi

SUMMARY=()
FAILED=0

# run_step NAME LIMIT_S [--to FILE] COMMAND...: run COMMAND under `timeout`, capped by the
# deadline less RESERVE_S; with --to, its output goes to FILE and is shown afterwards.
# Records the outcome in SUMMARY and returns the command's status.
RESERVE_S=$PACK_RESERVE_S
run_step() {
    local name=$1 limit=$2 to=""
    shift 2
    if [[ ${1-} == --to ]]; then
        to=$2
        shift 2
    fi
    local left=$((DEADLINE - RESERVE_S - SECONDS))
    ((limit > left)) && limit=$left
    if ((limit < 5)); then
        echo "=== $name: skipped, no time left"
        SUMMARY+=("$name: skipped (no time left)")
        FAILED=1
        return 124
    fi
    echo "=== $name (limit ${limit}s, at ${SECONDS}s)"
    echo "+ timeout -k 10 $limit $*${to:+ > $to}"
    if ((DRY_RUN)); then
        SUMMARY+=("$name: dry run")
        return 0
    fi
    local start=$SECONDS status
    if [[ -n $to ]]; then
        timeout -k 10 "$limit" "$@" >"$to" 2>&1
        status=$?
        cat "$to"
    else
        timeout -k 10 "$limit" "$@"
        status=$?
    fi
    local took=$((SECONDS - start)) verdict
    case $status in
        0) verdict="ok" ;;
        124 | 137) verdict="TIMED OUT after ${took}s" ;;
        *) verdict="FAILED (exit $status)" ;;
    esac
    SUMMARY+=("$name: $verdict, ${took}s")
    return $status
}

echo "=== gpu_check $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(hostname)"
echo "repository: $REPO (commit $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown))"
echo "results: $OUT; staging: $STAGE; budget ${TOTAL_BUDGET_S}s"

run_step "nvidia-smi" 30 nvidia-smi || FAILED=1

# ---- optional pure-Python wheels carried in .whl/ (e.g. liger-kernel for model_min) -----
if compgen -G "$REPO/.whl/*.whl" >/dev/null; then
    run_step "wheels from .whl/" 60 "$PYTHON" -m pip install -q --no-index --no-deps \
        --no-compile --no-cache-dir --upgrade --target "$STAGE/site" "$REPO"/.whl/*.whl &&
        export PYTHONPATH=$STAGE/site:$PYTHONPATH
fi

# ---- environment: versions, the device's results folder, optional modules ---------------
cat >"$STAGE/env_probe.py" <<'PY'
import importlib
import platform

import torch

from bench.common import device_slug

print("SLUG=" + device_slug())
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "gpu available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0))
for name in ("triton", "numpy", "pytest", "hypothesis", "transformers", "safetensors",
             "matplotlib", "pytest_timeout"):
    try:
        version = getattr(importlib.import_module(name), "__version__", "?")
    except Exception as error:  # noqa: BLE001
        version = f"MISSING ({type(error).__name__})"
        if name == "pytest_timeout":
            print("PYTEST_TIMEOUT=0")
    else:
        if name == "pytest_timeout":
            print("PYTEST_TIMEOUT=1")
    print(f"  {name}: {version}")
PY
SLUG="<device-slug>"
TIMEOUT_ARGS=()
run_step "environment" 90 --to "$STAGE/env.txt" "$PYTHON" "$STAGE/env_probe.py" || FAILED=1
if ((!DRY_RUN)); then
    SLUG=$(sed -n 's/^SLUG=//p' "$STAGE/env.txt" | tail -n 1)
    [[ -n $SLUG ]] || SLUG=unknown-device
    if grep -q '^PYTEST_TIMEOUT=1' "$STAGE/env.txt"; then
        TIMEOUT_ARGS=(--timeout "$PER_TEST_TIMEOUT_S")
    fi
fi
RESULTS=$STAGE/bench/results/$SLUG

# ---- cuda-marked tests ------------------------------------------------------------------
mapfile -t CUDA_FILES < <(grep -l -E 'mark\.cuda' tests/test_*.py 2>/dev/null | sort)
if [[ ${SKIP_TESTS-0} == 1 ]]; then
    echo "=== SKIP_TESTS=1: no test runs"
    CUDA_FILES=()
fi
echo "=== test files with cuda-marked tests: ${CUDA_FILES[*]:-none}"

cat >"$STAGE/import_probe.py" <<'PY'
"""Prints RUN <file> or SKIP <file> <module> per test file, CONFTEST <module> if
tests/conftest.py needs a missing module. Other import errors are left to pytest."""
import importlib.util
import pathlib
import sys

LOCAL = {"wedlm_kernels", "reference", "model_min", "bench", "tests"}


def missing_module(path):
    spec = importlib.util.spec_from_file_location("probe_" + pathlib.Path(path).stem, path)
    try:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    except ModuleNotFoundError as error:
        if error.name and error.name.split(".")[0] not in LOCAL:
            return error.name
    except Exception:  # noqa: BLE001 - pytest reports it
        pass
    return None


conftest = missing_module("tests/conftest.py")
if conftest:
    print("CONFTEST", conftest)
    sys.exit(0)
for path in sys.argv[1:]:
    name = missing_module(path)
    print(f"SKIP {path} {name}" if name else f"RUN {path}")
PY

TEST_DEADLINE=$((SECONDS + TEST_BUDGET_S))
((TEST_DEADLINE > DEADLINE - BENCH_RESERVE_S)) && TEST_DEADLINE=$((DEADLINE - BENCH_RESERVE_S))
RESERVE_S=$((DEADLINE - TEST_DEADLINE))
RUN_FILES=()
if ((${#CUDA_FILES[@]})); then
    run_step "import probe" 90 --to "$STAGE/probe.txt" \
        "$PYTHON" "$STAGE/import_probe.py" "${CUDA_FILES[@]}"
    if ((DRY_RUN)); then
        RUN_FILES=("${CUDA_FILES[@]}")
    elif grep -q '^RUN \|^SKIP \|^CONFTEST ' "$STAGE/probe.txt"; then
        while read -r kind path module; do
            case $kind in
                RUN) RUN_FILES+=("$path") ;;
                SKIP)
                    echo "skipping $path: it imports '$module', which this Python lacks"
                    SUMMARY+=("pytest $path: SKIPPED (missing module $module)")
                    FAILED=1
                    ;;
                CONFTEST)
                    echo "tests/conftest.py imports '$path', which this Python lacks:" \
                        "no test can run; the cuda test files were: ${CUDA_FILES[*]}"
                    SUMMARY+=("pytest: NOT RUN (tests/conftest.py needs missing module $path)")
                    FAILED=1
                    ;;
            esac
        done <"$STAGE/probe.txt"
        grep -q '^CONFTEST ' "$STAGE/probe.txt" && RUN_FILES=()
    else
        echo "import probe gave no answer: running every cuda test file"
        RUN_FILES=("${CUDA_FILES[@]}")
    fi
fi
for file in ${RUN_FILES[@]+"${RUN_FILES[@]}"}; do
    run_step "pytest $file" "$TEST_FILE_LIMIT_S" "$PYTHON" -m pytest -m cuda -q -x \
        -p no:cacheprovider ${TIMEOUT_ARGS[@]+"${TIMEOUT_ARGS[@]}"} "$file"
    status=$?
    if ((status == 5)); then  # nothing collected: the file has no test selected by -m cuda
        SUMMARY[${#SUMMARY[@]} - 1]="pytest $file: no cuda-marked test collected"
    elif ((status != 0)); then
        FAILED=1
    fi
done

# ---- benchmarks -------------------------------------------------------------------------
RESERVE_S=$PACK_RESERVE_S
for bench in "${CUDA_BENCHES[@]}"; do
    read -r -a words <<<"$bench"  # module, then its arguments
    run_step "$bench" "$BENCH_LIMIT_S" "$PYTHON" -m "${words[@]}" --out-dir "$RESULTS" || FAILED=1
done

# ---- results into $OUT (at most 8 files come back) --------------------------------------
RESERVE_S=0
echo "=== packing results"
if ((DRY_RUN)); then
    echo "+ tar -czf $OUT/gpu_results.tar.gz -C $STAGE bench"
    echo "+ cp $RESULTS/* $OUT/ (while \$OUT holds at most 8 files)"
elif [[ -d $RESULTS ]]; then
    timeout 30 tar -czf "$OUT/gpu_results.tar.gz" -C "$STAGE" bench || FAILED=1
    for file in "$RESULTS"/*.md "$RESULTS"/*.json "$RESULTS"/*.png; do
        [[ -f $file ]] || continue
        (($(find "$OUT" -maxdepth 1 -type f | wc -l) < 8)) || break
        cp "$file" "$OUT/"
    done
    echo "in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
    echo "to keep them: tar -xzf gpu_results.tar.gz -C <repository root> (bench/results/$SLUG/)"
else
    echo "no benchmark results were written"
fi

echo "=== summary (${SECONDS}s of ${TOTAL_BUDGET_S}s)"
for line in ${SUMMARY[@]+"${SUMMARY[@]}"}; do
    echo "  $line"
done
if ((DRY_RUN)); then
    rm -rf "$STAGE"
    echo "gpu_check: dry run, nothing was run"
elif ((FAILED)); then
    echo "gpu_check: SOME CHECKS FAILED"
else
    echo "gpu_check: all checks passed"
fi
if ((!DRY_RUN)); then  # let tee finish the log before $OUT is collected
    exec >&- 2>&-
    wait "$TEE_PID" 2>/dev/null
fi
exit $FAILED
