"""A run at a glance, for long runs (issue 35, part 4): the error-over-time strip and the (layer, head) table.

`overview(view)` gathers, from any `views.RunView`, the per-frame curves (PSNR against BF16, flicker, top-1 shift;
for a long run file, `quantwm record --window`, also the place shift and the revisit consistency of its `long`
metadata), the per-(layer, head) table the file holds (`head_table`: bits the cache gave each head, its shift) with
the layer sensitivity beside it when recorded, as plain values. `overview_strip` draws the curves over one row of
thumbnails as one RGB image whose columns map linearly onto frames (`strip_frame`: the frame under a column), so a
click anywhere on it names a frame. `table_rows` lays the table out one row per (layer, head).
"""
from __future__ import annotations

import math

import numpy as np

STRIP_WIDTH = 1024  # pixels; frame t covers columns [t W / T, (t + 1) W / T)
PANEL_HEIGHT = 56
THUMB = 48  # thumbnail row height and each thumbnail's width
PANELS = (("psnr", "PSNR vs BF16 (dB)", "#1f77b4"), ("tdiff", "flicker tdiff-L1", "#d62728"),
          ("place_shift_rate", "place shift", "#2ca02c"), ("shift_rate", "top-1 shift", "#9467bd"),
          ("revisit_psnr", "revisit PSNR (dB; grey: BF16's)", "#8c564b"))


def overview(view) -> dict:
    """{frames, context_frames, curves: {name: [per output frame, None where none]}, window, long_summary,
    head_table, layer_sensitivity} of a run (`views.RunView`)."""
    T = view.run.bf16.shape[0]
    ctx = view.context_frames
    series = view.compare()["series"]
    curves = {k: list(series[k]) for k in ("psnr", "tdiff", "shift_rate") if k in series}
    meta = view.run.meta
    long = meta.get("long") if isinstance(meta.get("long"), dict) else None
    if long:
        for k in ("place_shift_rate", "revisit_psnr", "bf16_revisit_psnr"):
            v = long["curves"].get(k)
            if v is not None and len(v) == T - ctx:
                curves[k] = [None] * ctx + [None if x is None or x != x else x for x in v]
    return {"frames": T, "context_frames": ctx, "curves": curves,
            "window": long and {"window": long["window"], "sink_chunks": long["sink_chunks"]},
            "long_summary": long and {k: long[k] for k in ("first_frame_below_threshold", "threshold_db", "drift")
                                      if k in long},
            "head_table": meta.get("head_table"), "layer_sensitivity": meta.get("layer_sensitivity"),
            "cache_map": meta.get("cache_map") if isinstance(meta.get("cache_map"), list) else None}


CACHE_COLOURS = {"current": (20, 20, 20), "bf16": (31, 119, 180), "quantized": (255, 127, 14),
                 "unread": (225, 225, 225)}
MARK_COLOURS = {"memory": (44, 160, 44), "conditioning": (148, 103, 189)}
BAND = 14  # pixels: the cache band's height (a 4-pixel mark on top for memory / conditioning frames)


def cache_entry(cache_map: list[dict], latent_frame: int) -> dict | None:
    """The cache map's entry of the chunk that generated `latent_frame` (the last chunk's when none did, e.g. a
    conditioning frame)."""
    for entry in cache_map:
        if latent_frame in entry["frames"]:
            return entry
    return cache_map[-1] if cache_map else None


def cache_band(entry: dict, latent_of: list[int], width: int = STRIP_WIDTH) -> np.ndarray:
    """(BAND, width, 3) uint8: for each output frame (columns as the strip's), how the chunk of `entry` read it:
    black, the chunk itself; blue, a BF16 frame; orange, a quantized one; light grey, not read (evicted, not yet
    made, or left out by a memory); a green mark on top, a retrieved memory frame; purple, a conditioning frame."""
    T = len(latent_of)
    read = entry["read"]
    band = np.zeros((BAND, width, 3), np.uint8)
    for t, f in enumerate(latent_of):
        lo, hi = t * width // T, max(t * width // T + 1, (t + 1) * width // T)
        role = ("current" if f in entry["frames"] else "quantized" if f in read.get("quantized", ())
                else "bf16" if f in read.get("bf16", ()) else "unread")
        band[:, lo:hi] = CACHE_COLOURS[role]
        for mark, colour in MARK_COLOURS.items():
            if f in read.get(mark, ()):
                band[:4, lo:hi] = colour
        band[:, lo] = 255  # a thin rule between frames
    return band


def describe_cache(entry: dict) -> str:
    """One sentence: which latent frames the chunk of `entry` read and how they were held."""
    read = entry["read"]
    parts = [f"{name} {_ranges(read[key])}" for key, name in (("bf16", "BF16"), ("quantized", "quantized"))
             if read.get(key)]
    for key in MARK_COLOURS:
        if read.get(key):
            parts.append(f"{key} frames {_ranges(read[key])}")
    frames = entry["frames"]
    return (f"Cache: chunk {entry['chunk']} (latent frames {_ranges(frames)}) read "
            + ("; ".join(parts) if parts else "no earlier frame")
            + " (band: black the chunk, blue BF16, orange quantized, grey not read; green mark memory, purple "
              "conditioning).")


def _ranges(xs) -> str:
    xs = sorted(set(xs))
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ", ".join(out)


def strip_frame(x: float, frames: int, width: int = STRIP_WIDTH) -> int:
    """The frame under column `x` of a strip `width` pixels wide over `frames` frames; ValueError outside it."""
    if not 0 <= x < width:
        raise ValueError(f"x {x} lies outside the strip (0..{width - 1})")
    if frames < 1:
        raise ValueError(f"a strip needs at least one frame, got {frames}")
    return min(frames - 1, int(x * frames / width))


def overview_strip(curves: dict, thumbs: np.ndarray, context_frames: int = 0, current: int | None = None,
                   width: int = STRIP_WIDTH) -> np.ndarray:
    """(H, width, 3) uint8: one panel per curve of `PANELS` present (frame t's value drawn across its columns; the
    context shaded; `current` marked by a black line), then a row of thumbnails from `thumbs` (T, h, w, 3) uint8,
    each the frame under its middle column."""
    from matplotlib.figure import Figure

    T = len(thumbs)
    panels = [p for p in PANELS if p[0] in curves and any(v is not None for v in curves[p[0]])]
    height = PANEL_HEIGHT * len(panels)
    fig = Figure(figsize=(width / 100, max(height, 1) / 100), dpi=100)
    xs = np.arange(T) + 0.5
    for i, (name, label, color) in enumerate(panels):
        ax = fig.add_axes((0, 1 - (i + 1) / len(panels), 1, 1 / len(panels)))  # no margins: x maps onto columns
        ys = np.array([np.nan if v is None else float(v) for v in curves[name]])
        ax.plot(xs, ys, lw=0.9, color=color)
        if name == "revisit_psnr" and "bf16_revisit_psnr" in curves:
            ax.plot(xs, [np.nan if v is None else float(v) for v in curves["bf16_revisit_psnr"]], lw=0.7, color="grey")
        ax.set_xlim(0, T)
        finite = ys[np.isfinite(ys)]
        if len(finite):
            lo, hi = float(finite.min()), float(finite.max())
            pad = (hi - lo) * 0.1 or max(abs(hi) * 0.1, 1e-6)
            ax.set_ylim(lo - pad, hi + pad)
            ax.text(0.002, 0.95, f"{label}: {lo:.3g} .. {hi:.3g}", transform=ax.transAxes, fontsize=7, va="top",
                    bbox=dict(facecolor="white", alpha=0.7, lw=0, pad=1))
        ax.axvspan(0, context_frames, color="grey", alpha=0.2, lw=0)
        if current is not None:
            ax.axvline(current + 0.5, color="black", lw=1)
        ax.set_xticks([]), ax.set_yticks([])
        for side in ax.spines.values():
            side.set_linewidth(0.4)
    curve_img = _render(fig, width, height) if panels else np.zeros((0, width, 3), np.uint8)
    n = max(1, width // THUMB)
    row = np.zeros((THUMB, width, 3), np.uint8)
    for i in range(n):
        lo, hi = i * width // n, (i + 1) * width // n
        t = strip_frame((lo + hi) / 2, T, width)
        row[:, lo:hi] = _resize(thumbs[t], THUMB, hi - lo)
        row[:, lo] = 255  # a thin white rule between thumbnails
    if current is not None:
        c = min(width - 1, int((current + 0.5) * width / T))
        row[:, max(0, c - 1):c + 1] = (255, 215, 0)
    return np.concatenate([curve_img, row])


def _render(fig, width: int, height: int) -> np.ndarray:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    img = np.asarray(canvas.buffer_rgba())[..., :3]
    return np.ascontiguousarray(img[:height, :width])


def _resize(img: np.ndarray, h: int, w: int) -> np.ndarray:
    """Nearest-neighbour resize of (H, W, 3) to (h, w, 3)."""
    rows = np.arange(h) * img.shape[0] // h
    cols = np.arange(w) * img.shape[1] // w
    return img[rows][:, cols]


def table_rows(head_table: list, sensitivity: dict | None = None) -> tuple[list[str], list[list]]:
    """(header, rows): one row per (layer, head) with the Keys' and Values' mean code bits per channel
    [narrowest-widest], the head's top-1 and place shift, and its layer's PSNR against BF16 quantized alone and
    kept BF16 alone (from `sensitivity`, `world.sensitivity.layer_sensitivity`'s report, when recorded)."""
    by = {}
    if sensitivity:
        for r in sensitivity["rows"]:
            by[(r["mode"], r["layer"])] = r["psnr"]
    header = ["layer", "head", "Keys bits", "Values bits", "top-1 shift", "place shift"]
    if sensitivity:
        header += ["PSNR, only this layer quantized", "PSNR, this layer kept BF16"]

    def bits(w, h):
        return "one width" if w is None else f"{w['mean'][h]:.2f} [{w['min'][h]:.1f}-{w['max'][h]:.1f}]"
    rows = []
    for layer in head_table:
        for h in range(len(layer["shift_rate"])):
            row = [layer["layer"], h, bits(layer["k_bits"], h), bits(layer["v_bits"], h),
                   round(layer["shift_rate"][h], 4), round(layer["place_shift_rate"][h], 4)]
            if sensitivity:
                row += [_round(by.get(("only", layer["layer"]))), _round(by.get(("all_but", layer["layer"])))]
            rows.append(row)
    return header, rows


def _round(v):
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else round(v, 2)
