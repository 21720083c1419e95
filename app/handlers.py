"""Plain handlers the tabs call: plain values in, plain values out, errors become messages."""
from __future__ import annotations

import sys
import traceback

import numpy as np

from quantwm.evaluation.analyze import analyze_trace, report_rows
from quantwm.evaluation.trace import read_trace

from .values import integer, readable_file
from .world_handlers import memory_flag, sized_budget


def _readable(trace_path, check_upload) -> str:
    return readable_file(trace_path, "trace file", check_upload)


def analyze_handler(trace_path: str | None, methods: list[str], target: str, bits, budget=None, sizing=None,
                    check_upload=None):
    """(markdown status, header, rows); a bad file or choice gives a message and an empty table. `sizing`
    "budget" (the page's default): every method configured within `budget` bits per element by its rule, as on
    the other tabs; "bits": fixed grids of `bits`, no budget (`world_handlers.sized_budget`). The `fits` column
    flags a row over the budget or over BF16's 16 bits per element (`memory_flag`, the other tabs' test).
    `check_upload(path, what)` raises ValueError for a file over the server's upload limit."""
    if not trace_path:
        return "**Error:** no trace file given.", [], []
    if not methods:
        return "**Error:** choose at least one method.", [], []
    try:
        b = sized_budget(budget, sizing)
        trace = read_trace(_readable(trace_path, check_upload))
        report = analyze_trace(trace, list(methods), target, integer(bits, "bits"), budget=(b, b))
        if not report["methods"]:
            raise ValueError("no chosen method fits the budget: " + "; ".join(report["config"]["left_out"].values()))
    except (ValueError, TypeError) as e:
        return f"**Error:** {e}", [], []
    except Exception as e:  # noqa: BLE001 - the app must answer every request
        traceback.print_exc(file=sys.stderr)
        return f"**Error:** the analysis failed ({type(e).__name__}: {e})", [], []
    header, rows = report_rows(report)
    measured = {m: e["mean"]["bits_per_element"] for m, e in report["methods"].items()}  # unrounded
    over = {m: memory_flag({"span_bits_per_element": bpe}, b) for m, bpe in measured.items()}
    at = header.index("bits_per_element") + 1
    header.insert(at, "fits")
    for row in rows:
        row.insert(at, "OVER" if over[row[0]] else "yes")
    config = report["config"]
    status = f"Trace `{trace.meta['model']}`: {len(trace.layers)} layer(s), target={target}, "
    if b is None:
        low, high = min(measured, key=measured.get), max(measured, key=measured.get)
        status += (f"{bits} bits (fixed grids, no budget), grid of `{rows[0][0]}`: {config['grid'][rows[0][0]]}. "
                   f"The methods store from {measured[low]:.2f} ({low}) to {measured[high]:.2f} ({high}) bits per "
                   'element: Memory "Equal memory" holds each to one budget.')
    else:
        chosen = "; ".join(f"{m} " + ", ".join(f"{kind}: {c}" for kind, c in config["configuration"][m].items())
                           for m in report["methods"] if config["configuration"].get(m))
        status += f"within {b:g} bits per element, each method by its rule ({chosen})."
    named = [m for m, why in over.items() if why]
    if named:
        status += " **OVER**: " + "; ".join(f"{m}: {over[m]}" for m in named) + "."
    status += "".join(f" Left out: {m} ({why})." for m, why in config["left_out"].items())
    return status, header, rows


def trace_inspect_handler(trace_path: str | None, method: str, target: str, bits: int, layer, head, query,
                          check_upload=None) -> dict:
    """One traced query: its top-1 source under exact and `method`'s keys, the logit heatmaps, and the
    layer's top-1 jump map drawn on the query frame when the trace holds frames."""
    from quantwm.evaluation.diagnostics import trace_query_view

    from . import media, plots

    if not trace_path:
        return {"status": "**Error:** no trace file given."}
    try:
        for name, val in (("layer", layer), ("head", head), ("query", query), ("bits", bits)):
            if val is None or val == "":
                raise ValueError(f"no {name} given")
        r = trace_query_view(_readable(trace_path, check_upload), method, target,
                             *(integer(v, n) for n, v in (("bits", bits), ("layer", layer), ("head", head), ("query", query))))
    except (ValueError, TypeError) as e:
        return {"status": f"**Error:** {e}"}
    eb, em, (qf, qr, qc) = r["source_bf16"], r["source_method"], r["query_coords"]
    verdict = "**jumped**" if r["jumped"] else "no jump"
    status = (f"Layer {layer}, head {head}, query {query} (frame {qf}, row {qr}, col {qc}): BF16 source frame {eb[0]}, "
              f"row {eb[1]}, col {eb[2]}; {method} source frame {em[0]}, row {em[1]}, col {em[2]}: {verdict}. "
              f"Layer shift rate {r['shift_rate']:.1%} over {r['heads']} heads x {r['queries']} queries.")
    h, w = r["grid"]
    image = None
    geo = _query_frame_geometry(r)
    if geo is not None:  # whole frames of queries and keys: the layer's jump map on the query's frame
        factor, cell, cached_frames = geo
        jump_map = r["jumps"].reshape(-1, h, w)[qf - cached_frames]
        frames = r["frames"]
        base = frames[qf] if frames is not None and qf < len(frames) else np.full((h * cell, w * cell, 3), 96, np.uint8)
        image = media.enlarge(media.draw_box(media.tint(base, jump_map, media.CYAN, 0.6), qr, qc, cell, media.YELLOW, 1),
                              factor)
    return {"status": status, "figure": plots.logit_heatmaps_figure(r["logits_bf16"], r["logits_method"], eb, em, method, w),
            "jump_image": image, "result": {"query": [qf, qr, qc], "source_bf16": list(eb), "source_method": list(em),
                                            "jumped": bool(r["jumped"]), "layer_shift_rate": r["shift_rate"]}}


def trace_click_handler(trace_path: str | None, method: str, target: str, bits: int, layer, head, query, index,
                        check_upload=None) -> dict:
    """A click at `index` = (x, y) on the shown query frame (`trace_inspect_handler`'s jump image): inspect the
    query of that frame at the clicked token instead; the result carries its index as "query_index"."""
    from quantwm.evaluation.diagnostics import trace_query_view

    try:
        if not index or len(index) != 2:
            raise ValueError("no pixel clicked")
        current = trace_query_view(_readable(trace_path, check_upload), method, target,
                                   *(integer(v, n) for n, v in (("bits", bits), ("layer", layer), ("head", head),
                                                                ("query", query))))
        geo = _query_frame_geometry(current)
        if geo is None:
            raise ValueError("this trace's queries are not whole frames of the key grid: pick a query by index")
        factor, cell, first_query_frame = geo
        (h, w), tpf = current["grid"], current["tokens_per_frame"]
        x, y = integer(index[0], "x") // factor, integer(index[1], "y") // factor
        if not (0 <= x < w * cell and 0 <= y < h * cell):
            raise ValueError(f"the click ({x}, {y}) lies outside the {w * cell}x{h * cell} frame")
        frame = current["query_coords"][0]
        new = (frame - first_query_frame) * tpf + (y // cell) * w + x // cell
    except (ValueError, TypeError) as e:
        return {"status": f"**Error:** {e}"}
    r = trace_inspect_handler(trace_path, method, target, bits, layer, head, new, check_upload)
    r["query_index"] = new
    return r


def _query_frame_geometry(r: dict) -> tuple[int, int, int] | None:
    """(enlargement factor, pixels per token, first query frame) of the jump image, or None when the queries
    are not whole frames."""
    h, w = r["grid"]
    cached_frames = r["logits_bf16"].shape[0]
    if len(r["jumps"]) % (h * w) or r["logits_bf16"].shape[1] != h * w:
        return None
    frames = r["frames"]
    size = frames.shape[1] if frames is not None and r["query_coords"][0] < len(frames) else h * 8
    return max(1, 256 // size), size // h, cached_frames


def trace_energy_handler(trace_path: str | None, layer_index=0, check_upload=None) -> dict:
    """Query-energy spectra of a trace's layers (from q_hist when present)."""
    from quantwm.evaluation.diagnostics import trace_energy

    from . import plots

    if not trace_path:
        return {"status": "**Error:** no trace file given."}
    try:
        spectra = trace_energy(_readable(trace_path, check_upload))
        li = integer(layer_index, "layer index")
        if not 0 <= li < len(spectra):
            raise ValueError(f"layer index {li} out of range: the trace holds {len(spectra)} layers")
    except (TypeError, ValueError) as e:
        return {"status": f"**Error:** {e}"}
    tops = ", ".join(f"{float(s['top_fraction'].max()):.1%}" for s in spectra)
    return {"status": f"Best top-8 energy fraction per traced layer: {tops}.", "figure": plots.energy_figure(spectra, li)}
