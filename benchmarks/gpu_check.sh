#!/usr/bin/env bash
# The device check, one script for a lent GPU (at most 8 minutes by its own clock); see benchmarks/gpu_check.py.
#   bash benchmarks/gpu_check.sh              # on a CUDA GPU
#   bash benchmarks/gpu_check.sh --dry-run    # the same steps on the CPU at tiny shapes (CI runs this in a test)
set -euo pipefail
cd "$(dirname "$0")/.."
exec python benchmarks/gpu_check.py "$@"
