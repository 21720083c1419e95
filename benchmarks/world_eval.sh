#!/usr/bin/env bash
# The figures of README "Results on the built-in model", in one go (about 15 minutes on 2 CPU cores).
# Held-out photographic worlds (seeds 0-3), 32 frames, loop trajectory, 2 bits. Outputs in out/final/.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p out/final
S="--seeds 0,1,2,3 --frames 32"
run() { name=$1; shift; python -m quantwm eval "$@" $S --json out/final/$name.json > out/final/$name.txt 2>/dev/null; }
# Keys and Values: every preset at its paper's configuration, and the baselines at quantwm's bits
run kv --methods bf16,rtn,kivi,qvg,qvg-asym,qvg-pro,qvg-budget,quantwm,quantwm-paper --target kv
run kv_qvg6 --methods qvg,qvg-asym --set n_centroids=6 --target kv            # QVG at quantwm's ~3.1 bits
# Ablations at identical budgets (QSAC on/off with the same centroids, metadata and PSAC) and +jensen
run abl --methods quantwm-qsac,quantwm-psac,qvg+jensen,quantwm+jensen --target kv
run abl_paper_noqsac --methods quantwm-paper --set qsac=false --target kv
# The Key-vs-Value experiment
run k --methods rtn,kivi,qvg-budget,quantwm --target k
run v --methods rtn,kivi,qvg-budget,quantwm --target v
run k_qvg6 --methods qvg --set n_centroids=6 --target k
run v_qvg6 --methods qvg --set n_centroids=6 --target v
# Memorisation: the same on worlds drawn from the training photographs
run train_seeds --methods rtn,quantwm --target kv --training-seeds
python benchmarks/world_copy_ceiling.py > out/final/ceiling.txt
echo done
