#!/usr/bin/env bash
# The figures of README "Results on the built-in model", in one go (about 8 minutes on 2 CPU cores).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p out/final
S="--seeds 0,1,2,3 --frames 32"
python -m quantwm eval --methods bf16,rtn,kivi,qvg,quantwm --target kv $S --json out/final/kv.json > out/final/kv.txt 2>/dev/null
python -m quantwm eval --methods quantwm-qsac,quantwm-psac,qvg+jensen,quantwm+jensen --target kv $S --json out/final/abl.json > out/final/abl.txt 2>/dev/null
python -m quantwm eval --methods rtn,kivi,qvg,quantwm --target k $S --json out/final/k.json > out/final/k.txt 2>/dev/null
python -m quantwm eval --methods rtn,kivi,qvg,quantwm --target v $S --json out/final/v.json > out/final/v.txt 2>/dev/null
python -m quantwm eval --methods rtn --target kv $S --training-seeds --json out/final/train_seeds.json > out/final/train_seeds.txt 2>/dev/null
python benchmarks/world_copy_ceiling.py > out/final/ceiling.txt
echo done
