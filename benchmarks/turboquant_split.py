"""TurboQuant's paper split against its plain grids on a trace: where the split's bits go (issue 44, part 4).

    python benchmarks/turboquant_split.py --trace t11_aligned.pt [--trace t11_flat.pt ...]
    python benchmarks/turboquant_split.py --builtin    # the built-in world model, Keys, world seeds 0 and 1

For each trace, Keys only, through `quantwm analyze`'s path: `turboquant` at 2 and 3 bits, and its "2.5-bit" split
(a quarter of the channels, those of largest key energy, one bit wider, in a second instance). Printed per row: the
top-1 shift, the plain relative Key error, the logit RMSE, the query-weighted Key distortion of the rate-distortion
meter (e^T S e over the weighted variance) and the stored bits. A split whose Key error falls while the
query-weighted distortion and the logit error do not has spent its bits on channels the queries do not read.

The last row is a diagnostic, not TurboQuant: the split with its 3-bit instance's decoded part scaled by
(1 − D_2) / (1 − D_3), D_b the b-bit Lloyd-Max MSE of a unit Gaussian (0.1175, 0.0345), so that both parts shrink
alike. A Lloyd-Max code decodes a coordinate to its cell's mean, so given the key the decoded logit is (1 − D_b)
times the exact one plus noise: one instance shrinks every quantized key's logit by the same factor, which keeps
their order, while two instances shrink a key's outlier and other channels by different factors, a bias that
depends on how its logit divides between them and so reorders keys at the same logit RMSE. The row measures how
much of the split's shift that bias is.

`--builtin`: the same on the built-in world model (held-out world seeds 0 and 1, 16 frames, Keys only, as `quantwm
eval --target k` runs it): plain 2 bits, the split that `--budget 3` picks at head dim 64 (16 channels at 3 bits,
2.77 bits stored), and that split shrunk alike. Printed per row: place shift, top-1 shift, PSNR against BF16.
"""
from __future__ import annotations

import argparse
import contextlib

import torch

from quantwm.core.layouts.rotated import Rotated
from quantwm.core.lloyd_max import lloyd_max
from quantwm.evaluation.analyze import analyze_trace
from quantwm.evaluation.trace import read_trace

ROWS = (("plain 2 bits", 2, ()), ("plain 3 bits", 3, ()), ("split 3/2", 2, "split"),
        ("split 3/2, parts shrunk alike (diagnostic)", 2, "alike"))


@contextlib.contextmanager
def shrunk_alike():
    """While active, a split `Rotated` span decodes its wider instance's channels scaled by (1 − D_narrow) /
    (1 − D_wide) (the module docstring's diagnostic); plain spans decode as stored."""
    decode = Rotated.__dict__["decode"]

    def alike(self):
        out = decode(self)
        if self.channels is None:
            return out
        wide, narrow = self.bits
        factor = (1 - lloyd_max(narrow).mse) / (1 - lloyd_max(wide).mse)
        scale = torch.ones(out.shape[0], out.shape[2], device=out.device)
        scale.scatter_(1, self.channels.long(), factor)
        return out * scale[:, None, :]

    Rotated.decode = alike
    try:
        yield
    finally:
        Rotated.decode = decode


def rows(path: str) -> list[dict]:
    """One dict per configuration of ROWS on the trace at `path` (means over its layers)."""
    trace = read_trace(path)
    D = next(iter(trace.layers.values()))["k"].shape[-1]
    out = []
    for label, bits, opts in ROWS:
        alike = opts == "alike"
        if opts in ("split", "alike"):
            opts = (("outlier_channels", D // 4), ("outlier_bits", bits + 1))
        with shrunk_alike() if alike else contextlib.nullcontext():
            m = analyze_trace(trace, ["turboquant"], target="k", bits=bits, method_options=opts)["methods"]["turboquant"]
        out.append({"config": label, **{k: m["mean"][k] for k in ("shift_rate", "k_rel_err", "logit_rmse",
                                                                   "k_distortion", "bits_per_element")}})
    return out


def builtin_rows() -> list[dict]:
    """The `--builtin` rows: (config, bits stored, place shift, top-1 shift, PSNR) on the built-in world model."""
    from quantwm.cli_values import world_model
    from quantwm.world.evaluate import evaluate

    model, out = world_model(None), []
    for label, bits, budget, alike in (("plain 2 bits", 2, None, False), ("split (--budget 3)", 2, 3.0, False),
                                       ("split, parts shrunk alike (diagnostic)", 2, 3.0, True)):
        with shrunk_alike() if alike else contextlib.nullcontext():
            m = evaluate(model, ["turboquant"], "k", [0, 1], 16, bits, budget=(budget, None))["methods"]["turboquant"]
        out.append({"config": label, **{k: m["mean"][k] for k in ("bits_per_element", "place_shift_rate",
                                                                   "shift_rate", "psnr")}})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", action="append", default=[], help="a trace file (repeatable)")
    ap.add_argument("--builtin", action="store_true", help="the built-in world model instead (docstring)")
    a = ap.parse_args(argv)
    if not a.trace and not a.builtin:
        ap.error("give --trace (one or more) or --builtin")
    torch.set_num_threads(1)
    if a.builtin:
        print("| config | bits | place shift | top-1 shift | PSNR |\n|---|---|---|---|---|")
        for r in builtin_rows():
            print(f"| {r['config']} | {r['bits_per_element']:.3f} | {r['place_shift_rate']:.4f} | "
                  f"{r['shift_rate']:.4f} | {r['psnr']:.2f} dB |", flush=True)
        return
    print("| trace | config | bits | shift | Key rel. error | logit RMSE | query-weighted distortion |")
    print("|---|---|---|---|---|---|---|")
    for path in a.trace:
        for r in rows(path):
            print(f"| {path.rsplit('/', 1)[-1]} | {r['config']} | {r['bits_per_element']:.3f} | {r['shift_rate']:.4f} | "
                  f"{r['k_rel_err']:.4f} | {r['logit_rmse']:.4f} | {r['k_distortion']:.4g} |", flush=True)


if __name__ == "__main__":
    main()
