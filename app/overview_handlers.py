"""Handlers of the long-run overview (app/overview_panel.py): the error-over-time strip of the run shown, a click
on it as a frame, and its (layer, head) table with heatmaps. Plain values in, plain values out; the drawing and
the numbers come from quantwm.drivers.overview."""
from __future__ import annotations

import numpy as np

from quantwm.drivers.overview import cache_band, cache_entry, describe_cache, overview, overview_strip, strip_frame, table_rows
from quantwm.evaluation.figures import layer_sensitivity_figure

from .world_handlers import error


def _describe(ov: dict) -> str:
    text = f"{ov['frames']} frames ({ov['context_frames']} context)"
    if ov["window"]:
        w = ov["window"]
        text += f", through a rolling window of {w['window']} chunk(s) after {w['sink_chunks']} sink chunk(s)"
    s = ov["long_summary"]
    if s:
        first = s.get("first_frame_below_threshold")
        text += (f"; first frame under {s['threshold_db']:g} dB against BF16: "
                 f"{first if first is not None else 'none'}")
        mse = s.get("drift", {}).get("mse")
        if mse:
            text += (f"; MSE against BF16 per 100 frames {mse['slope_per_100_frames']:+.2e} (first quarter "
                     f"{mse['first_quarter']:.2e}, last {mse['last_quarter']:.2e})")
    return text + ". Click the strip to jump the player to a frame."


def overview_handler(runs, run_id, frame=None) -> dict:
    """{status, strip (H, W, 3) uint8, frames, header, rows, heatmap (a matplotlib figure, or None)} of the run
    shown; `frame` (the player's) marked on the strip."""
    try:
        view = runs.view(run_id)
        ov = overview(view)
        current = None if frame is None else view.check_frame(int(frame))
    except (ValueError, TypeError) as e:
        return error(str(e))
    strip = overview_strip(ov["curves"], view.run.method.numpy(), ov["context_frames"], current)
    status = _describe(ov)
    if ov["cache_map"]:  # a FastVideo run: how the current frame's chunk read the cache, as a band under the strip
        facts = view.run.facts
        entry = cache_entry(ov["cache_map"], facts.latent_frame(ov["frames"] - 1 if current is None else current))
        if entry is not None:
            strip = np.concatenate([strip, cache_band(entry, [facts.latent_frame(t) for t in range(ov["frames"])],
                                                      strip.shape[1])])
            status += " " + describe_cache(entry)
    out = {"status": status, "strip": strip, "frames": ov["frames"]}
    if ov["head_table"]:
        ls = ov["layer_sensitivity"]
        out["header"], out["rows"] = table_rows(ov["head_table"], ls)
        report = {"rows": ls["rows"], "all": ls["all"]} if ls else {}
        out["heatmap"] = layer_sensitivity_figure({view.run.meta["method"]: {**report, "allocation": ov["head_table"]}})
    else:
        out["status"] += (" No per-(layer, head) table in this run." if ov["cache_map"] else
                          " No per-(layer, head) table in this run: `quantwm record --window N` writes one "
                          "(and the layer sensitivity with --sensitivity-frames).")
        out["header"], out["rows"] = ["layer", "head"], []
    return out


def strip_click_handler(runs, run_id, x) -> dict:
    """{frame, status}: the frame under column `x` of the run's strip (what a click on it selects)."""
    try:
        view = runs.view(run_id)
        return {"frame": strip_frame(float(x), view.run.bf16.shape[0]), "status": None}
    except (ValueError, TypeError) as e:
        return error(str(e))
