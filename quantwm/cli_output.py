"""What the command line prints and writes: the progress bar on stderr, markdown tables, numbers (`n/a` for NaN),
the JSON reports and the lines a budget adds."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from tqdm import tqdm


def progress_bar(desc: str):
    """An `update(done, total, what)` callback drawing a progress bar on stderr (none when stderr is no terminal)."""
    bar = None

    def update(done: int, total: int, what: str = ""):
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False, disable=None)
        bar.set_postfix_str(what)
        bar.update(done - bar.n)
        if done >= total:
            bar.close()
    return update


def write_json(obj: dict, path: str | None) -> None:
    """Write the report as JSON at `path` (its folder made), when a path is given."""
    text = json.dumps(obj, indent=2, allow_nan=True)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)


def table(rows: list[list[str]]) -> str:
    """A markdown table of rows of strings, the first row its header."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def fmt(x: float, digits: int = 4) -> str:
    """`x` with `digits` decimals, "n/a" for None or NaN."""
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def fmt_g(x: float) -> str:
    """`x` to 3 significant digits, "n/a" for None or NaN."""
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3g}"


def report_budget(config: dict) -> None:
    """The methods a budget left out (one line each) and what the others chose."""
    for why in config.get("left_out", {}).values():
        print(f"left out: {why}")
    for m, chosen in config.get("configuration", {}).items():
        if chosen and any(b is not None for b in config.get("budget", {}).values()):
            print(f"{m}: " + "; ".join(f"{k}: {v}" for k, v in chosen.items()))

