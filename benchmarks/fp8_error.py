"""The top-1 shift an FP8 attention path adds on top of a quantized cache, measured with its PyTorch emulation
(quantwm.core.fp8: smoothed keys, e4m3 queries and keys with per-block scales, fp32 products).

For every layer of each trace: the cached keys as the method stores them (the cache's decode), then the share of
queries whose top-1 source differs from the exact keys' when the logits are exact products over the stored keys
(the method's own shift), and when they go through the FP8 path (the method's shift plus FP8's). Also the
attention output's relative error through the FP8 path against exact BF16-free attention over the stored cache.

    python benchmarks/fp8_error.py TRACE [TRACE ...] [--methods bf16,quantwm] [--budget 2.5] [--block 64]

A trace of the built-in model: `quantwm trace --seed 7 --frames 32 --out world7.safetensors`.
"""
from __future__ import annotations

import argparse
import math

import torch

from quantwm.core.cache import CacheConfig
from quantwm.core.fp8 import fp8_attention, fp8_logits
from quantwm.evaluation.analyze import _layer_cache
from quantwm.evaluation.trace import read_trace


def measure(path: str, method: str, budget: float | None, block: int, qk: str = "e4m3") -> dict:
    trace = read_trace(path)
    chunk = int(trace.meta.get("chunk_frames", 1)) * trace.tokens_per_frame
    config = CacheConfig(method=method, target="kv", budget=None if method == "bf16" else budget)
    shift, shift_fp8, out_err, n = 0.0, 0.0, 0.0, 0
    for layer in trace.layers:
        t = trace.layers[layer]
        cache, rope = _layer_cache(trace, layer, config, chunk)
        q, k = t["q"].float(), t["k"].float()
        if rope is not None:
            k = rope(k[None], torch.arange(k.shape[1]))[0]
        k_hat, v_hat = cache.keys(0)[0], cache.values(0)[0]
        scale = trace.softmax_scale
        top_exact = (q @ k.transpose(1, 2)).argmax(-1)
        top_method = (q @ k_hat.transpose(1, 2)).argmax(-1)
        top_fp8 = fp8_logits(q, k_hat, scale, block, qk).argmax(-1)
        shift += float((top_method != top_exact).float().mean())
        shift_fp8 += float((top_fp8 != top_exact).float().mean())
        ref = torch.softmax(scale * q @ k_hat.transpose(1, 2), -1) @ v_hat
        out = fp8_attention(q, k_hat, v_hat, scale, block=block, qk=qk)
        out_err += float((out - ref).norm() / ref.norm())
        n += 1
    return {"shift": shift / n, "shift_fp8": shift_fp8 / n, "added_points": 100 * (shift_fp8 - shift) / n,
            "out_rel_err": out_err / n, "bits": cache.bits_per_element() if method != "bf16" else 16.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--methods", default="bf16,quantwm")
    ap.add_argument("--budget", type=float, default=2.5, help="bits per element of the quantized methods")
    ap.add_argument("--block", type=int, default=64, help="rows per e4m3 scale (queries, keys, values)")
    ap.add_argument("--qk", default="e4m3,int8", help="QKᵀ operand formats to compare (e4m3, int8)")
    a = ap.parse_args()
    print(f"{'trace':24s} {'method':8s} {'bits':>5s} {'QK':5s} {'shift':>7s} {'+low-p':>7s} {'added':>8s} {'out err':>8s}")
    for path in a.traces:
        for method in a.methods.split(","):
            for qk in a.qk.split(","):
                r = measure(path, method, a.budget, a.block, qk)
                bits = "16" if method == "bf16" else f"{r['bits']:.2f}"
                print(f"{path.rsplit('/', 1)[-1][:24]:24s} {method:8s} {bits:>5s} {qk:5s} {r['shift']:7.4f} "
                      f"{r['shift_fp8']:7.4f} {r['added_points']:+7.2f}pt {r['out_rel_err']:8.4f}")
                assert math.isfinite(r["shift_fp8"])


if __name__ == "__main__":
    main()
