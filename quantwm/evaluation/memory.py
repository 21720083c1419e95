"""Memory of the KV cache at real-model shapes, counted from the bytes the cache actually stores.

Random BF16 tensors of a preset's shapes are written into a `KVCache` chunk by chunk, layer by layer,
and quantized by the chosen method exactly as during generation; the report sums the stored tensors.
The last chunk of the requested length is the current (uncommitted) chunk, so a cache of N latent
frames holds the sink, the quantized middle, the recent chunk and the current chunk.
Byte counts depend only on shapes, so `sample_layers` may quantize fewer layers and scale the counts
(the report says how many were quantized).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..core.cache import CacheConfig, KVCache


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
    Preset("tiny", 2, 2, 64, 64, 2),  # for tests
)}


def memory_report(preset: str, latent_frames: int, method: str, target: str = "kv", bits: int = 2,
                  sample_layers: int | None = None, seed: int = 0, progress: Callable | None = None) -> dict:
    """Bytes per stored component, bits per element and compression for `method` at a preset's shapes."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known presets: {', '.join(PRESETS)}")
    p = PRESETS[preset]
    if latent_frames < 1:
        raise ValueError(f"latent_frames must be >= 1, got {latent_frames}")
    n_layers = p.layers if sample_layers is None else min(max(1, sample_layers), p.layers)
    config = CacheConfig(method=method, target=target, k_bits=bits, v_bits=bits, seed=seed)
    cache = KVCache(config, n_layers)
    g = torch.Generator().manual_seed(seed)
    sizes = [p.chunk_frames * p.tokens_per_frame] * (latent_frames // p.chunk_frames)
    if latent_frames % p.chunk_frames:
        sizes.append((latent_frames % p.chunk_frames) * p.tokens_per_frame)
    for layer in range(n_layers):
        for i, n in enumerate(sizes):
            k, v = (torch.randn(1, p.heads, n, p.head_dim, generator=g).to(torch.bfloat16) for _ in range(2))
            cache.write(layer, k, v, i)
            if i < len(sizes) - 1:
                cache.commit(layer, i)
        if progress:
            progress(layer + 1, n_layers, f"layer {layer}")
    factor = p.layers / n_layers
    comp = {k: int(round(v * factor)) for k, v in cache.bytes_by_component().items()}
    total = sum(comp.values())
    bf16 = 2 * p.layers * latent_frames * p.tokens_per_frame * p.heads * p.head_dim * 2
    bpe = cache.bits_per_element()
    return {"preset": p.__dict__, "method": method, "target": target, "bits": bits, "latent_frames": latent_frames,
            "chunks": len(sizes), "layers_quantized": n_layers, "bytes": comp, "total_bytes": total,
            "bf16_bytes": bf16, "bits_per_element": bpe, "compression": 16 / bpe if bpe == bpe else 1.0,
            "cache_compression": bf16 / total, "bf16_bytes_per_latent_frame": bf16 / latent_frames}
