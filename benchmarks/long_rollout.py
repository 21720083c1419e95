"""Resident memory of a long streamed rollout: `quantwm eval --frames 512 --window 8` for one method against BF16
(or, with `--record`, `quantwm record --frames 512 --window 8`, which writes the run file chunk by chunk).

Runs the command in this process and samples its resident set size (VmRSS) ten times a second beside the frames
the stream file (or the run file's frame scratch file) has received, then prints, per 64 generated frames (and the
last), the median and the peak of the samples taken while those frames were generated, and their growth from the
first interval after the window has filled (sink + window + the current chunk) to the end; flat means under 3%
for both. The samples after the last frame (the report, the run file assembled) are printed apart.

    nice python benchmarks/long_rollout.py                       # 512 frames, window 8, quantwm, seed 0
    nice python benchmarks/long_rollout.py --frames 1024 --method kivi --threads 2
    nice python benchmarks/long_rollout.py --record --out long.safetensors   # the run file, kept

`--threads` sets torch's intra-op threads (default 1: on a loaded 2-core machine more threads spin against each
other and run several times slower).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path


def rss_mib() -> float:
    """This process's resident set size in MiB (Linux /proc)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def frames_streamed(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def frames_recorded(path: Path, frame_bytes: int, context_frames: int) -> int:
    """Generated frames a `RunWriter` has written so far (its BF16 frames' scratch file; 0 once joined)."""
    try:
        return max(0, os.path.getsize(f"{path}.bf16.part") // frame_bytes - context_frames)
    except FileNotFoundError:
        return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=512)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--method", default="quantwm")
    ap.add_argument("--seed", default="0")
    ap.add_argument("--every", type=int, default=64, help="frames between printed RSS samples")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="also keep the eval report here")
    ap.add_argument("--record", action="store_true", help="measure `quantwm record --window` instead of eval")
    ap.add_argument("--out", default=None, help="with --record: keep the run file here")
    a = ap.parse_args()
    import torch

    from quantwm.cli import main as cli
    from quantwm.world.generate import DEFAULT_WEIGHTS, load_world_model

    torch.set_num_threads(a.threads)
    cfg = load_world_model(DEFAULT_WEIGHTS).cfg
    with tempfile.TemporaryDirectory() as tmp:
        stream = Path(tmp) / "frames.jsonl"
        run = Path(a.out or Path(tmp) / "run.safetensors")
        size = cfg.view * cfg.patch
        streamed = (lambda: frames_recorded(run, size * size * 3, cfg.context_frames)) if a.record else \
            (lambda: frames_streamed(stream))
        samples: list[tuple[int, float]] = []  # (generated frames streamed, RSS MiB)
        done = threading.Event()

        def sample():
            while not done.is_set():
                samples.append((streamed(), rss_mib()))
                done.wait(0.1)

        t = threading.Thread(target=sample, daemon=True)
        t0 = time.time()
        t.start()
        if a.record:
            command = ["record", "--method", a.method, "--seed", a.seed, "--frames", str(a.frames), "--window",
                       str(a.window), "--out", str(run)]
        else:
            command = ["eval", "--methods", a.method, "--seeds", a.seed, "--frames", str(a.frames), "--window",
                       str(a.window), "--stream", str(stream), "--json", a.json or str(Path(tmp) / "eval.json")]
        rc = cli(command)
        done.set()
        t.join()
        wall = time.time() - t0
    if rc:
        return rc
    generated = a.frames - cfg.context_frames
    marks = list(range(a.every, generated + 1, a.every)) + ([generated] if generated % a.every else [])  # and the end
    # RSS swings by several percent within every chunk (its probes' logits come and go), so one sample per mark is a
    # draw from that swing: each interval of `every` frames gives its median (the level) and its peak, taken over
    # the samples while its frames were being generated; what runs after the last frame (the report, the file) apart
    spans, lo = [], 0
    for m in marks:
        rs = sorted(r for f, r in samples if lo <= f < m)
        spans.append((m, rs[len(rs) // 2] if rs else float("nan"), rs[-1] if rs else float("nan"), len(rs)))
        lo = m
    end = [r for f, r in samples if f >= generated]
    fill = (1 + a.window + 1) * cfg.chunk_frames  # sink + window + current chunk, in frames (context included)
    after = [s for s in spans if s[0] - a.every + cfg.context_frames >= fill and s[3]]
    print(f"quantwm {' '.join(command)}: {wall:.0f} s wall, torch threads {a.threads}, pid {os.getpid()}, "
          f"{len(samples)} samples")
    print(f"RSS per {a.every} generated frames, median / peak of the samples while they were generated: "
          + ", ".join(f"{m}: {med:.1f} / {top:.1f} MiB" for m, med, top, _ in spans))
    if end:
        print(f"after the last frame (the report, the file written): peak {max(end):.1f} MiB over {len(end)} sample(s)")
    if len(after) >= 2:
        level = [med for _, med, _, _ in after]
        peaks = [top for _, _, top, _ in after]
        growth = (level[-1] - level[0]) / level[0]
        highest = (max(level) - level[0]) / level[0]
        peak_growth = (max(peaks) - peaks[0]) / peaks[0]
        flat = max(growth, highest, peak_growth) < 0.03
        print(f"growth after the window filled (frames {after[0][0] - a.every} to {after[-1][0]}): level "
              f"{100 * growth:+.2f}% (highest {100 * highest:+.2f}%), peak {100 * peak_growth:+.2f}%: "
              f"{'flat (< 3%)' if flat else 'NOT flat (>= 3%)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
