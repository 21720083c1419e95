"""TurboQuant's paper split against its plain grids on a trace: where the split's bits go (issue 44, part 4).

    python benchmarks/turboquant_split.py --trace t11_aligned.pt [--trace t11_flat.pt ...]

For each trace, Keys only, through `quantwm analyze`'s path: `turboquant` at 2 and 3 bits, and its "2.5-bit" split
(a quarter of the channels, those of largest key energy, one bit wider, in a second instance). Printed per row: the
top-1 shift, the plain relative Key error, the logit RMSE, the query-weighted Key distortion of the rate-distortion
meter (e^T S e over the weighted variance) and the stored bits. A split whose Key error falls while the
query-weighted distortion and the logit error do not has spent its bits on channels the queries do not read.
"""
from __future__ import annotations

import argparse

import torch

from quantwm.evaluation.analyze import analyze_trace
from quantwm.evaluation.trace import read_trace

ROWS = (("plain 2 bits", 2, ()), ("plain 3 bits", 3, ()), ("split 3/2", 2, "split"))


def rows(path: str) -> list[dict]:
    """One dict per configuration of ROWS on the trace at `path` (means over its layers)."""
    trace = read_trace(path)
    D = next(iter(trace.layers.values()))["k"].shape[-1]
    out = []
    for label, bits, opts in ROWS:
        if opts == "split":
            opts = (("outlier_channels", D // 4), ("outlier_bits", bits + 1))
        m = analyze_trace(trace, ["turboquant"], target="k", bits=bits, method_options=opts)["methods"]["turboquant"]
        out.append({"config": label, **{k: m["mean"][k] for k in ("shift_rate", "k_rel_err", "logit_rmse",
                                                                   "k_distortion", "bits_per_element")}})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", action="append", required=True, help="a trace file (repeatable)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    print("| trace | config | bits | shift | Key rel. error | logit RMSE | query-weighted distortion |")
    print("|---|---|---|---|---|---|---|")
    for path in a.trace:
        for r in rows(path):
            print(f"| {path.rsplit('/', 1)[-1]} | {r['config']} | {r['bits_per_element']:.3f} | {r['shift_rate']:.4f} | "
                  f"{r['k_rel_err']:.4f} | {r['logit_rmse']:.4f} | {r['k_distortion']:.4g} |", flush=True)


if __name__ == "__main__":
    main()
