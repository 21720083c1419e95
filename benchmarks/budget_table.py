"""The README's budget table from a `quantwm frontier --budget ...` manifest: per source and budget B, quantwm's
shift rate against the best other method's, each at its budget rule's configuration and kept only where its
stored bits are within B (a point over B is left out, as the envelope leaves it).

    quantwm frontier --sources trace:A,trace:B --methods kivi,span-rtn,turboquant,oscar,quantwm --target k \\
        --budget 2,2.25,2.5,3,3.5,4 --out-dir out
    python benchmarks/budget_table.py out/manifest.json [--method quantwm] [--metric shift_rate]

A cell reads `ratio (quantwm vs best-other-name best-other)`; `—` where no other method fits B. The last column
gives quantwm at the smallest budget against the best other at 2.5 bits (`--versus NAME`: against that method
instead of the best other, in every column), and quantwm's bits above the Gaussian
bound at 2.5 (`k_bits_above_bound`, where the source is a trace).
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def points(manifest: dict) -> dict:
    """{source: {budget: {method: result}}} of the points that ran and are within their budget."""
    out: dict = defaultdict(lambda: defaultdict(dict))
    for entry in manifest.values():
        task, result = entry["task"], entry.get("result") or {}
        if "error" in result or "budget" not in task or result.get("bits_per_element", 1e9) > task["budget"] + 1e-9:
            continue
        out[task["source"]][task["budget"]][task["method"]] = result
    return out


def label(source: str) -> str:
    return Path(source.removeprefix("trace:")).stem


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("manifest")
    ap.add_argument("--method", default="quantwm")
    ap.add_argument("--metric", default="shift_rate")
    ap.add_argument("--versus", default=None, help="compare with this method instead of the best other one")
    a = ap.parse_args()
    table = points(json.loads(Path(a.manifest).read_text()))
    budgets = sorted({b for per in table.values() for b in per})
    print("| source | " + " | ".join(f"≤ {b:g} b" for b in budgets) + " | ours at the lowest B vs best other at 2.5 "
          "| bits above bound at 2.5 |")
    print("|---|" + "---|" * (len(budgets) + 2))
    for source, per in table.items():
        cells, best25 = [], None
        for b in budgets:
            ours = per.get(b, {}).get(a.method)
            others = [(r[a.metric], m) for m, r in per.get(b, {}).items()
                      if m != a.method and a.metric in r and a.versus in (None, m)]
            best = min(others) if others else None
            if b == 2.5:
                best25 = best
            if ours is None:
                cells.append("—")
            elif best is None:
                cells.append(f"{ours[a.metric]:.3f}, no other fits")
            else:
                ratio = ours[a.metric] / best[0] if best[0] > 0 else float("inf")
                mark = "**" if ratio <= 0.6 else ""
                cells.append(f"{mark}{ratio:.2f}x{mark} ({ours[a.metric]:.3f} vs {best[1]} {best[0]:.3f})")
        low = min((b for b in budgets if a.method in per.get(b, {})), default=None)
        versus = (f"{per[low][a.method][a.metric]:.3f} at {low:g} vs {best25[1]} {best25[0]:.3f}"
                  if low is not None and best25 else "—")
        meter = per.get(2.5, {}).get(a.method, {}).get("k_bits_above_bound")
        print(f"| {label(source)} | " + " | ".join(cells) + f" | {versus} | "
              + (f"{meter:.2f}" if meter is not None else "—") + " |")


if __name__ == "__main__":
    main()
