#!/usr/bin/env bash
# The GPU run in one command (bench/gpu_check.py says what it runs and keeps):
#
#   bash bench/gpu_check.sh             # on a machine with an NVIDIA GPU, from any directory
#   bash bench/gpu_check.sh --dry-run   # the plan, each step's limit; runs nothing
#   GPU_CHECK_BUDGET_S=300 OUT=/tmp/out bash bench/gpu_check.sh
#   PYTHON=.venv/bin/python bash bench/gpu_check.sh   # another interpreter (default python3)
exec "${PYTHON:-python3}" "$(dirname "${BASH_SOURCE[0]}")/gpu_check.py" "$@"
