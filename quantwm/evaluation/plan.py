"""`quantwm plan`: the bits per element a rollout (or a rolling window) needs to fit a memory limit, what a
frame costs and how many frames fit at each budget, beside the quality the frontier measured at that budget.

The arithmetic is the cache's own rules (quantwm.core.cache), with Keys and Values both quantized: the first
`sink_chunks` chunks, the `recent_chunks` most recent committed chunks and the current chunk stay BF16 (2 bytes
per element); every other chunk the cache holds is quantized, and a method at budget B stores at most B bits per
element there (B counts stored bytes, codes and every piece of metadata: `CacheMemory.span_bits_per_element`).
A rolling window of `window` chunks (`CacheConfig(max_chunks=sink_chunks + window)`, whole-chunk eviction) holds
at most that many committed chunks plus the current one, however long the rollout; without one the cache holds
the whole rollout. The figures are the cache's peak, summed over every layer:

    bytes(B) = full_chunks x chunk_bf16_bytes + quantized_chunks x chunk_elements x B / 8

so `bits_needed` = 8 (limit - full bytes) / quantized elements. Frames are latent frames; `video_frames` maps
them to the decoded video (every preset's VAE is Wan 2.1's: 4 video frames per latent frame after the first,
81 video frames = 21 latent frames). The quality figures come from a frontier file's `envelope`
(docs/frontier/world.json: the built-in model, held-out photographs, 16 frames; a small model, not the preset's:
they rank methods at a budget, they do not predict the preset's own quality).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from .memory import PRESETS, Preset

VIDEO_PER_LATENT = 4  # Wan 2.1's VAE: 4 video frames per latent frame after the first
BUDGETS = (16.0, 4.0, 3.5, 3.0, 2.75, 2.5, 2.25)  # rows of the table: BF16, then the frontier's envelope budgets
FRONTIER = Path(__file__).resolve().parents[2] / "docs" / "frontier" / "world.json"
QUALITY = ("psnr", "place_shift_rate")  # what the plan quotes from the envelope (PSNR vs BF16: higher is better)


def latent_frames(video_frames: int) -> int:
    """Decoded video frames -> latent frames (81 -> 21)."""
    if video_frames < 1:
        raise ValueError(f"frames must be >= 1, got {video_frames}")
    return 1 + -(-(video_frames - 1) // VIDEO_PER_LATENT)


def video_frames(latent: int) -> int:
    """Latent frames -> decoded video frames (21 -> 81)."""
    return 1 + VIDEO_PER_LATENT * (latent - 1) if latent > 0 else 0


@dataclass(frozen=True)
class Held:
    """What the cache holds at its peak: BF16 chunks, quantized chunks and the current chunk's frames."""

    full_chunks: int  # sink + recent committed chunks
    quantized_chunks: int
    current_frames: int  # the current (uncommitted) chunk's latent frames, BF16 too


def held(p: Preset, frames: int, window: int | None, sink: int, recent: int) -> Held:
    """The peak of a rollout of `frames` latent frames (`window`: committed chunks beyond the sink, or None)."""
    chunks = -(-frames // p.chunk_frames)
    committed, current = chunks - 1, frames - (chunks - 1) * p.chunk_frames
    if window is not None and committed > sink + window:  # full window plus a full current chunk
        committed, current = sink + window, p.chunk_frames
    full = min(sink, committed) + min(recent, max(committed - sink, 0))
    return Held(full, committed - full, current)


def frames_that_fit(p: Preset, limit: float, bits: float, window: int | None, sink: int, recent: int) -> float:
    """Most latent frames whose cache fits `limit` bytes at `bits` per quantized element (inf: a window that fits
    holds any length)."""
    chunk = chunk_bf16_bytes(p)
    full = sink + recent + 1  # the full-precision chunks of any rollout long enough to quantize
    if limit < full * chunk:  # nothing is quantized yet: full chunks only
        return float(int(limit // chunk) * p.chunk_frames)
    extra = int((limit - full * chunk) // (chunk * min(bits, 16) / 16))  # quantized chunks beside them
    if window is not None and full + extra >= sink + window + 1:
        return math.inf
    return float((full + extra) * p.chunk_frames)


def chunk_bf16_bytes(p: Preset) -> int:
    """K and V of one chunk over every layer at 2 bytes per element."""
    return 2 * 2 * p.layers * p.heads * p.head_dim * p.chunk_frames * p.tokens_per_frame


def peak_bytes(p: Preset, h: Held, bits: float) -> float:
    """`bytes(B)` of the module docstring: BF16 chunks plus quantized chunks at `bits` per element."""
    chunk, frame = chunk_bf16_bytes(p), chunk_bf16_bytes(p) // p.chunk_frames
    return h.full_chunks * chunk + h.current_frames * frame + h.quantized_chunks * chunk * min(bits, 16) / 16


def frontier_quality(path: Path | None, budget: float) -> dict | None:
    """quantwm's figures at `budget` in a frontier file's envelope and the best other method's, per metric in
    `QUALITY` ({"source", "budget", metric: {"quantwm", "other", "other_method"}}); None when the file or the
    budget is absent."""
    if path is None or not Path(path).is_file():
        return None
    data = json.loads(Path(path).read_text())
    source = "world" if "world" in data else next(iter(data))
    table = data[source]["envelope"].get(f"{budget:g}")
    if not table:
        return None
    shown = Path(path).resolve()
    shown = shown.relative_to(FRONTIER.parents[2]) if shown.is_relative_to(FRONTIER.parents[2]) else shown
    out = {"source": f"{shown} ({source}, envelope at {budget:g} bits)", "budget": budget}
    for metric in QUALITY:
        best = table.get(metric, {})
        others = {m: v["value"] for m, v in best.items() if m != "quantwm"}
        pick = max if metric == "psnr" else min
        other = pick(others, key=others.get) if others else None
        out[metric] = {"quantwm": best.get("quantwm", {}).get("value"), "other": others.get(other),
                       "other_method": other}
    return out


def plan(preset: Preset, frames: int, memory_gib: float, window: int | None = None, sink: int = 1, recent: int = 1,
         frontier: Path | None = FRONTIER) -> dict:
    """The planner's report for a rollout of `frames` latent frames within `memory_gib` GiB (see the module
    docstring): bits needed, bytes per frame, frames that fit at each budget and the frontier's quality there."""
    if frames < 1:
        raise ValueError(f"latent frames must be >= 1, got {frames}")
    if not memory_gib > 0:
        raise ValueError(f"memory limit must be a positive number of GiB, got {memory_gib}")
    if sink < 0 or recent < 0:
        raise ValueError("sink and recent chunks must be >= 0")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 chunk, got {window}")
    limit = memory_gib * 2 ** 30
    h = held(preset, frames, window, sink, recent)
    full = peak_bytes(preset, h, 0)
    q_elems = h.quantized_chunks * chunk_bf16_bytes(preset) / 2
    bf16 = peak_bytes(preset, h, 16)
    if bf16 <= limit:
        needed = 16.0
    elif full > limit or not q_elems:
        needed = None  # the full-precision chunks alone exceed the limit: no budget fits
    else:
        needed = 8 * (limit - full) / q_elems
    rows = []
    for b in BUDGETS:
        rows.append({"bits": b, "bytes_per_frame": chunk_bf16_bytes(preset) / preset.chunk_frames * b / 16,
                     "peak_bytes": peak_bytes(preset, h, b), "fits": peak_bytes(preset, h, b) <= limit,
                     "frames_that_fit": frames_that_fit(preset, limit, b, window, sink, recent),
                     "quality": frontier_quality(frontier, b) if b < 16 else None})
    chosen = next((r["bits"] for r in rows if r["fits"]), None)
    quality = frontier_quality(frontier, chosen) if chosen is not None and chosen < 16 else None
    return {"preset": preset.__dict__, "latent_frames": frames, "video_frames": video_frames(frames),
            "window": window, "sink_chunks": sink, "recent_chunks": recent, "memory_bytes": limit,
            "held": h.__dict__, "full_precision_bytes": full, "bf16_bytes": bf16, "quantized_elements": q_elems,
            "bits_needed": needed, "budget": chosen, "rows": rows, "quality": quality,
            "frontier": str(frontier) if frontier is not None else None}


def preset_with(name: str, **overrides) -> Preset:
    """A preset (`memory.PRESETS`) with some shapes replaced (None leaves one as it is)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(PRESETS)}")
    p = PRESETS[name]
    values = {**p.__dict__, **{k: v for k, v in overrides.items() if v is not None}}
    shapes = ("layers", "heads", "head_dim", "tokens_per_frame", "chunk_frames")
    bad = [k for k in shapes if not isinstance(values[k], int) or values[k] < 1]
    if bad:
        raise ValueError(f"{', '.join(bad)} must be positive integers")
    return Preset(**values)
