"""Plain handlers the tabs call: plain values in, plain values out, errors become messages."""
from __future__ import annotations

import os
import sys
import traceback

import numpy as np

from quantwm.evaluation.analyze import analyze_trace, report_rows
from quantwm.evaluation.trace import read_trace

from .values import integer


def _readable(trace_path, check_upload) -> str:
    """The trace path, checked: a file within the upload limit (ValueError otherwise)."""
    path = str(trace_path)
    if not os.path.isfile(path):
        raise ValueError(f"trace file {path!r} does not exist (or is not a file)")
    if check_upload is not None:
        check_upload(path, "trace file")
    return path


def analyze_handler(trace_path: str | None, methods: list[str], target: str, bits: int, check_upload=None):
    """(markdown status, header, rows); a bad file or choice gives a message and an empty table.
    `check_upload(path, what)` raises ValueError for a file over the server's upload limit."""
    if not trace_path:
        return "**Error:** no trace file given.", [], []
    if not methods:
        return "**Error:** choose at least one method.", [], []
    try:
        trace = read_trace(_readable(trace_path, check_upload))
        report = analyze_trace(trace, list(methods), target, integer(bits, "bits"))
    except (ValueError, TypeError) as e:
        return f"**Error:** {e}", [], []
    except Exception as e:  # noqa: BLE001 - the app must answer every request
        traceback.print_exc(file=sys.stderr)
        return f"**Error:** the analysis failed ({type(e).__name__}: {e})", [], []
    header, rows = report_rows(report)
    n_layers = len(trace.layers)
    return (f"Trace `{trace.meta['model']}`: {n_layers} layer(s), target={target}, {bits} bits, "
            f"grid of `{rows[0][0]}`: {report['config']['grid'][rows[0][0]]}"), header, rows


def trace_inspect_handler(trace_path: str | None, method: str, target: str, bits: int, layer, head, query,
                          check_upload=None) -> dict:
    """One traced query: its top-1 source under exact and `method`'s keys, the logit heatmaps, and the
    layer's top-1 jump map drawn on the query frame when the trace holds frames."""
    from quantwm.evaluation.workbench import trace_query_view

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
    jumps = r["jumps"]
    cached_frames = r["logits_bf16"].shape[0]
    if len(jumps) % (h * w) == 0 and r["logits_bf16"].shape[1] == h * w:  # whole frames of queries and keys
        jump_map = jumps.reshape(-1, h, w)[qf - cached_frames]
        frames = r["frames"]
        if frames is not None and qf < len(frames):
            base = frames[qf]
        else:
            base = np.full((h * 8, w * 8, 3), 96, np.uint8)
        cell = base.shape[0] // h
        image = media.enlarge(media.draw_box(media.tint(base, jump_map, media.CYAN, 0.6), qr, qc, cell, media.YELLOW, 1),
                              max(1, 256 // base.shape[0]))
    return {"status": status, "figure": plots.logit_heatmaps_figure(r["logits_bf16"], r["logits_method"], eb, em, method, w),
            "jump_image": image, "result": {"query": [qf, qr, qc], "source_bf16": list(eb), "source_method": list(em),
                                            "jumped": bool(r["jumped"]), "layer_shift_rate": r["shift_rate"]}}


def trace_energy_handler(trace_path: str | None, layer_index=0, check_upload=None) -> dict:
    """Query-energy spectra of a trace's layers (from q_hist when present)."""
    from quantwm.evaluation.workbench import trace_energy

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
