"""The error-over-time table of docs/results.md from a `quantwm eval --window` report (its `--json`).

    quantwm eval --methods quantwm,kivi,qvg,turboquant --budget 2.5 --seeds 0,1 --frames 256 --window 8 \
        --json long.json --figure docs/img/long-rollout
    python benchmarks/long_table.py long.json

One row per method, best PSNR first: bits per element stored (the mean over the seeds' final caches), PSNR against
BF16 over every generated frame of every seed (from the mean MSE; each seed's own in brackets when the report
has them), the first frame where the seeds' mean PSNR falls
under the report's threshold, PSNR and place shift per window of `curve_frames` frames, the first and last
quarters' MSE against BF16 and place shift, and revisit consistency beside BF16's own.
"""
from __future__ import annotations

import argparse
import json


def rows(report: dict) -> list[str]:
    methods = report["methods"]
    out = []
    for name, m in sorted(methods.items(), key=lambda kv: -kv[1]["mean"]["psnr"]):
        mean, win, drift = m["mean"], m["windowed"], m["drift"]
        first = m["first_frame_below_threshold"]
        seeds = [p["mean"]["psnr"] for p in m.get("per_seed", [])]  # each seed's own PSNR
        psnr = f"{mean['psnr']:.1f} dB" + (f" ({' / '.join(f'{p:.1f}' for p in seeds)})" if len(seeds) > 1 else "")
        out.append(" | ".join([
            f"| {name} ({mean['bits_per_element']:.2f})", psnr, "none" if first is None else str(first),
            " ".join(f"{p:.1f}" for p in win["psnr"]),
            " ".join(f"{p:.3f}".lstrip("0") for p in win["place_shift_rate"]),
            f"{drift['mse']['first_quarter']:.4f} → {drift['mse']['last_quarter']:.4f}",
            f"{drift['place_shift_rate']['first_quarter']:.3f} → {drift['place_shift_rate']['last_quarter']:.3f}",
            f"{mean['revisit_psnr']:.1f} dB |"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report", help="the JSON `quantwm eval --window ... --json` wrote")
    a = ap.parse_args()
    with open(a.report) as f:
        report = json.load(f)
    c = report["config"]
    any_method = next(iter(report["methods"].values()))
    print(f"seeds {c['seeds']}, {c['frames']} frames, window {c['window']}, budget {c['budget']}, "
          f"threshold {c['threshold_db']} dB, {c['seconds']:.0f} s; BF16's own revisit consistency "
          f"{any_method['mean']['bf16_revisit_psnr']:.1f} dB over {any_method['mean']['revisited_frames']} frames")
    for m, d in report["methods"].items():
        print(f"{m}: MSE slope {d['drift']['mse']['slope_per_100_frames']:.2e} per 100 frames, place shift slope "
              f"{d['drift']['place_shift_rate']['slope_per_100_frames']:.2e}; configuration "
              f"{c['configuration'].get(m)}")
    print("| method (bits stored) | PSNR | first < 30 dB | PSNR per 32 frames | place shift per 32 frames | "
          "MSE, first → last quarter | place shift, first → last quarter | revisit |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows(report)))


if __name__ == "__main__":
    main()
