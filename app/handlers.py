"""Plain handlers the tabs call: plain values in, plain values out, errors become messages."""
from __future__ import annotations

from quantwm.analyze import analyze_trace, report_rows
from quantwm.trace import read_trace


def analyze_handler(trace_path: str | None, methods: list[str], target: str, bits: int):
    """(markdown status, header, rows); a bad file or choice gives a message and an empty table."""
    if not trace_path:
        return "**Error:** no trace file given.", [], []
    if not methods:
        return "**Error:** choose at least one method.", [], []
    try:
        trace = read_trace(trace_path)
        report = analyze_trace(trace, list(methods), target, int(bits))
    except ValueError as e:
        return f"**Error:** {e}", [], []
    header, rows = report_rows(report)
    n_layers = len(trace.layers)
    return (f"Trace `{trace.meta['model']}`: {n_layers} layer(s), target={target}, {bits} bits, "
            f"grid of `{rows[0][0]}`: {report['config']['grid'][rows[0][0]]}"), header, rows
