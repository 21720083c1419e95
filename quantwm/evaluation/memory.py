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
A preset of one of the QuantWM paper's five models (`PAPER_PRESETS`) carries its window as FastVideo runs it:
sink frames become `sink_chunks` and a window of W latent frames (the chunk being generated included) at most
ceil(W / chunk) - 1 committed chunks beside the current one, as `adapters.fastvideo.base.FastVideoModel.cache_config`
maps it; a window or sink that is not a whole number of chunks is rounded up and the report says so (`window`).
The BF16 figure is then what the window holds in BF16, not the whole video.
The report also gives the runtime state a deployment keeps beside the stored cache (the running S, warm-start
centroids), which the compression figures do not include. Its figures are a `CacheMemory`'s (`memory`): the
quantized spans' bits per element and compression (`bits_per_element`, `compression`) and the whole cache's bytes
and ratio (`total_bytes`, `bf16_bytes`, `cache_compression`).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..core.budget import fit_methods
from ..core.cache import CacheConfig, CacheMemory, KVCache
from ..core.cache_types import frame_window


@dataclass(frozen=True)
class Preset:
    """A model's KV-cache shapes. `window`: latent frames the cache holds, the chunk being generated included (None:
    all); `sink_frames`: frames never evicted (None: QuantWM's default of one sink chunk, the presets without a
    model's window); `length`: the latent frames `memory` reports by default; `source`: where the values come from;
    `recent_frames`: the frames before the current chunk that the model's adapter keeps BF16 (None: one chunk)."""
    name: str
    layers: int
    heads: int
    head_dim: int
    tokens_per_frame: int
    chunk_frames: int
    window: int | None = None
    sink_frames: int | None = None
    length: int | None = None
    source: str = ""
    recent_frames: int | None = None  # latent frames behind the current chunk kept BF16 (None: one chunk)


FV = "fastvideo 0.2.1: fastvideo/"  # the source tree the paper presets were read from (file:line)
PRESETS = {p.name: p for p in (
    Preset("wan-1.3b", 30, 12, 128, 1560, 3),  # Wan 2.1 1.3B at 480x832: 30x52 latent patches per frame
    Preset("wan-14b", 40, 40, 128, 1560, 3),
    # LingBot-World (Wan 2.2 A14B): 40 layers, 40 heads of 128, chunks of 3 latent frames, 480x832
    Preset("lingbot-world", 40, 40, 128, 1560, 3),
    # The QuantWM paper's five models, as FastVideo 0.2.1 runs them (docs/results.md "The paper's five models").
    # LingBot-World-v2: dim 5120 / 40 heads, 40 layers, chunks of 4, window 18 with a 6-frame sink, 480x832 (60x104
    # latents, patches of 2x2: 1560 tokens); the paper's clip is 93 frames (5 s): 24 latent frames.
    Preset("lingbot-world-v2", 40, 40, 128, 1560, 4, window=18, sink_frames=6, length=24,
           source=FV + "configs/models/dits/lingbotworld2.py:22-39 (dim, heads, layers, local_attn_size, sink_size, "
                  "chunk_size, max_area); pipelines/basic/lingbotworld2/causal_fast_pipeline.py:239-240,279-280 "
                  "(latent grid, frame_seqlen, kv_size = frame_seqlen * local_attn_size)"),
    # Matrix-Game-2 (Wan 2.1 1.3B): 30 layers, 12 heads of 128, chunks of 3 latent frames, 352x640: 22x40 patches.
    # Its window (local_attn_size 6, no sink) is in the checkpoint's config.json, not in FastVideo's source.
    Preset("matrix-game-2", 30, 12, 128, 880, 3, window=6, sink_frames=0, length=15,
           source=FV + "configs/models/dits/matrixgame2.py:57-59 (local_attn_size -1 until the checkpoint's "
                  "config.json sets it: the stage requires it, pipelines/stages/matrixgame2_denoising.py:91; 6 as "
                  "Matrix-Game-2.0's config and models/dits/matrixgame2/action_module.py:229; sink 0; 3 frames per "
                  "block); 30x12x128 from the checkpoint (action_config img_hidden_size 1536, matrixgame2.py:42); "
                  "352x640, 57 frames: pipelines/basic/matrixgame2/presets.py:23-25"),
    # HY-World 1.5 (HY-WorldPlay): 54 double-stream blocks, hidden 2048 / 16 heads, patch 1, 16x VAE: 30x52 tokens at
    # 480x832; each 4-frame chunk reads 20 memory frames (the first chunk, the 12 most recent, the rest retrieved).
    # Any history frame may be retrieved again, so every frame's K/V are held (as quantwm.adapters.fastvideo.hyworld
    # holds them): frames 0-3 and the 12-frame recent context BF16, the rest quantized. Each block attends twice, with
    # RoPE and with PRoPE (camera-transformed k, v): 108 cache layers, as the adapter stores them.
    Preset("hy-world-1.5", 108, 16, 128, 1560, 4, window=None, sink_frames=4, length=32, recent_frames=12,
           source=FV + "configs/models/dits/hyworld.py:88,93-94,97 (patch, hidden, heads, depth: 54 blocks, "
                  "each with a RoPE and a PRoPE image attention, models/dits/hyworld/hyworld.py:157-205); "
                  "configs/models/vaes/hunyuan15vae.py:14 (16x); pipelines/basic/hyworld/presets.py:27-29 "
                  "(480x832, 125 frames); pipelines/stages/hyworld_denoising.py:185-191 (every 4 frames, "
                  "memory_frames=20); models/dits/hyworld/retrieval_context.py:262 (first chunk always kept)"),
    # LongCat-Video: 48 layers, 32 heads of 128, Wan VAE (8x) and 2x2 patches at 480x848: 30x53 tokens. Its cache
    # is the conditioning frames' K/V, written once; the paper's 21.709 GiB is 19 latent frames (at 480x832).
    Preset("longcat-video", 48, 32, 128, 1590, 4, window=None, sink_frames=0, length=19,
           source=FV + "configs/models/dits/longcat.py:77-80,87,113 (hidden, depth, heads, head dim, patch, "
                  "chunk_3d_shape 4); configs/pipelines/longcat.py:121 (Wan VAE); pipelines/basic/longcat/presets.py:"
                  "56-57 (480x848); pipelines/stages/longcat_kv_cache_init.py:53-102 (conditioning K/V cache)"),
    # Self-Forcing / Causal-Forcing (Wan 2.1 1.3B): chunks of 3, global attention (no window, no sink), 480x832,
    # 81 frames: 21 latent frames.
    Preset("self-forcing", 30, 12, 128, 1560, 3, window=None, sink_frames=0, length=21,
           source=FV + "configs/pipelines/wan.py:308 (SelfForcingWanT2V480PConfig); configs/models/dits/wanvideo.py:"
                  "87-89 (local_attn_size -1, sink_size 0, num_frames_per_block 3); pipelines/basic/wan/presets.py:"
                  "301-303 (480x832, 81 frames); 30x12x128: Wan2.1-T2V-1.3B, tests/golden_gate/test_wan_t2v.py:20-32"),
    Preset("tiny", 2, 2, 64, 64, 2),  # for tests
    Preset("tiny-window", 2, 2, 64, 64, 2, window=8, sink_frames=2, length=12, source="tests"),  # for tests
)}
ALIASES = {"causal-forcing": "self-forcing"}  # Causal-Forcing runs Self-Forcing's causal Wan 2.1 1.3B
PAPER_PRESETS = ("lingbot-world-v2", "matrix-game-2", "hy-world-1.5", "longcat-video", "self-forcing")


def get_preset(name: str) -> Preset:
    """The preset called `name` (or an alias of one)."""
    name = ALIASES.get(name, name)
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join([*PRESETS, *ALIASES])}")
    return PRESETS[name]


def window_chunks(p: Preset) -> tuple[int, int | None, str]:
    """(sink_chunks, max_chunks, note) of a preset's window, by the rule a loaded model's takes too
    (`cache_types.frame_window`, which FastVideoModel.cache_config calls)."""
    if p.sink_frames is None:
        return 1, None, "no window"
    sink, most, rounded = frame_window(p.window, p.sink_frames, p.chunk_frames)
    if p.window is None:
        return sink, None, f"no window (all frames held), sink {p.sink_frames} frame(s)"
    note = f"window {p.window} latent frames with sink {p.sink_frames}: at most {most} committed chunk(s) + the current"
    if rounded:
        note += (f" (rounded up to whole {p.chunk_frames}-frame chunks: sink {sink * p.chunk_frames}, "
                 f"{(most + 1) * p.chunk_frames} frames held)")
    return sink, most, note


QUERY_STREAMS = ("drift", "none")


def drifting_queries(g: torch.Generator, basis: torch.Tensor, n: int, drift: float = 0.35) -> tuple[torch.Tensor, torch.Tensor]:
    """n queries per head in the span of `basis` (H, D, R) plus 10% isotropic noise, and the next chunk's
    basis: re-orthonormalised after a random step of relative size `drift`."""
    H, D, R = basis.shape
    q = torch.bmm(torch.randn(H, n, R, generator=g) * 3, basis.transpose(1, 2)) + 0.3 * torch.randn(H, n, D, generator=g)
    nxt = torch.linalg.qr(basis + drift * torch.randn(H, D, R, generator=g) / R ** 0.5)[0]
    return q, nxt


def memory_report(preset: str, latent_frames: int | None, method: str, target: str = "kv", bits: int = 2,
                  sample_layers: int | None = None, seed: int = 0, progress: Callable | None = None,
                  span_chunks: int = 1, queries: str = "drift", budget: tuple = (None, None),
                  recent_chunks: int | None = None) -> dict:
    """Bytes per stored component, bits per element and compression for `method` at a preset's shapes and window;
    `latent_frames` None: the preset's `length`; `recent_chunks` None: the preset's recent frames in chunks (else
    one); `budget` (Keys, Values): the method configures itself within it (ValueError when it cannot)."""
    if queries not in QUERY_STREAMS:
        raise ValueError(f"unknown query stream {queries!r}; known: {', '.join(QUERY_STREAMS)}")
    p = get_preset(preset)
    if latent_frames is None:
        if p.length is None:
            raise ValueError(f"preset {p.name!r} has no default length: give latent_frames")
        latent_frames = p.length
    if latent_frames < 1:
        raise ValueError(f"latent_frames must be >= 1, got {latent_frames}")
    n_layers = p.layers if sample_layers is None else min(max(1, sample_layers), p.layers)
    sink_chunks, max_chunks, window = window_chunks(p)
    if recent_chunks is None:
        recent_chunks = math.ceil(p.recent_frames / p.chunk_frames) if p.recent_frames is not None else 1
    config = CacheConfig(method=method, target=target, k_bits=bits, v_bits=bits, seed=seed, span_chunks=span_chunks,
                         budget_k=budget[0], budget_v=budget[1], sink_chunks=sink_chunks, max_chunks=max_chunks,
                         recent_chunks=recent_chunks)
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
    frame_bytes = 2 * p.layers * p.tokens_per_frame * p.heads * p.head_dim * 2  # K and V of one latent frame, BF16
    held = held_frames(p, latent_frames, sink_chunks, max_chunks)
    bf16 = held * frame_bytes  # what the cache holds, in BF16
    if run_frames == latent_frames:
        comp = {k: int(round(v * factor)) for k, v in cache.bytes_by_component().items()}
    else:  # nothing of the requested video is quantized: every chunk is BF16
        comp = {"k.full": bf16 // 2, "v.full": bf16 // 2}
    total = sum(comp.values())  # full-precision chunks are BF16 here: what is stored is what BF16 holds
    mem = CacheMemory(stored_bytes=total, bf16_bytes=bf16, by_component=comp, bits_per_element=cache.bits_per_element(),
                      cache_bits_per_element=8 * total / (bf16 / 2), runtime_bytes=runtime, cache_bytes=total)
    return {"preset": p.__dict__, "method": method, "target": target, "bits": bits, "latent_frames": latent_frames,
            "span_chunks": span_chunks, "queries": queries, "grid": cache.configuration["k" if cache.quantize_k else "v"],
            "runtime_bytes": runtime, "source": p.source, "window": window, "held_frames": held,
            "sink_chunks": sink_chunks, "max_chunks": max_chunks, "recent_chunks": recent_chunks,
            "budget": {"k": budget[0], "v": budget[1]}, "configuration": cache.configuration,
            "quantized_figures_from_latent_frames": run_frames,
            "chunks": chunks, "layers_quantized": n_layers, "bytes": comp,
            "total_bytes": total, "bf16_bytes": bf16, "bits_per_element": mem.span_bits_per_element,
            "compression": mem.span_compression, "cache_compression": mem.cache_compression,
            "memory": mem.to_dict(), "summary": mem.summary(), "bf16_bytes_per_latent_frame": frame_bytes}


def held_frames(p: Preset, latent_frames: int, sink_chunks: int, max_chunks: int | None) -> int:
    """Latent frames the cache holds after `latent_frames`: the sink chunks, the most recent committed chunks the
    window leaves room for, and the current chunk (the cache evicts the oldest non-sink chunk first)."""
    sizes = [p.chunk_frames] * (latent_frames // p.chunk_frames) + ([latent_frames % p.chunk_frames] if
                                                                    latent_frames % p.chunk_frames else [])
    committed, current = sizes[:-1], sizes[-1]
    if max_chunks is None or len(committed) <= max_chunks:
        return latent_frames
    rest = committed[sink_chunks:]
    return sum(committed[:sink_chunks]) + sum(rest[len(rest) - (max_chunks - sink_chunks):]) + current


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
