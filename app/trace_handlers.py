"""Handlers of the pixel trace on the Generate & play tab: a frame pixel's Query traced to its top-1 cached source
under BF16's keys and under the keys of each method shown (the run the maps are of, and the other method's run
beside it). Plain values in, a dict of plain values out, bad input an "**Error:** ..." status (app/world_handlers.py
re-exports these handlers with the tab's others)."""
from __future__ import annotations

from . import media, plots
from .values import choice, error, integer, shown_pair

THUMB = 3  # source thumbnails: 192 x 192 for the built-in 64 x 64 frames, each labelled with its frame


def trace_pixel_handler(runs, run_id, frame, x, y, layer="all", head="all", run_b=None, maps="A") -> dict:
    """Twin of the click: trace frame pixel (x, y) (0..63) of `frame` to its Query's top-1 cached source, in the
    layer and head of the page's one picker ("all": the first whose top-1 moved at this Query; the status and
    the result say which). The run traced is method A's `run_id` or, `maps` "B", method B's `run_b`; the other
    method's run, when one is shown, is traced at the same Query, layer and head and its source named too
    (the result's "other")."""
    try:
        for nm, val in (("frame", frame), ("x", x), ("y", y)):
            if val is None or val == "":
                raise ValueError(f"no {nm} given")
        t, px, py = (integer(v, n) for n, v in (("frame", frame), ("x", x), ("y", y)))
        run_id, other_id = shown_pair(run_id, run_b, maps)
        view, other = runs.pair(run_id, other_id)
        r = view.pixel_trace(t, px, py, choice(layer, "layer"), choice(head, "head"))
    except ValueError as e:
        return error(str(e))
    from quantwm.evaluation.diagnostics import trace_margins

    layer, head, method = r["layer"], r["head"], r["method"]
    (lat, row, col), eb, em = r["query"], r["source_bf16"], r["source_method"]
    mg = trace_margins(r["logits_bf16"], r["logits_method"], eb, r["grid"])
    picked = f"; {r['picked']}" if r["picked"] else ""
    status = (f"Query frame {lat}, row {row}, col {col} (layer {layer}, head {head}{picked}) — BF16 source: "
              f"{_at(eb)}; {method} source: {_at(em)} — "
              f"{'**jumped**: quantized keys fetch a different token' if r['jumped'] else 'same source: no jump'}.")
    margins = f"BF16 {mg['margin_bf16']:.3f}, {method} {mg['margin_method']:.3f}"
    ranks = f"{mg['bf16_source_rank']} under {method}'s keys"
    out = {"query_image": _thumb(r, r["query"], media.YELLOW, "query"),
           "bf16_source": _thumb(r, eb, media.YELLOW, "BF16"), "method_source": _thumb(r, em, media.RED, method),
           "figure": plots.logit_heatmaps_figure(r["logits_bf16"], r["logits_method"], eb, em, method, r["grid"][1]),
           "result": {"run": run_id, "frame": t, "pixel": [px, py], "query": list(r["query"]), "layer": int(layer),
                      "head": int(head), "source_bf16": list(eb), "source_method": list(em),
                      "jumped": bool(r["jumped"]), **mg}}
    if other is not None:
        name = other.run.meta["method"] + (" (the other run)" if other.run.meta["method"] == method else "")
        try:
            o = other.pixel_trace(t, px, py, layer, head)
        except ValueError as e:  # an opened run without logits of this layer and head
            status += f" {name}: no source at layer {layer}, head {head} ({e})."
        else:
            og = trace_margins(o["logits_bf16"], o["logits_method"], o["source_bf16"], o["grid"])
            own = o["source_bf16"]  # each run's cache holds its own frames: its BF16 keys' source may differ
            status += (f" {name} source: {_at(o['source_method'])}" + ("" if own == eb else
                       f" (under its own cache's BF16 keys: {_at(own)})") + " — "
                       f"{'**jumped**' if o['jumped'] else 'same source: no jump'}.")
            margins += f", {name} {og['margin_method']:.3f}"
            ranks += f", {og['bf16_source_rank']} under {name}'s"
            out["other_source"] = _thumb(o, o["source_method"], media.MAGENTA, name)
            out["result"]["other"] = {"run": other_id, "method": o["method"], "source": list(o["source_method"]),
                                      "source_bf16": list(own), "jumped": bool(o["jumped"]), "margin": og["margin_method"],
                                      "bf16_source_rank": og["bf16_source_rank"]}
    status += f" Logit margin (top-1 minus runner-up): {margins}; the BF16 source ranks {ranks}."
    return {"status": status, **out}


def _at(src) -> str:
    return f"frame {src[0]}, row {src[1]}, col {src[2]}"


def _thumb(r: dict, src, color, who: str):
    """The latent frame of `src` (frame, row, col), enlarged, its token boxed in `color`, labelled with whose it is."""
    f, row, col = src
    cell = r["frames"].shape[1] // r["grid"][0]
    return media.label(media.draw_box(media.enlarge(r["frames"][f], THUMB), row, col, cell * THUMB, color, 2),
                       f"{who}: frame {f}")


def click_pixel_handler(runs, run_id, frame, index, layer="all", head="all", run_b=None, maps="A") -> dict:
    """A click at `index` = (x, y) on the enlarged frame image: the trace of that frame pixel (`trace_pixel_handler`,
    in the run `maps` picks)."""
    if not index or len(index) != 2:
        return error("no pixel clicked")
    try:
        f = media.factor_for(runs.frame_size(run_id))
        x, y = integer(index[0], "x") // f, integer(index[1], "y") // f
    except ValueError as e:
        return error(str(e))
    return {**trace_pixel_handler(runs, run_id, frame, x, y, layer, head, run_b, maps), "pixel": (x, y)}
