#!/usr/bin/env bash
# The README's trace, memory, frontier and ablation figures (besides benchmarks/world_eval.sh), into out/readme/.
# About 45 minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
O=out/readme; mkdir -p $O
q() { python -m quantwm "$@" 2>/dev/null; }
# synthetic world traces: seed 0 reported, seed 1 for choosing constants; three query concentrations
q synth-trace --seed 0 --out $O/syn0.safetensors
q synth-trace --seed 1 --out $O/syn1.safetensors
q synth-trace --seed 0 --query-dims 12 --out $O/syn0_q12.safetensors
q synth-trace --seed 0 --query-dims 22 --out $O/syn0_q22.safetensors
q analyze --trace $O/syn0.safetensors --methods bf16,rtn,kivi,qvg,qvg-asym,qvg-pro,qvg-budget,quantwm,quantwm-paper,quantwm-qsac,quantwm-psac,qvg+jensen,quantwm+jensen --target k --json $O/syn0.json > $O/syn0.txt
for L in 0 1 4 16 64; do q analyze --trace $O/syn1.safetensors --methods quantwm-qsac --set lam=$L --target k --json $O/lam$L.json > $O/lam$L.txt; done
q analyze --trace $O/syn1.safetensors --methods quantwm-qsac --set candidates=none --target k --json $O/lam16_exact.json > $O/lam16_exact.txt
q analyze --trace $O/syn1.safetensors --methods qvg-budget --target k --json $O/lam_kmeans.json > $O/lam_kmeans.txt
# QSAC ablation at identical budgets, three concentrations (seed 0, Keys)
for T in syn0 syn0_q12 syn0_q22; do
  q analyze --trace $O/$T.safetensors --methods quantwm,quantwm-psac,quantwm-qsac,qvg-budget,quantwm-paper --target k --json $O/abl_$T.json > $O/abl_$T.txt
  q analyze --trace $O/$T.safetensors --methods quantwm-paper --set qsac=false --target k --json $O/abl_${T}_paper_noqsac.json > $O/abl_${T}_paper_noqsac.txt
done
# memory at Wan-1.3B shapes, spans of 1 and 8 chunks, as deployed (drifting queries)
for M in rtn kivi qvg qvg-asym qvg-pro qvg-budget quantwm quantwm-paper; do
  for SP in 1 8; do q memory --preset wan-1.3b --latent-frames 21 --method $M --span-chunks $SP --sample-layers 1 --json $O/mem_${M}_$SP.json > $O/mem_${M}_$SP.txt; done
done
q memory --preset wan-1.3b --latent-frames 21 --method quantwm --queries none --sample-layers 1 --json $O/mem_quantwm_1_none.json > $O/mem_quantwm_1_none.txt
# the frontier: the built-in model (held-out seeds 0 and 1) and synthetic traces at realistic spans (24x24 tokens
# per frame, 3 frames per chunk: 1728-token spans at head dim 128; 2 layers x 4 heads) with 8-, 16- and
# 24-dimensional query subspaces, seed 0 (the allocator was developed on seed 7)
q frontier --sources world --bits 2,3 --max-bits 4 --seeds 0,1 --frames 16 --workers 2 --out-dir $O/frontier_world > $O/frontier_world.txt
for D in 8 16 24; do q synth-trace --seed 0 --layers 2 --heads 4 --grid 24x24 --query-dims $D --out $O/fr_q$D.safetensors; done
q frontier --sources trace:$O/fr_q8.safetensors,trace:$O/fr_q16.safetensors,trace:$O/fr_q24.safetensors --bits 2,3 --max-bits 4 --target k --workers 2 --out-dir $O/frontier_traces > $O/frontier_traces.txt
# where the allocator's lead comes from: query-aware vs every channel alike, at 2.5 bits
for D in 8 16 24; do
  q analyze --trace $O/fr_q$D.safetensors --methods quantwm --set budget=2.5 --target k --json $O/alloc_q$D.json > $O/alloc_q$D.txt
  q analyze --trace $O/fr_q$D.safetensors --methods quantwm --set budget=2.5 --set qsac=false --target k --json $O/alloc_eucl_q$D.json > $O/alloc_eucl_q$D.txt
done
q eval --methods quantwm --set budget=2.5 --seeds 0,1 --frames 16 --json $O/alloc_world.json > $O/alloc_world.txt
q eval --methods quantwm --set budget=2.5 --set qsac=false --seeds 0,1 --frames 16 --json $O/alloc_eucl_world.json > $O/alloc_eucl_world.txt
# the held-out check: the world sweep on seeds reported nowhere else
q frontier --sources world --bits 2,3 --max-bits 4 --seeds 2,3 --frames 16 --workers 2 --out-dir $O/frontier_world_23 > $O/frontier_world_23.txt
echo done
