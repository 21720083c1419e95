"""SGLang's own QVG int2/int4 cache and QuantWM's, through SGLang's causal KV contract, on the same K/V and queries.

    python benchmarks/sglang_kv.py --trace TRACE.safetensors      # a recorded trace (`quantwm trace`, a capture)
    python benchmarks/sglang_kv.py                                 # a synthetic world-memory trace (seed 100000)

Every layer's cached K/V is fed chunk by chunk through `update_and_get_attention_kv`, one call per chunk (the
recorded K/V is the clean pass), into: SGLang's dense `CausalSelfAttentionKVCache` (the reference),
SGLang's `QVGPackedCausalKVCache` at int2 and int4 with its released defaults (128 centroids, block 64, sink
packed, one recent chunk BF16), and `QuantWMCausalKVCache` configured the same way (sink quantized:
sink_chunks=0, one recent chunk) at 2, 3 and 4 bits, plus RTN at 2 bits. (quantwm's own `qvg` is left out:
as its paper configures it, it amortises 256 centroids over spans of 8 chunks, which this per-chunk
contract does not give it; SGLang's QVG, tuned per chunk with 128 centroids, is the baseline here.) The trace's queries then attend to
the view of the last write. Printed per cache, averaged over layers:

  bits/elt   bits per element of the quantized chunks, from their stored bytes (codes and all metadata)
  MB         bytes the cache holds after the run (all layers), as the cache reports them
  out err    ||o - o_dense|| / ||o_dense|| of the attention output
  shift      share of (query, head) whose top-1 cached key differs from the dense cache's
  ms/chunk   wall time of one update_and_get_attention_kv (CUDA-synchronised), mean over the run

Compare rows at equal bits per element, or read the rows as a quality-vs-bits frontier. QuantWM gets S from
the trace's earlier queries (`q_hist`) as a calibration, as a deployment with a calibration file would; QVG
uses no queries. QVG's cache needs CUDA and `quant_videogen` (pip install --no-deps quant-videogen==0.1.0)
inside an SGLang install; without them its rows say why they were skipped.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

from quantwm.adapters.sglang_cache import QuantWMCausalKVCache, load_contract, load_sglang_module
from quantwm.core.cache import CacheConfig
from quantwm.evaluation.metrics import rel_err
from quantwm.evaluation.trace import read_trace


def qvg_cache_factory(bits: int):
    """SGLang's QVG packed cache at `bits` (its released defaults otherwise), or the reason it cannot run."""
    if not torch.cuda.is_available():
        return None, "needs CUDA (its PRQ kernels are Triton GPU kernels)"
    try:
        packed = load_sglang_module("sglang.multimodal_gen.runtime.layers.kvcache.qvg_packed_cache")
        args = load_sglang_module("sglang.multimodal_gen.configs.quantization.qvg_kv").QVGKVQuantArgs(bits=bits)
        packed._qvg_functions()
    except Exception as e:  # an SGLang or quant_videogen install problem: report it in the row
        return None, f"not importable here ({type(e).__name__}: {e})"

    def make(heads, dim, size, dtype, device):
        return packed.QVGPackedCausalKVCache(
            batch_size=1, cache_size=size, num_heads=heads, head_dim=dim, dtype=dtype, device=device,
            global_end_index=torch.zeros(1, dtype=torch.long, device=device),
            local_end_index=torch.zeros(1, dtype=torch.long, device=device), quant_args=args.validate())
    return make, None


def quantwm_factory(method: str, bits: int):
    def make(heads, dim, size, dtype, device, stats=None):
        cfg = CacheConfig(method=method, k_bits=bits, v_bits=bits, sink_chunks=0, recent_chunks=1)
        return QuantWMCausalKVCache(config=cfg, batch_size=1, cache_size=size, num_heads=heads, head_dim=dim,
                                    dtype=dtype, device=device, query_stats=stats)
    return make


def dense_factory(heads, dim, size, dtype, device):
    shape = [1, size, heads, dim]
    return load_contract().CausalSelfAttentionKVCache(
        k=torch.zeros(shape, dtype=dtype, device=device), v=torch.zeros(shape, dtype=dtype, device=device),
        global_end_index=torch.zeros(1, dtype=torch.long, device=device),
        local_end_index=torch.zeros(1, dtype=torch.long, device=device), cache_size=size)


def run_layer(make, layer: dict, chunk_tokens: int, dtype, device, stats=None) -> tuple:
    """Feed one layer's K/V chunk by chunk; return (cache, view of the last write, seconds per call)."""
    k = layer["k"].to(device, dtype).transpose(0, 1)[None]  # (H, N, D) -> (1, N, H, D)
    v = layer["v"].to(device, dtype).transpose(0, 1)[None]
    H, D, N = k.shape[2], k.shape[3], k.shape[1]
    cache = make(H, D, N, dtype, device) if stats is None else make(H, D, N, dtype, device, stats)
    times, view = [], None
    for start in range(0, N, chunk_tokens):
        end = min(N, start + chunk_tokens)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        view = cache.update_and_get_attention_kv(key=k[:, start:end], value=v[:, start:end],
                                                 current_chunk_start=start)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return cache, view, statistics.mean(times)


def attention(q: torch.Tensor, view, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q (H, Nq, D) against the view's keys: (output (H, Nq, D), top-1 key index (H, Nq))."""
    K, V = view.k[0].transpose(0, 1).float(), view.v[0].transpose(0, 1).float()  # (H, L, D)
    logits = scale * q.float() @ K.transpose(-1, -2)
    return torch.softmax(logits, -1) @ V, logits.argmax(-1)


def quantized_bits(cache, layer: dict, chunk_tokens: int) -> float:
    if isinstance(cache, QuantWMCausalKVCache):
        return cache.bits_per_element()
    # QVG: everything but the current and the recent chunk is packed; bytes beyond those two BF16 chunks
    H, N, D = layer["k"].shape
    n_chunks = -(-N // chunk_tokens)
    bf16 = min(2, n_chunks) * chunk_tokens * H * D * 2 * 2
    packed_elements = max(0, N - min(2, n_chunks) * chunk_tokens) * H * D * 2
    return 8 * (cache.resident_nbytes() - bf16) / packed_elements if packed_elements else float("nan")


def held_bytes(cache) -> int:
    if hasattr(cache, "resident_nbytes"):
        return cache.resident_nbytes()
    return (cache.k.numel() * cache.k.element_size() + cache.v.numel() * cache.v.element_size())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", help="trace file (default: a synthetic world-memory trace, seed 100000)")
    p.add_argument("--chunk-frames", type=int, default=None, help="frames per chunk (default: the trace's)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    dtype = torch.bfloat16
    path = a.trace
    if path is None:
        from quantwm.evaluation.synthetic import make_synthetic_trace

        path = os.path.join(tempfile.mkdtemp(), "synthetic.safetensors")
        make_synthetic_trace(seed=100_000).save(path)
    try:
        trace = read_trace(path)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    chunk_frames = a.chunk_frames or int(trace.meta.get("chunk_frames", 1))
    chunk_tokens = chunk_frames * trace.tokens_per_frame
    scale = trace.softmax_scale
    H, N, D = next(iter(trace.layers.values()))["k"].shape
    print(f"trace {path}: {len(trace.layers)} layers, {H} heads x {D}, {N} cached tokens in chunks of "
          f"{chunk_tokens}; device {device}")

    caches = {"dense (SGLang BF16)": (dense_factory, None)}
    for bits in (2, 4):
        caches[f"qvg int{bits} (SGLang)"] = qvg_cache_factory(bits)
    for bits in (2, 3, 4):
        caches[f"quantwm {bits}-bit"] = (quantwm_factory("quantwm", bits), None)
    caches["rtn 2-bit"] = (quantwm_factory("rtn", 2), None)

    reference = {}
    print(f"{'cache':22s} {'bits/elt':>8s} {'MB':>8s} {'out err':>8s} {'shift':>7s} {'ms/chunk':>9s}")
    for name, (make, why) in caches.items():
        if make is None:
            print(f"{name:22s} skipped: {why}")
            continue
        rows = []
        for index, layer in trace.layers.items():
            q = layer["q"].to(device)
            stats = None
            if name.startswith("quantwm"):
                hist = layer.get("q_hist", layer["q"]).to(device).double()
                stats = (hist.transpose(-1, -2) @ hist / hist.shape[1]).cpu()  # S = E[q q^T] per head
            cache, view, seconds = run_layer(make, layer, chunk_tokens, dtype, device, stats)
            out, top = attention(q, view, scale)
            if name.startswith("dense"):
                reference[index] = (out, top)
            ref_out, ref_top = reference[index]
            rows.append(dict(bits=quantized_bits(cache, layer, chunk_tokens) if not name.startswith("dense")
                             else 16.0, bytes=held_bytes(cache),
                             err=rel_err(out, ref_out),
                             shift=(top != ref_top).float().mean().item(), ms=1e3 * seconds))
        mean = {key: statistics.mean(r[key] for r in rows) for key in ("bits", "err", "shift", "ms")}
        mb = sum(r["bytes"] for r in rows) / 2 ** 20
        print(f"{name:22s} {mean['bits']:8.3f} {mb:8.2f} {mean['err']:8.4f} {mean['shift']:7.3f} {mean['ms']:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
