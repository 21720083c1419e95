"""The device check: fused 2-bit attention vs BF16 SDPA, and the cost of quantizing a committed chunk.

    python benchmarks/kernel_bench.py                  # Wan-1.3B-like shapes on the GPU (12 heads x 128, 4680 queries)
    python benchmarks/kernel_bench.py --preset tiny    # seconds on a CPU (kernels under TRITON_INTERPRET=1)

For every cache length it builds a one-layer QuantWM cache by committing random chunks (BF16 sink and
recent chunk, the rest quantized with `--method`), then times, on the same cache, one attention call of a
chunk of queries:
  bf16      scaled_dot_product_attention over the cache kept in BF16 (on CUDA its flash backend)
  dequant   the cache's reference path: decompress every span to full precision, then SDPA (QVG's way)
  fused     kernels/span_attention.py over the stored bytes (QUANTWM_KERNELS=auto on CUDA, =triton on CPU)
  fused int8 / fused e4m3
            the same kernel with its 8-bit products (CacheConfig.lowp; QKᵀ in INT8 or e4m3, PV in e4m3)
and prints time, achieved bandwidth (bytes the call must read: stored K/V plus Q and the output) and the
ratio to bf16 from the same run. It also times quantizing one committed chunk (k-means / QSAC assignment,
residual packing, PSAC) and puts it beside (steps + 1) x the BF16 attention time of that chunk: a lower
bound on the chunk's generation time in this layer, so the percentage printed is an upper bound.
This script, unlike the kernels, imports quantwm: it measures the library's fast path end to end. The timing
itself is quantwm/evaluation/kernel_timing.py, which `quantwm selfcheck` runs too.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports kernels/

from quantwm.core.backend import device_name  # noqa: E402
from quantwm.evaluation.kernel_timing import PRESETS, print_rows, time_paths  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="wan-1.3b")
    ap.add_argument("--method", default="quantwm")
    ap.add_argument("--steps", type=int, default=4, help="denoising passes per chunk (plus one clean pass)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--budget", type=float, default=None, help="bits per element the method configures itself within "
                    "(quantwm: its allocator's mixed-width channels, which the fused kernel reads too)")
    ap.add_argument("--json", help="also write the rows to this file")
    a = ap.parse_args(argv)
    print(f"device: {device_name()}  torch {torch.__version__}  preset {a.preset}  method {a.method}"
          f"{'' if a.budget is None else f' at {a.budget:g} bits'}", flush=True)
    rows = time_paths(a.preset, a.method, a.steps, a.reps, a.budget)
    print_rows(rows)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": device_name(), "preset": a.preset, "method": a.method, "budget": a.budget,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
