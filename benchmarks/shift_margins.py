"""Where a method's top-1 shift comes from: the queries binned by the exact logit margin between their first and
second key, and per bin the share of queries, how often the method's top-1 moves, and what that adds to the shift
(issue 44: why the trellis's shift falls less than its logit error on `aligned` and `norope`). Keys only.

    python benchmarks/shift_margins.py --trace t11_aligned.pt [--trace ...] --methods textbook,quantwm-trellis \
        [--budget 2.5] [--bound]

Each method is configured within the budget and committed as `quantwm analyze` does (`quantwm.evaluation.analyze`:
the same cache, sink and recent chunks, the same probe; Keys only), so a bin's shifts add up to analyze's
`shift_rate`. Margins are in scaled-logit units, over every cached key (exact and quantized alike), pooled over
heads and layers.

`--bound` adds a row no real coder reaches: each quantized span's keys passed through the Gaussian test channel of
the rate-distortion bound at the budget, in the reading queries' metric (an oracle: the meter `analyze` reports
with the trace's queries). Per stream, z = Vᵀ S^½ (k − mean) with S the reading queries' second moment and V the
eigenvectors of W = S^½ C S^½ (eigenvalues w_i); θ the water level at budget · D bits a token; component i gets
D_i = min(θ, w_i), and ẑ_i = a_i z_i + √(a_i D_i) ε_i with a_i = 1 − D_i / w_i, ε seeded N(0, 1) (so E(ẑ_i − z_i)²
= D_i whatever the keys' law); the logit error is qᵀ S^{+½} V (ẑ − z). Its shift is what an ideal coder's random
error would cost at that budget.
"""
from __future__ import annotations

import argparse

import torch

from quantwm.core.budget import fit_methods
from quantwm.evaluation.analyze import keys_config, layer_keys, quantized_spans
from quantwm.evaluation.metrics import probe_logits, second_moment
from quantwm.evaluation.rate_distortion import water_level
from quantwm.evaluation.trace import read_trace

EDGES = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16)  # the bins' upper edges, then one open bin


def bound_logits(q: torch.Tensor, k: torch.Tensor, spans: list[slice], budget: float,
                 gen: torch.Generator) -> torch.Tensor:
    """The logits (H, Nq, L) of queries q (H, Nq, D) over keys k (H, L, D) whose `spans` pass through the bound's
    test channel at `budget` bits per element (the module docstring's `--bound`); unscaled."""
    q, k = q.double(), k.double()
    lam, vec = torch.linalg.eigh(second_moment(q).double())
    keep = lam > 1e-12 * lam.amax(-1, keepdim=True)
    half = vec @ torch.diag_embed(lam.clamp_min(0).sqrt()) @ vec.transpose(-1, -2)
    inv_half = vec @ torch.diag_embed(torch.where(keep, lam.clamp_min(1e-300).rsqrt(), 0.0)) @ vec.transpose(-1, -2)
    logits = q @ k.transpose(-1, -2)
    for s in spans:
        c = k[:, s] - k[:, s].mean(1, keepdim=True)
        x = c @ half  # S^½ (k − mean), S symmetric
        w, V = torch.linalg.eigh(x.transpose(-1, -2) @ x / x.shape[1])
        w = w.clamp_min(0)
        D = torch.minimum(w, water_level(w, budget * k.shape[-1])[:, None])
        a = torch.where(w > 0, 1 - D / w.clamp_min(1e-300), 0.0)
        z = x @ V
        noise = torch.randn(z.shape, generator=gen, dtype=z.dtype) * (a * D).sqrt()[:, None]
        error = ((a[:, None] - 1) * z + noise) @ V.transpose(-1, -2) @ inv_half  # k̂ − k on S's range
        logits[:, :, s] += q @ error.transpose(-1, -2)
    return logits


def margin_table(path: str, methods: list[str], budget: float, bound: bool = False) -> dict[str, dict]:
    """{method: {"bins": (3, bins) float64, "logit_rmse": float, "top1_key_error": float}}: per margin bin the share
    of queries, the flip rate and the shift it adds; the scaled-logit RMSE over the quantized keys; and the key error
    (L2) at each query's exact top-1 key, where that key is quantized, over the mean key error of the quantized keys
    (nan for the bound, which has no keys)."""
    trace = read_trace(path)
    H, L, D = next(iter(trace.layers.values()))["k"].shape
    config, chunk = keys_config(trace, "textbook", budget)
    fitted, left_out = fit_methods(methods, budget, None, D, chunk, "k", {},
                                   layer_elements=H * config.held_chunks * chunk * D)
    for m, why in left_out.items():
        print(f"{m}: left out ({why})")
    edges = torch.tensor(EDGES, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    out = {}
    for m in [m for m in fitted if m not in left_out] + (["bound"] if bound else []):
        config = keys_config(trace, "textbook" if m == "bound" else m, budget)[0]
        count = torch.zeros(len(EDGES) + 1, dtype=torch.float64)
        flips = torch.zeros_like(count)
        sq, n_sq, top_err, n_top, mean_err = 0.0, 0, 0.0, 0, 0.0
        for layer in trace.layers:
            cache, k, k_hat, bias = layer_keys(trace, layer, config, chunk)
            q = trace.layers[layer]["q"].float()
            exact, stored = probe_logits(q, k, k_hat, trace.softmax_scale, bias)
            spans = quantized_spans(cache)
            quantized = torch.zeros(k.shape[1], dtype=torch.bool)
            for span in spans:
                quantized[span] = True
            if m == "bound":  # textbook's cache only for its spans: which tokens are quantized
                stored = (bound_logits(q, k, spans, budget, gen) * trace.softmax_scale).float()
            diff = (stored - exact)[..., quantized].double()
            sq, n_sq = sq + diff.square().sum().item(), n_sq + diff.numel()
            first = exact.argmax(-1)  # (H, Nq)
            error = (k_hat - k).norm(dim=-1).double()  # (H, L)
            hit = quantized[first]
            top_err += error.gather(1, first)[hit].sum().item()
            n_top += int(hit.sum())
            mean_err += error[:, quantized].mean().item() / len(trace.layers)
            top = exact.topk(2, -1).values
            bins = torch.bucketize((top[..., 0] - top[..., 1]).double().flatten(), edges)
            moved = (first != stored.argmax(-1)).double().flatten()
            count += torch.bincount(bins, minlength=len(count)).double()
            flips += torch.bincount(bins, weights=moved, minlength=len(count))
        total = count.sum()
        ratio = top_err / max(n_top, 1) / mean_err if m != "bound" and mean_err > 0 else float("nan")
        out[m] = {"bins": torch.stack([count / total, flips / count.clamp_min(1), flips / total]),
                  "logit_rmse": (sq / max(n_sq, 1)) ** 0.5, "top1_key_error": ratio}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", action="append", required=True, help="a trace file (repeatable)")
    ap.add_argument("--methods", default="textbook,quantwm,quantwm-trellis")
    ap.add_argument("--budget", type=float, default=2.5)
    ap.add_argument("--bound", action="store_true", help="add the bound's test channel (docstring)")
    a = ap.parse_args(argv)
    names = [f"< {e:g}" for e in EDGES] + [f">= {EDGES[-1]:g}"]
    for path in a.trace:
        print(f"\n{path}, {a.budget:g} bits, margin bins (scaled logits): " + ", ".join(names))
        print("| method | row | " + " | ".join(names) + " | total |\n|---|---|" + "---|" * (len(names) + 1))
        table = margin_table(path, a.methods.split(","), a.budget, a.bound)
        for m, r in table.items():
            t = r["bins"]
            for i, row in enumerate(("share of queries", "top-1 moves", "adds to the shift")):
                total = f"{t[2].sum().item():.4f}" if i == 2 else ""
                print(f"| {m} | {row} | " + " | ".join(f"{x:.4f}" for x in t[i].tolist()) + f" | {total} |",
                      flush=True)
        for m, r in table.items():
            print(f"{m}: logit RMSE over the quantized keys {r['logit_rmse']:.4f}; key error at the top-1 key over "
                  f"the mean {r['top1_key_error']:.3f}")


if __name__ == "__main__":
    main()
