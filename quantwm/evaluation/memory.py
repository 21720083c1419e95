"""Memory of the KV cache at real-model shapes, counted from the bytes the cache actually stores.

Random BF16 tensors of a preset's shapes are written into a `KVCache` chunk by chunk, layer by layer,
and quantized by the chosen method exactly as during generation; the report sums the stored tensors.
The last chunk of the requested length is the current (uncommitted) chunk, so a cache of N latent
frames holds the sink, the quantized middle, the recent chunk and the current chunk.
Byte counts depend on shapes and, for methods that store a PSAC basis only when the Query subspace moves,
on the queries: by default (`queries="drift"`) every chunk's attention feeds S with a synthetic query stream
whose 8-dimensional subspace drifts from chunk to chunk (a real model's subspace moves as the video does), so
bases are stored as a deployment would store them; `queries="none"` leaves S the identity (one basis per layer:
the best case). `sample_layers` may quantize fewer layers and scale the counts (the report says how many).
The report also gives the runtime state a deployment keeps beside the stored cache (the running S, warm-start
centroids), which the compression figures do not include. Its figures are a `CacheMemory`'s (`memory`): the
quantized spans' bits per element and compression (`bits_per_element`, `compression`) and the whole cache's bytes
and ratio (`total_bytes`, `bf16_bytes`, `cache_compression`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..core.budget import fit_methods
from ..core.cache import CacheConfig, CacheMemory, KVCache


@dataclass(frozen=True)
class Preset:
    name: str
    layers: int
    heads: int
    head_dim: int
    tokens_per_frame: int
    chunk_frames: int


PRESETS = {p.name: p for p in (
    Preset("wan-1.3b", 30, 12, 128, 1560, 3),  # Wan 2.1 1.3B at 480x832: 30x52 latent patches per frame
    Preset("wan-14b", 40, 40, 128, 1560, 3),
    # LingBot-World (Wan 2.2 A14B): 40 layers, 40 heads of 128, chunks of 3 latent frames, 480x832
    Preset("lingbot-world", 40, 40, 128, 1560, 3),
    # Matrix-Game-2 (Wan 2.1 1.3B): 30 layers, 12 heads of 128, chunks of 3 latent frames, 352x640: 22x40 patches
    Preset("matrix-game-2", 30, 12, 128, 880, 3),
    Preset("tiny", 2, 2, 64, 64, 2),  # for tests
)}


QUERY_STREAMS = ("drift", "none")


def drifting_queries(g: torch.Generator, basis: torch.Tensor, n: int, drift: float = 0.35) -> tuple[torch.Tensor, torch.Tensor]:
    """n queries per head in the span of `basis` (H, D, R) plus 10% isotropic noise, and the next chunk's
    basis: re-orthonormalised after a random step of relative size `drift`."""
    H, D, R = basis.shape
    q = torch.bmm(torch.randn(H, n, R, generator=g) * 3, basis.transpose(1, 2)) + 0.3 * torch.randn(H, n, D, generator=g)
    nxt = torch.linalg.qr(basis + drift * torch.randn(H, D, R, generator=g) / R ** 0.5)[0]
    return q, nxt


def memory_report(preset: str, latent_frames: int, method: str, target: str = "kv", bits: int = 2,
                  sample_layers: int | None = None, seed: int = 0, progress: Callable | None = None,
                  span_chunks: int = 1, queries: str = "drift", budget: tuple = (None, None)) -> dict:
    """Bytes per stored component, bits per element and compression for `method` at a preset's shapes;
    `budget` (Keys, Values): the method configures itself within it (ValueError when it cannot)."""
    if queries not in QUERY_STREAMS:
        raise ValueError(f"unknown query stream {queries!r}; known: {', '.join(QUERY_STREAMS)}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known presets: {', '.join(PRESETS)}")
    p = PRESETS[preset]
    if latent_frames < 1:
        raise ValueError(f"latent_frames must be >= 1, got {latent_frames}")
    n_layers = p.layers if sample_layers is None else min(max(1, sample_layers), p.layers)
    config = CacheConfig(method=method, target=target, k_bits=bits, v_bits=bits, seed=seed, span_chunks=span_chunks,
                         budget_k=budget[0], budget_v=budget[1])
    _, left_out = fit_methods([method], *budget, p.head_dim, span_chunks * p.chunk_frames * p.tokens_per_frame, target)
    if left_out:
        raise ValueError(left_out[method])
    # A video too short to complete one span has nothing quantized yet: the quantized chunks' figures then come
    # from the shortest video that quantizes one span, the whole-cache figures from the requested length.
    chunks = -(-latent_frames // p.chunk_frames)  # the last one is the current chunk
    need = config.sink_chunks + span_chunks + config.recent_chunks + 1
    probe = KVCache(config, 1)
    quantizing = probe.quantize_k or probe.quantize_v
    run_frames = need * p.chunk_frames if quantizing and chunks < need else latent_frames
    cache = _simulate(p, config, run_frames, n_layers, seed, queries, progress)
    factor = p.layers / n_layers
    runtime = {k: int(round(v * factor)) for k, v in cache.runtime_bytes().items()}
    bf16 = 2 * p.layers * latent_frames * p.tokens_per_frame * p.heads * p.head_dim * 2
    if run_frames == latent_frames:
        comp = {k: int(round(v * factor)) for k, v in cache.bytes_by_component().items()}
    else:  # nothing of the requested video is quantized: every chunk is BF16
        comp = {"k.full": bf16 // 2, "v.full": bf16 // 2}
    total = sum(comp.values())  # full-precision chunks are BF16 here: what is stored is what BF16 holds
    mem = CacheMemory(stored_bytes=total, bf16_bytes=bf16, by_component=comp, bits_per_element=cache.bits_per_element(),
                      cache_bits_per_element=8 * total / (bf16 / 2), runtime_bytes=runtime, cache_bytes=total)
    return {"preset": p.__dict__, "method": method, "target": target, "bits": bits, "latent_frames": latent_frames,
            "span_chunks": span_chunks, "queries": queries, "grid": cache.configuration["k" if cache.quantize_k else "v"],
            "runtime_bytes": runtime,
            "budget": {"k": budget[0], "v": budget[1]}, "configuration": cache.configuration,
            "quantized_figures_from_latent_frames": run_frames,
            "chunks": chunks, "layers_quantized": n_layers, "bytes": comp,
            "total_bytes": total, "bf16_bytes": bf16, "bits_per_element": mem.span_bits_per_element,
            "compression": mem.span_compression, "cache_compression": mem.cache_compression,
            "memory": mem.to_dict(), "summary": mem.summary(), "bf16_bytes_per_latent_frame": bf16 / latent_frames}


def _simulate(p: Preset, config: CacheConfig, latent_frames: int, n_layers: int, seed: int, queries: str,
              progress: Callable | None) -> KVCache:
    """Write random BF16 chunks of the preset's shapes, committing all but the last (the current chunk)."""
    cache = KVCache(config, n_layers)
    g = torch.Generator().manual_seed(seed)
    sizes = [p.chunk_frames * p.tokens_per_frame] * (latent_frames // p.chunk_frames)
    if latent_frames % p.chunk_frames:
        sizes.append((latent_frames % p.chunk_frames) * p.tokens_per_frame)
    for layer in range(n_layers):
        basis = torch.linalg.qr(torch.randn(p.heads, p.head_dim, 8, generator=g))[0]
        for i, n in enumerate(sizes):
            k, v = (torch.randn(1, p.heads, n, p.head_dim, generator=g).to(torch.bfloat16) for _ in range(2))
            cache.write(layer, k, v, i)
            if queries == "drift":
                q, basis = drifting_queries(g, basis, 256)
                cache.observe(layer, q[None])
            if i < len(sizes) - 1:
                cache.commit(layer, i)
        if progress:
            progress(layer + 1, n_layers, f"layer {layer}")
    return cache
