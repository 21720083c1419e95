"""Print figures (matplotlib): every figure the app draws, saved as PNG, PDF or SVG for a paper.

The drawing functions take the same plain values the app's plotly figures take (lists, numpy arrays, dicts
from a run's views) and return a `matplotlib.figure.Figure` (no pyplot: safe in the app's threads).
`quantwm.drivers.run_figures` writes these kinds of one run:

* "frames":  the per-frame panels: flicker tdiff-L1, motion-compensated warping error, PSNR vs BF16 (frames
             identical to BF16 marked, not drawn at a cap), top-1 shift rate
* "maps":    one frame: BF16, the method, and the flicker, warping-error and top-1 jump maps
* "trace":   one pixel's Query: attention logits over the cache with exact and stored keys, and the
             difference, top-1 sources marked
* "energy":  the history-Query eigen spectrum and cumulative energy per head of one layer
* "methods": the method comparison on the run's world (PSNR, shift rate, flicker, bits per element)

`error_over_time_figure` draws a long rollout's windowed curves (`quantwm eval --window N --figure STEM`);
`layer_sensitivity_figure` the layer-sensitivity table of each method (`quantwm eval --layer-sensitivity --figure`).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

FORMATS = ("png", "pdf", "svg")
FIGURE_KINDS = ("frames", "maps", "trace", "energy", "methods")
_COLORS = {"tdiff": "#d62728", "warp_error": "#ff7f0e", "psnr": "#1f77b4", "shift_rate": "#9467bd"}
_TITLES = {"tdiff": "flicker tdiff-L1", "warp_error": "warping error", "psnr": "PSNR vs BF16 (dB)",
           "shift_rate": "top-1 shift rate"}


def _figure(width: float, height: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _values(ys: list) -> tuple[list[int], list[float]]:
    pts = [(t, float(y)) for t, y in enumerate(ys) if y is not None and np.isfinite(y)]
    return [t for t, _ in pts], [y for _, y in pts]


def frame_series_figure(series: dict, worst: list[int], context_frames: int, title: str = ""):
    """Stacked per-frame panels; worst-flicker frames marked with x, the context shaded."""
    names = [n for n in ("tdiff", "warp_error", "psnr", "shift_rate") if n in series]
    fig = _figure(6.4, 1.5 * len(names) + 0.6)
    axes = fig.subplots(len(names), 1, sharex=True)
    n = len(series["tdiff"])
    for ax, name in zip(np.atleast_1d(axes), names):
        xs, ys = _values(series[name])
        ax.plot(xs, ys, "o-", ms=3, lw=1.2, color=_COLORS[name])
        wx = [t for t in worst if t in xs]
        ax.plot(wx, [ys[xs.index(t)] for t in wx], "x", ms=8, mew=2, color="black",
                label="worst flicker frames" if name == names[0] else None)
        ax.axvspan(-0.5, context_frames - 0.5, color="grey", alpha=0.15, lw=0)
        if name == "psnr" and series.get("identical"):
            same = [t for t, v in enumerate(series["identical"]) if v and t >= context_frames]
            if same and ys:
                ax.plot(same, [max(ys)] * len(same), "s", mfc="none", color="grey", label="identical to BF16")
                ax.legend(loc="lower left", fontsize=7, frameon=False)
        ax.set_ylabel(_TITLES[name], fontsize=8)
        ax.grid(alpha=0.3)
    axes = np.atleast_1d(axes)
    axes[0].text(context_frames / 2 - 0.5, 1.0, "context", transform=axes[0].get_xaxis_transform(),
                 ha="center", va="bottom", fontsize=7, color="grey")
    if worst:
        axes[0].legend(loc="upper right", fontsize=7, frameon=False)
    axes[-1].set_xlabel("frame")
    axes[-1].set_xlim(-0.5, n - 0.5)
    if title:
        fig.suptitle(title, fontsize=9)
    return fig


def maps_figure(view: dict, title: str = ""):
    """One frame (`RunView.frame_view`): BF16, method, flicker, warping-error and top-1 jump maps."""
    panels = [("BF16", view["bf16"], None), ("method", view["method"], None),
              ("flicker |Δx − Δr|", view["flicker"], "Reds"), ("warping error above BF16's", view["warp"], "Oranges")]
    if view.get("jumps") is not None:
        panels.append(("top-1 jumps (share of layers·heads)", view["jumps"], "Blues"))
    fig = _figure(2.0 * len(panels), 2.4)
    for ax, (name, img, cmap) in zip(np.atleast_1d(fig.subplots(1, len(panels))), panels):
        if cmap is None:
            ax.imshow(img, interpolation="nearest")
        else:
            lim = float(np.abs(img).max()) or 1.0  # every map here is >= 0 (the warping error's floor is BF16)
            im = ax.imshow(img, cmap=cmap, vmin=0.0, vmax=lim if cmap != "Blues" else 1.0, interpolation="nearest")
            fig.colorbar(im, ax=ax, shrink=0.7)
        ax.set_title(name, fontsize=8)
        ax.set_xticks([]), ax.set_yticks([])
    fig.suptitle(title or f"frame {view['frame']}", fontsize=9)
    return fig


def logit_heatmaps_figure(exact: np.ndarray, stored: np.ndarray, src_exact: tuple, src_stored: tuple,
                          method: str, grid_width: int, title: str = ""):
    """Logits (cached frames x positions) with exact keys, stored keys and their difference; top-1 marked."""
    diff = stored - exact
    lim = float(np.abs(diff).max()) or 1.0
    lo, hi = float(min(exact.min(), stored.min())), float(max(exact.max(), stored.max()))
    fig = _figure(10, 3.0)
    axes = fig.subplots(1, 3, sharey=True)
    for ax, (name, z, kw) in zip(axes, (("BF16 keys", exact, dict(cmap="viridis", vmin=lo, vmax=hi)),
                                        (f"{method} keys", stored, dict(cmap="viridis", vmin=lo, vmax=hi)),
                                        (f"{method} − BF16", diff, dict(cmap="RdBu_r", vmin=-lim, vmax=lim)))):
        im = ax.imshow(z, aspect="auto", interpolation="nearest", origin="lower", **kw)
        fig.colorbar(im, ax=ax, shrink=0.8)
        for (f, r, c), marker, color, label in ((src_exact, "o", "white", "BF16 top-1"),
                                                (src_stored, "x", "red", f"{method} top-1")):
            ax.plot([r * grid_width + c], [f], marker, mfc="none", ms=10, mew=2, color=color, label=label)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("position (row·w + col)", fontsize=8)
    axes[0].set_ylabel("cached frame", fontsize=8)
    axes[0].legend(loc="upper right", fontsize=7, framealpha=0.6)
    if title:
        fig.suptitle(title, fontsize=9)
    return fig


def energy_figure(spectra: list[dict], layer: int, rank: int = 8, title: str = ""):
    """One layer's eigenvalues of S (log) and cumulative energy per head, the top-`rank` cut marked."""
    s = spectra[layer]
    ev, cum, top = s["eigenvalues"], s["cumulative"], s["top_fraction"]
    fig = _figure(8, 3.0)
    a, b = fig.subplots(1, 2)
    idx = np.arange(1, ev.shape[1] + 1)
    for h in range(ev.shape[0]):
        a.semilogy(idx, np.maximum(ev[h], 1e-12), lw=1.2, label=f"head {h}")
        b.plot(idx, cum[h], lw=1.2, label=f"head {h}: top-{rank} {top[h]:.1%}")
    for ax in (a, b):
        ax.axvline(rank, ls="--", color="black", lw=0.8)
        ax.set_xlabel("eigen-direction (descending)", fontsize=8)
        ax.grid(alpha=0.3)
    a.set_title(f"layer {layer}: eigenvalues of S = E[q qᵀ]", fontsize=9)
    b.set_title("cumulative energy", fontsize=9)
    b.set_ylim(0, 1.02)
    b.legend(fontsize=7, frameon=False)
    if title:
        fig.suptitle(title, fontsize=9)
    return fig


def bars_figure(rows: list[dict], label: str, metrics: list[str], title: str = "", reference: dict | None = None):
    """Grouped bars, one panel per metric, one bar per row (methods, or Keys-only vs Values-only); `reference`:
    {metric: (name, value)} drawn as a dashed line on that metric's panel (BF16's score)."""
    fig = _figure(2.4 * len(metrics), 2.8)
    names = [str(r[label]) for r in rows]
    for ax, m in zip(np.atleast_1d(fig.subplots(1, len(metrics))), metrics):
        vals = [float(r[m]) if r.get(m) is not None else np.nan for r in rows]
        ax.bar(range(len(rows)), vals, color="#4c72b0")
        if m in (reference or {}):
            name, value = reference[m]
            ax.axhline(value, color="k", ls="--", lw=0.8, label=f"{name} {value:.4f}")
            ax.legend(fontsize=7, loc="lower center", framealpha=0.9)
        ax.set_xticks(range(len(rows)), names, rotation=45, ha="right", fontsize=7)
        ax.set_title(m, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=9)
    return fig


def error_over_time_figure(methods: dict, threshold_db: float | None = None, title: str = ""):
    """A long rollout's error over time (`world.long_rollout`'s report["methods"]): PSNR against BF16, place shift
    and flicker per window of frames, one line per method; each method's first frame under `threshold_db` marked."""
    panels = (("psnr", "PSNR vs BF16 (dB)"), ("place_shift_rate", "place shift rate"), ("tdiff", "flicker tdiff-L1"))
    fig = _figure(6.4, 5.2)
    axes = fig.subplots(len(panels), 1, sharex=True)
    for i, (m, e) in enumerate(methods.items()):
        color = f"C{i}"
        xs = e["windowed"]["frames"]
        for ax, (key, _) in zip(axes, panels):
            ax.plot(xs, e["windowed"][key], "o-", ms=3, lw=1.2, color=color, label=m if key == "psnr" else None)
        first = e.get("first_frame_below_threshold")
        if first is not None:
            axes[0].axvline(first, color=color, lw=0.8, ls=":")
    if threshold_db is not None:
        axes[0].axhline(threshold_db, color="grey", lw=0.8, ls="--", label=f"{threshold_db:g} dB")
    for ax, (_, label) in zip(axes, panels):
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, frameon=False, ncol=5, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    axes[-1].set_xlabel("frame (first frame of each window; dotted: first frame under the threshold)")
    if title:
        fig.suptitle(title, fontsize=9)
    return fig


def layer_sensitivity_figure(reports: dict, title: str = ""):
    """Per method (`world.sensitivity.layer_sensitivity` reports by method), one row: PSNR against BF16 with one
    layer quantized and with one layer kept BF16 (the all-quantized run as a line), then per (layer, head) the
    Keys' and the Values' mean code bits per channel the method gave it (coloured on 0-8 bits) and the place shift
    rate it had in the all-quantized run (on one scale for every method), as annotated heatmaps ("one width" where
    the method's grid is one for every channel). A
    report without `rows` (a run file's `head_table` alone) leaves the first panel saying so.
    """
    fig = _figure(11.0, 2.3 * len(reports) + 0.5)
    axes = np.atleast_2d(fig.subplots(len(reports), 4))
    shift_top = max([v for r in reports.values() for a in r["allocation"] for v in a["place_shift_rate"]] + [1e-3])
    for n, (row, (m, r)) in enumerate(zip(axes, reports.items())):
        ax = row[0]
        if not r.get("rows"):
            ax.text(0.5, 0.5, "no layer sensitivity recorded", ha="center", va="center", fontsize=8,
                    transform=ax.transAxes)
            ax.set_xticks([]), ax.set_yticks([]), ax.set_ylabel(m, fontsize=8)
        rows = {mode: [x for x in r.get("rows") or [] if x["mode"] == mode] for mode in ("only", "all_but")}
        layers = [x["layer"] for x in rows["only"]]
        for i, (mode, label) in enumerate((("only", "only this layer quantized"), ("all_but", "this layer kept BF16"))):
            ax.bar(np.array(layers) + (i - 0.5) * 0.38, [x["psnr"] for x in rows[mode]], 0.38, label=label,
                   color=("#4c72b0", "#dd8452")[i])
        if layers:
            ax.axhline(r["all"]["psnr"], color="black", lw=0.9, ls="--", label="every layer quantized")
            ax.set_ylim(min(x["psnr"] for x in r["rows"] + [r["all"]]) - 3, 100)
            ax.set_xticks(layers, [str(x) for x in layers])
            ax.set_xlabel("layer", fontsize=8)
            ax.set_ylabel(f"{m}\nPSNR vs BF16 (dB)", fontsize=8)
            ax.grid(axis="y", alpha=0.3)
            if n == 0:
                ax.legend(fontsize=6, frameon=False, loc="lower center", bbox_to_anchor=(0.5, 1.0))
        grids = [(a["k_bits"]["mean"] if a["k_bits"] else None) for a in r["allocation"]], \
                [(a["v_bits"]["mean"] if a["v_bits"] else None) for a in r["allocation"]], \
                [a["place_shift_rate"] for a in r["allocation"]]
        scales = ((0, 8), (0, 8), (0, shift_top))  # bits on the allocator's 0-8 range; shift shared by every method
        for ax, grid, name, fmt, (lo, hi) in zip(row[1:], grids, ("Keys: code bits / channel",
                                                                  "Values: code bits / channel", "place shift rate"),
                                                 ("{:.2f}", "{:.2f}", "{:.3f}"), scales):
            ax.set_title(name, fontsize=8)
            if any(g is None for g in grid):
                ax.text(0.5, 0.5, "one width for every channel", ha="center", va="center", fontsize=8,
                        transform=ax.transAxes)
                ax.set_xticks([]), ax.set_yticks([])
                continue
            a = np.array(grid, dtype=float)  # (layers, heads)
            ax.imshow(a, cmap="viridis", aspect="auto", vmin=lo, vmax=hi)
            for (li, h), v in np.ndenumerate(a):
                ax.text(h, li, fmt.format(v), ha="center", va="center", fontsize=6,
                        color="white" if v < (lo + hi) / 2 else "black")
            ax.set_xticks(range(a.shape[1])), ax.set_yticks(range(a.shape[0]))
            ax.set_xlabel("head", fontsize=8), ax.set_ylabel("layer", fontsize=8)
            ax.tick_params(labelsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    return fig


def check_formats(formats: list[str]) -> None:
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        raise ValueError(f"unknown figure format {(bad or ['(none)'])[0]!r}; choose from {', '.join(FORMATS)}")


def save_figure(fig, stem: str | Path, formats: list[str]) -> list[Path]:
    """Write `fig` as stem.<format> for each format; returns the paths."""
    check_formats(formats)
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    for f in formats:
        path = stem.with_name(f"{stem.name}.{f}")
        fig.savefig(path, format=f, dpi=200, metadata={"Creator": "quantwm"} if f != "png" else None)
        paths.append(path)
    return paths
