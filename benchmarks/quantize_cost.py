"""CPU cost of quantizing one committed chunk: quantwm vs qvg (and the others) at Wan-1.3B shapes.

A chunk of 3 latent frames = 4680 tokens x 12 heads x 128, Keys and Values, with history-Query
statistics whose energy sits in a few directions. Prints seconds per chunk (median of --repeats runs)
and the ratio to qvg. Usage: python benchmarks/quantize_cost.py [--tokens 4680] [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from quantwm.core.methods import SpanContext, get_method


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4680)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--methods", default="qvg,quantwm,quantwm-qsac,quantwm-psac,rtn,kivi")
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    S, N, D = a.heads, a.tokens, a.head_dim
    k = torch.randn(S, N, D, generator=g)
    k[..., :4] += 8  # outlier channels
    v = torch.randn(S, N, D, generator=g)
    q = torch.randn(S, 2048, D, generator=g) * torch.logspace(0.5, -1.5, D)
    stats = q.transpose(1, 2) @ q / q.shape[1]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; chunk {N} tokens x {S} heads x {D}, K+V")
    times = {}
    for name in a.methods.split(","):
        m = get_method(name)
        runs = []
        for r in range(a.repeats + 1):  # the first run warms up
            ctx = SpanContext(stats=stats, seed=r)
            t0 = time.perf_counter()
            m.encode(k, "k", ctx), m.encode(v, "v", ctx)
            runs.append(time.perf_counter() - t0)
        times[name] = statistics.median(runs[1:])
    for name, t in times.items():
        ratio = f"{t / times['qvg']:.2f}x qvg" if "qvg" in times else ""
        print(f"{name:14s} {t:7.3f} s/chunk  {ratio}")


if __name__ == "__main__":
    main()
