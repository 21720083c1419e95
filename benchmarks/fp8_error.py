"""The top-1 shift the low-precision attention path (CacheConfig.lowp; quantwm/core/fp8.py) adds on top of a
quantized cache, computed with the path's PyTorch twin (which the fused kernel matches; tests/test_kernels.py).

For every layer of each trace the cache is filled as the method stores it; then, over its spans (sink, quantized
chunks, recent chunk) the share of queries whose top-1 cached source differs from the exact keys' top-1, with:
exact fp32 products over the stored keys (the method's own shift, "exact"); the BF16 kernel path's products
(bf16 operands, "bf16"); and each low-precision format. "added" is the format's shift less the exact one, and
"over bf16" less the BF16 path's: the path it would replace. "out err" is the attention output's relative error
through the path (PV in e4m3 too) against exact attention over the same stored cache. "pos added" counts only
moves to a source at another spatial position of the frame (the place shift of models without world
coordinates): on the built-in model many keys are near-copies of one place in several frames, and flips among
them move the token-level top-1 without fetching other content.

    python benchmarks/fp8_error.py TRACE [TRACE ...] [--methods bf16,quantwm] [--budget 2.5] [--qk int8,e4m3]

Spans whose format has no fused kernel (qvg-pro's codebook stages, 3-bit codes) are read decoded, with their
mean key as centre. A trace of the built-in model: `quantwm trace --seed 7 --frames 32 --out w7.safetensors`.
"""
from __future__ import annotations

import argparse
import math

import torch

from quantwm.core.attention import chunk_spans, merge_splits, new_state, span_logits
from quantwm.core.cache import CacheConfig
from quantwm.core.fp8 import pv_fold
from quantwm.core.layouts import Full, Layout
from quantwm.evaluation.analyze import layer_cache
from quantwm.evaluation.trace import read_trace


def layer_spans(cache) -> list[tuple[Layout, Layout, bool]]:
    """(key layout, value layout, jensen) for every span of layer 0 of `cache`: the stored layouts where the fused
    path reads them, else the decoded keys and values span by span."""
    spans = chunk_spans(cache, 0)
    if spans is not None:
        return [(k, v, cache.config.jensen and k.quantized) for k, v in spans]
    out, a = [], 0
    K, V = cache.keys(0)[0], cache.values(0)[0]  # decoded (S, L, D)
    for c in cache.inspect(0):
        out.append((Full(K[:, a:a + c.n_tokens]), Full(V[:, a:a + c.n_tokens]), False))
        a += c.n_tokens
    return out


def measure(path: str, method: str, budget: float | None, formats: list[str]) -> dict:
    trace = read_trace(path)
    chunk = int(trace.meta.get("chunk_frames", 1)) * trace.tokens_per_frame
    config = CacheConfig(method=method, target="kv", budget=None if method == "bf16" or not budget else budget)
    names = ["exact", "bf16", *formats]
    shift, out_err, n = dict.fromkeys(names, 0.0), dict.fromkeys(formats, 0.0), 0
    pos_shift = dict.fromkeys(names, 0.0)
    for layer in trace.layers:
        t = trace.layers[layer]
        cache, rope = layer_cache(trace, layer, config, chunk)
        q, k = t["q"].float(), t["k"].float()
        if rope is not None:
            k = rope(k[None], torch.arange(k.shape[1]))[0]
        top_exact = (q @ k.transpose(1, 2)).argmax(-1)
        where = cache.positions(0) % trace.tokens_per_frame  # spatial position of every cached token
        S, Nq, D = q.shape
        spans = layer_spans(cache)
        scale = trace.softmax_scale
        values = [vs.decode() for _, vs, _ in spans]  # decoded once, read by every format
        for name in names:
            lowp = None if name == "exact" else name
            logits = [span_logits(q, ks.keys_read(), scale, ks.psac_args(q), jensen, lowp) for ks, _, jensen in spans]
            top = torch.cat(logits, -1).argmax(-1)
            shift[name] += float((top != top_exact).float().mean())
            pos_shift[name] += float((where[top] != where[top_exact]).float().mean())
            if name == "exact":  # log2-unit logits: softmax of their natural-log values
                ref = torch.softmax(torch.cat(logits, -1) / math.log2(math.e), -1) @ torch.cat(values, 1)
            elif name in formats:
                acc, m, l = new_state(S, 1, Nq, D, "cpu")
                for lg, V in zip(logits, values):
                    pv_fold(lg, V, m[:, 0], l[:, 0], acc[:, 0])
                out_err[name] += float((merge_splits(acc, m, l) - ref).norm() / ref.norm())
        n += 1
    bits = cache.bits_per_element() if method != "bf16" else 16.0
    return {"bits": bits, **{f"shift_{k}": v / n for k, v in shift.items()},
            **{f"pos_shift_{k}": v / n for k, v in pos_shift.items()},
            **{f"out_err_{k}": v / n for k, v in out_err.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--methods", default="bf16,quantwm")
    ap.add_argument("--budget", type=float, default=2.5, help="bits per element of the quantized methods; 0: their fixed "
                    "2-bit configurations (the formats the fused kernel reads)")
    ap.add_argument("--qk", default="int8,e4m3", help="QKᵀ operand formats to compare (int8, e4m3)")
    a = ap.parse_args()
    formats = a.qk.split(",")
    print(f"{'trace':24s} {'method':8s} {'bits':>5s} {'exact':>7s} {'bf16':>7s} {'QK':5s} {'path':>7s} "
          f"{'added':>9s} {'over bf16':>10s} {'pos added':>10s} {'out err':>8s}")
    for path in a.traces:
        for method in a.methods.split(","):
            r = measure(path, method, a.budget, formats)
            for f in formats:
                bits = "16" if method == "bf16" else f"{r['bits']:.2f}"
                print(f"{path.rsplit('/', 1)[-1][:24]:24s} {method:8s} {bits:>5s} {r['shift_exact']:7.4f} "
                      f"{r['shift_bf16']:7.4f} {f:5s} {r['shift_' + f]:7.4f} "
                      f"{100 * (r['shift_' + f] - r['shift_exact']):+7.2f}pt "
                      f"{100 * (r['shift_' + f] - r['shift_bf16']):+8.2f}pt "
                      f"{100 * (r['pos_shift_' + f] - r['pos_shift_exact']):+8.2f}pt {r['out_err_' + f]:8.4f}", flush=True)
                assert math.isfinite(r["shift_" + f])


if __name__ == "__main__":
    main()
