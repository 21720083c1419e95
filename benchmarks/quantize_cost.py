"""CPU cost of quantizing one committed chunk: quantwm vs qvg (and the others) at Wan-1.3B shapes.

A chunk of 3 latent frames = 4680 tokens x 12 heads x 128, Keys and Values, with history-Query
statistics whose energy sits in a few directions. Prints seconds per chunk (median of --repeats runs)
and the ratio to qvg, to quantwm's fixed configuration and to the allocator without the Queries' basis,
for the first span of a (layer, head) (which may store a new basis) and for a later one (which reuses it).
A method written NAME@B is configured at B bits per element by its budget rule (quantwm.core.budget; for
quantwm, its allocator).
Usage: python benchmarks/quantize_cost.py [--tokens 4680] [--repeats 3] [--methods qvg,quantwm,quantwm@2.5]
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

from quantwm.core.budget import configure, kind_budgets
from quantwm.core.methods import SpanContext, get_method


def build(spec: str, D: int, N: int) -> tuple:
    """(Keys' method, Values' method) for NAME or NAME@BUDGET."""
    name, _, budget = spec.partition("@")
    if not budget:
        return get_method(name), get_method(name)
    halves = kind_budgets(name, float(budget), float(budget))  # Keys and Values as a cache at this budget splits it
    return tuple(get_method(name, **configure(name, b, D, N, kind)[0]) for kind, b in zip("kv", halves))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4680)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--methods", default="qvg,quantwm,quantwm@2.5,quantwm-qsac,quantwm-psac,rtn,kivi,kivi@2.5")
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    S, N, D = a.heads, a.tokens, a.head_dim
    k = torch.randn(S, N, D, generator=g)
    k[..., :4] += 8  # outlier channels
    v = torch.randn(S, N, D, generator=g)
    q = torch.randn(S, 2048, D, generator=g) * torch.logspace(0.5, -1.5, D)
    stats = q.transpose(1, 2) @ q / q.shape[1]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; chunk {N} tokens x {S} heads x {D}, K+V")
    times, later = {}, {}
    for name in a.methods.split(","):
        mk, mv = build(name, D, N)
        runs, held = [], []
        for r in range(a.repeats + 1):  # the first run warms up
            ctx = SpanContext(stats=stats, seed=r, history=q.shape[1])
            t0 = time.perf_counter()
            mk.encode(k, "k", ctx), mv.encode(v, "v", ctx)
            runs.append(time.perf_counter() - t0)
            t0 = time.perf_counter()  # a later span: the state the first left (a stored Queries' basis) is reused
            mk.encode(k, "k", replace(ctx, seed=r + 1)), mv.encode(v, "v", replace(ctx, seed=r + 1))
            held.append(time.perf_counter() - t0)
        times[name], later[name] = statistics.median(runs[1:]), statistics.median(held[1:])
    print("first span of a (layer, head) / a later span (state such as the Queries' basis kept):")
    for name, t in times.items():
        ratio = "  ".join(f"{t / times[ref]:.2f}x / {later[name] / later[ref]:.2f}x {ref}"
                          for ref in ("qvg", "quantwm", "quantwm-channels@2.5") if ref in times)
        print(f"{name:22s} {t:7.3f} / {later[name]:7.3f} s/chunk  {ratio}")


if __name__ == "__main__":
    main()
