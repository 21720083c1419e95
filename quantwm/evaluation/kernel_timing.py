"""Timing the fused attention against BF16 attention, and the cost of quantizing a committed chunk, on this
machine's device: what `quantwm selfcheck` prints and `benchmarks/kernel_bench.py` tables (one code, so the two
never disagree).

For every cache length it builds a one-layer cache by committing random chunks (BF16 sink and recent chunk, the
rest quantized with `method`), then times, on the same cache, one attention call of a chunk of queries:

* `bf16`: scaled_dot_product_attention over the cache kept in BF16 (on CUDA its flash backend);
* `dequant+sdpa`: the cache's reference path: every span decompressed to full precision, then SDPA (QVG's way);
* `fused`: kernels/span_attention.py over the stored bytes (QUANTWM_KERNELS=auto on CUDA, =triton on CPU);
* `fused int8` / `fused e4m3`: the same kernel with its 8-bit products (CacheConfig.lowp);
* `quantize chunk (method)`: one committed chunk's quantization, beside (steps + 1) x the BF16 attention time of
  that chunk (a lower bound on the chunk's generation time in this layer, so the share is an upper bound).

On a CPU the kernels run under the Triton interpreter (set TRITON_INTERPRET=1 before anything imports them):
those times say nothing about speed.
"""
from __future__ import annotations

import os
import statistics
import time

import torch
import torch.nn.functional as F

from ..core.attention import fused_attention
from ..core.cache import CacheConfig, KVCache

PRESETS = {
    "wan-1.3b": dict(heads=12, head_dim=128, chunk=4680, lengths=(8192, 32768, 65536), reps=10),
    "tiny": dict(heads=2, head_dim=64, chunk=64, lengths=(192, 320), reps=1),
}


def _timer(device: torch.device):
    def run(fn, reps: int) -> float:
        if device.type == "cuda":
            fn()  # warm-up (compiles kernels; a CPU's timing is a check that every path runs, not a measurement)
        times = []
        for _ in range(reps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return statistics.median(times)
    return run


def build_cache(method: str, length: int, heads: int, head_dim: int, chunk: int, device, dtype,
                budget: float | None = None):
    """A one-layer cache holding about `length` committed tokens (at `budget` bits per element when given), plus
    the seconds each quantizing commit took."""
    cache = KVCache(CacheConfig(method, budget=budget), 1)
    g = torch.Generator(device="cpu").manual_seed(0)
    n_chunks = max(1, -(-length // chunk))
    commit_times = []
    for i in range(n_chunks):
        k, v = (torch.randn(1, heads, chunk, head_dim, generator=g).to(device, dtype) for _ in range(2))
        q = torch.randn(1, heads, chunk, head_dim, generator=g).to(device, dtype)
        cache.write(0, k, v, i)
        cache.observe(0, q)  # history queries feed QSAC/PSAC, as in generation
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        cache.commit(0, i)  # quantizes the chunk that leaves the BF16 recent window
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:  # commits 0 and 1 quantize nothing (sink, recent)
            commit_times.append(time.perf_counter() - t)
    return cache, n_chunks, commit_times


def bf16_attention(q, k, v):
    """The BF16 baseline: SDPA, restricted to its flash backend on CUDA (FlashAttention-2) so the baseline is
    the one a deployment runs; the CPU has no flash backend and uses its default."""
    if q.is_cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v)
    return F.scaled_dot_product_attention(q, k, v)


def time_paths(preset: str | dict, method: str = "quantwm", steps: int = 4, reps: int | None = None,
               budget: float | None = None) -> list[dict]:
    """One row per (cache length, path): "bf16", "dequant+sdpa", "fused", "fused int8", "fused e4m3" with ms,
    GB/s (bytes the call must read over its time), bytes and the ratio to bf16; and "quantize chunk (method)"
    with its share of the chunk's attention time. `preset`: a name of PRESETS or a dict of the same keys."""
    p = PRESETS[preset] if isinstance(preset, str) else preset
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for length in p["lengths"]:
        rows += _time_length(length, p, method, steps, reps or p["reps"], budget, device)
    return rows


def _time_length(length: int, p: dict, method: str, steps: int, reps: int, budget: float | None, device) -> list[dict]:
    dtype = torch.bfloat16
    H, D, N = p["heads"], p["head_dim"], p["chunk"]
    timed = _timer(device)
    fused_mode = "auto" if device.type == "cuda" else "triton"
    cache, n_chunks, commit_times = build_cache(method, length, H, D, N, device, dtype, budget)
    L = n_chunks * N
    g = torch.Generator(device="cpu").manual_seed(1)
    q, k, v = (torch.randn(1, H, N, D, generator=g).to(device, dtype) for _ in range(3))
    Kb = torch.randn(1, H, L + N, D, generator=g).to(device, dtype)
    Vb = torch.randn(1, H, L + N, D, generator=g).to(device, dtype)

    def attend(mode: str):
        os.environ["QUANTWM_KERNELS"] = mode
        return lambda: cache.attend(0, q, k, v, chunk=n_chunks, observe=False)

    t_bf16 = timed(lambda: bf16_attention(q, Kb, Vb), reps)
    t_deq = timed(attend("ref"), reps)
    t_fused = timed(attend(fused_mode), reps)
    attend(fused_mode)()  # the current chunk written; the 8-bit paths read the same spans
    os.environ["QUANTWM_KERNELS"] = "auto"
    t_lowp = {f: timed(lambda f=f: fused_attention(cache, 0, q, D ** -0.5, lowp=f), reps) for f in ("int8", "e4m3")}
    qo = 2 * q.numel() * q.element_size()  # read Q, write O
    stored = cache.nbytes()  # committed spans as stored + the current chunk (written by attend)
    bf16_bytes = 2 * Kb.numel() * Kb.element_size() + qo
    t_quant = statistics.median(commit_times) if commit_times else float("nan")
    rows = [{"cache_tokens": L, "path": name, "ms": 1e3 * t, "GB/s": nbytes / t / 1e9, "bytes": nbytes,
             "vs_bf16": t / t_bf16}
            for name, t, nbytes in (("bf16", t_bf16, bf16_bytes), ("dequant+sdpa", t_deq, stored + qo),
                                    ("fused", t_fused, stored + qo), ("fused int8", t_lowp["int8"], stored + qo),
                                    ("fused e4m3", t_lowp["e4m3"], stored + qo))]
    rows.append({"cache_tokens": L, "path": f"quantize chunk ({method})", "ms": 1e3 * t_quant, "GB/s": float("nan"),
                 "bytes": 0, "vs_bf16": t_quant / t_bf16,
                 "pct_of_chunk_attention": 100 * t_quant / ((steps + 1) * t_bf16)})
    return rows


def print_rows(rows: list[dict]) -> None:
    """The rows of `time_paths` as one table."""
    print(f"{'cache tokens':>12}  {'path':<24} {'ms':>10} {'GB/s':>8} {'x bf16 time':>11}")
    for r in rows:
        extra = (f"  ({r['pct_of_chunk_attention']:.2f}% of the chunk's BF16 attention time)"
                 if "pct_of_chunk_attention" in r else "")
        print(f"{r['cache_tokens']:>12}  {r['path']:<24} {r['ms']:>10.3f} {r['GB/s']:>8.1f} {r['vs_bf16']:>11.3f}{extra}")
