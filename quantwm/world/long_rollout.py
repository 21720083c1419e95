"""`quantwm eval --window N`: long rollouts of the built-in model through a rolling window, streamed frame by frame.

BF16 and each method roll out in lockstep from the same noise (`generate.rollout`, one chunk at a time), each
through a KVCache that keeps the sink chunks plus the `window` most recent chunks (`CacheConfig(max_chunks=sink +
window)`: whole-chunk eviction, oldest non-sink chunk first, as LingBot-World and Self-Forcing keep their
caches). As each chunk is made, one JSON line per generated frame and method goes to the stream file: PSNR and
SSIM against BF16, tdiff-L1 flicker against BF16, the chunk's top-1 shift rate and place shift rate (every layer,
head and query of the chunk; places of the cached tokens the probe saw, since the window evicts), revisit
consistency (`PlaceMemory`: where the camera shows a place again after its view left the window, the PSNR of the
patch against what the same run showed there before, for the method and for BF16, whose own figure is the
model's) and the tokens the cache held. Only running figures and per-frame curves (a few floats a frame) stay in memory, so a run's
memory is the window's, not the length's (benchmarks/long_rollout.py measures it).

Error over time (`curves`): per method, the per-frame curves averaged over seeds, the same over consecutive
windows of `curve_frames` frames, the first frame whose PSNR against BF16 falls below `threshold_db`, and the
least-squares slope against time (per 100 frames) of the errors in `DRIFT` (MSE against BF16, flicker, place
shift), with the first and last quarters' means: a slope
near 0 with equal quarters says the window bounds the error; a rising one says it compounds.

Not here (the short `world.evaluate` has them): LPIPS, the warping error, Key/Value reconstruction errors and the
attention-output error, which need the whole video or the whole cache.
"""
from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from ..core.cache import CacheConfig
from ..evaluation import metrics as M
from .evaluate import check_worlds, method_configs
from .generate import ChunkStep, rollout
from .model import WorldModel
from .scene import patchify

CURVES = ("psnr", "ssim", "tdiff", "shift_rate", "place_shift_rate", "revisit_psnr",
          "bf16_revisit_psnr")  # per generated frame: against BF16, and each run's revisit consistency
PSNRS = ("psnr", "revisit_psnr", "bf16_revisit_psnr")  # averaged through their MSE (frames at the 100 dB cap: 0)
THRESHOLD_DB = 30.0  # a frame "leaves BF16" when its PSNR against BF16 falls below this
CURVE_FRAMES = 32  # frames per point of the windowed curves
DRIFT = ("mse", "tdiff", "place_shift_rate")  # errors whose slope against time is reported (mse: from PSNR vs BF16)


def chunk_shift(step: ChunkStep) -> tuple[float, float]:
    """(top-1 shift rate, place shift rate) over every layer, head and query of the chunk's probe."""
    p = step.probe
    changed = moved = total = 0
    for e, q in zip(p.top1_exact, p.top1_quant):
        changed += int((e != q).sum())
        moved += int((step.places[p.positions[e]] != step.places[p.positions[q]]).any(-1).sum())
        total += e.numel()
    return changed / total, moved / total


class PlaceMemory:
    """What one run last showed at every world place (the patch's pixels and its frame), for revisit consistency: a
    patch is a revisit when its place was last shown more than `gap` frames earlier (its view has left the recent
    window); its error is the MSE against that earlier patch of the same run. Bounded by the world's places."""

    def __init__(self, gap: int, patch: int):
        self.gap, self.patch, self.seen = gap, patch, {}

    def update(self, step: ChunkStep) -> list[float]:
        """Per frame of the chunk: the mean MSE of its revisited patches against the run's earlier view (nan: none)."""
        F = step.frames.shape[0]
        tokens = patchify(step.frames, self.patch)  # (F, H, W, 3) -> (F, n, p*p*3)
        n = tokens.shape[1]
        out = []
        for i in range(F):
            t = step.chunk * F + i
            places = step.places[t * n:(t + 1) * n].tolist()
            errs = [float((tokens[i, j] - self.seen[pl][1]).square().mean()) for j, pl in enumerate(map(tuple, places))
                    if pl in self.seen and t - self.seen[pl][0] > self.gap]
            self.seen.update({pl: (t, tokens[i, j].clone()) for j, pl in enumerate(map(tuple, places))})
            out.append(sum(errs) / len(errs) if errs else math.nan)
        return out


def _db(mse: float) -> float:
    return math.nan if mse != mse else min(100.0, -10 * math.log10(max(mse, 1e-10)))


def frame_records(step: ChunkStep, ref: ChunkStep, prev: tuple | None, revisit: list, ref_revisit: list) -> list[dict]:
    """One dict per frame of the chunk: its figures against BF16's same chunk (`prev`: both runs' previous frame;
    `revisit`, `ref_revisit`: each run's revisit MSE per frame, `PlaceMemory.update`)."""
    x, r = step.frames, ref.frames
    psnr, ssim = M.psnr(x, r).tolist(), M.ssim(x, r).tolist()
    tdiff = M.tdiff(torch.cat([prev[0], x]), torch.cat([prev[1], r])).tolist() if prev else [math.nan] * len(x)
    shift, place = chunk_shift(step)
    first = step.chunk * len(x)
    return [{"frame": first + i, "psnr": psnr[i], "ssim": ssim[i], "tdiff": tdiff[i], "shift_rate": shift,
             "place_shift_rate": place, "revisit_psnr": _db(revisit[i]), "bf16_revisit_psnr": _db(ref_revisit[i]),
             "cached_tokens": step.probe.n_cached} for i in range(len(x))]


def evaluate_long(model: WorldModel, methods: list[str], target: str = "kv", seeds: list[int] = (0,),
                  n_frames: int = 512, bits: int = 2, trajectory_kind: str = "loop", steps: int = 4,
                  window: int = 8, sink_chunks: int = 1, stream: str | Path | None = None,
                  progress: Callable | None = None, world: str = "photo", method_options: tuple = (),
                  budget: tuple = (None, None), threshold_db: float = THRESHOLD_DB,
                  curve_frames: int = CURVE_FRAMES, revisit_gap: int | None = None) -> dict:
    """The streamed `quantwm eval --window` report (see the module docstring); `stream`: the JSON-lines file;
    `revisit_gap`: frames after which a place shown again is a revisit (default: the window's frames)."""
    if window < 1:
        raise ValueError(f"window must be >= 1 chunk, got {window}")
    seeds = check_worlds(seeds, False, None, world)
    configs, left_out = method_configs(model, methods, target, bits, method_options, budget)
    windowed = {m: replace(c, sink_chunks=sink_chunks, max_chunks=sink_chunks + window) for m, c in configs.items()}
    bf16 = CacheConfig(sink_chunks=sink_chunks, max_chunks=sink_chunks + window)
    cfg = model.cfg
    n_chunks = n_frames // cfg.chunk_frames
    gap = window * cfg.chunk_frames if revisit_gap is None else revisit_gap
    curves = {m: {k: [] for k in CURVES} for m in configs}  # per seed: per generated frame
    memory, configuration, t0 = {}, {}, time.time()
    out = open(stream, "w") if stream else None
    try:
        for si, seed in enumerate(seeds):
            kw = dict(steps=steps, world=world)
            ref_run = rollout(model, seed, trajectory_kind, n_frames, bf16, probe=False, **kw)
            runs = {m: rollout(model, seed, trajectory_kind, n_frames, c, **kw) for m, c in windowed.items()}
            prev: dict = {}
            per = {m: {k: [] for k in CURVES} for m in configs}
            places = {m: PlaceMemory(gap, cfg.patch) for m in ["bf16", *configs]}
            for ref in ref_run:
                ref_revisit = places["bf16"].update(ref)
                for m, run in runs.items():
                    step = next(run)
                    revisit = places[m].update(step)
                    if step.probe is not None:
                        for rec in frame_records(step, ref, prev.get(m), revisit, ref_revisit):
                            for k in CURVES:
                                per[m][k].append(rec[k])
                            if out:
                                out.write(json.dumps({"seed": seed, "method": m, **rec}) + "\n")
                    prev[m] = (step.frames[-1:], ref.frames[-1:])
                    if ref.chunk == n_chunks - 1:
                        memory.setdefault(m, []).append(step.cache.memory())
                        configuration[m] = step.cache.configuration
                if out:
                    out.flush()
                if progress:
                    progress(si * n_chunks + ref.chunk + 1, len(seeds) * n_chunks, f"seed {seed} frame "
                             f"{(ref.chunk + 1) * cfg.chunk_frames}")
            for m in configs:
                for k in CURVES:
                    curves[m][k].append(per[m][k])
    finally:
        if out:
            out.close()
    first = cfg.context_frames
    report = {m: summarise(curves[m], first, threshold_db, curve_frames) for m in configs}
    for m in configs:  # each seed on its own: the spread behind the means
        report[m]["per_seed"] = []
        for i, seed in enumerate(seeds):
            one = summarise({k: [v[i]] for k, v in curves[m].items()}, first, threshold_db, curve_frames)
            report[m]["per_seed"].append({"seed": seed, "mean": one["mean"], "drift": one["drift"],
                                          "first_frame_below_threshold": one["first_frame_below_threshold"]})
    for m in configs:
        mems = memory[m]
        report[m]["mean"].update({"bits_per_element": _mean([x.span_bits_per_element for x in mems]),
                                  "cache_compression": _mean([x.cache_compression for x in mems]),
                                  "cache_mb": _mean([x.cache_mb for x in mems])})
    config = {"target": target, "bits": bits, "seeds": list(seeds), "frames": n_frames, "trajectory": trajectory_kind,
              "world": world, "steps": steps, "window": window, "sink_chunks": sink_chunks,
              "context_frames": first, "threshold_db": threshold_db, "curve_frames": curve_frames, "revisit_gap": gap,
              "stream": str(stream) if stream else None, "method_options": dict(method_options),
              "budget": {"k": budget[0], "v": budget[1]}, "left_out": left_out, "configuration": configuration,
              "model": model.config_dict(), "seconds": time.time() - t0}
    return {"methods": report, "config": config}


def _mean(xs) -> float:
    xs = [x for x in xs if x == x]
    return sum(xs) / len(xs) if xs else math.nan


def summarise(curves: dict, first_frame: int, threshold_db: float = THRESHOLD_DB,
              curve_frames: int = CURVE_FRAMES) -> dict:
    """A method's streamed curves ({metric: [per seed: per generated frame]}) -> means, per-frame and windowed
    curves (means over seeds), the first frame below `threshold_db` and the error's slope against time."""
    per_frame = {k: [_mean(col) for col in zip(*v)] for k, v in curves.items()}
    n = len(per_frame["psnr"])
    frames = list(range(first_frame, first_frame + n))
    mean = {k: _psnr(sum(v, [])) if k in PSNRS else _mean(sum(v, [])) for k, v in curves.items()}
    windowed = {k: [_mean(v[i:i + curve_frames]) for i in range(0, n, curve_frames)] for k, v in per_frame.items()}
    for k in PSNRS:  # from the window's mean MSE, as the clip's mean
        if k in curves:
            windowed[k] = [_psnr([p for seed in curves[k] for p in seed[i:i + curve_frames]])
                           for i in range(0, n, curve_frames)]
    mean["revisited_frames"] = sum(p == p for seed in curves.get("revisit_psnr", []) for p in seed)
    below = [f for f, p in zip(frames, per_frame["psnr"]) if p < threshold_db]
    q = max(1, n // 4)
    drift = {}
    error = {"mse": [10 ** (-p / 10) if p < 100 else 0.0 for p in per_frame["psnr"]], **per_frame}
    for k in DRIFT:
        v = error[k]
        drift[k] = {"slope_per_100_frames": 100 * _slope(frames, v), "first_quarter": _mean(v[:q]),
                    "last_quarter": _mean(v[-q:])}
    return {"mean": mean, "per_frame": per_frame, "first_frame": first_frame,
            "windowed": {"frames": [first_frame + i for i in range(0, n, curve_frames)], **windowed},
            "first_frame_below_threshold": below[0] if below else None, "drift": drift}


def _psnr(psnrs: list) -> float:
    """PSNR of frames together, from their mean MSE (frames identical to BF16, at the 100 dB cap, count as 0; nan
    frames, with nothing to compare, left out)."""
    mse = [10 ** (-p / 10) if p < 100 else 0.0 for p in psnrs if p == p]
    return min(100.0, -10 * math.log10(max(sum(mse) / len(mse), 1e-10))) if mse else math.nan


def _slope(x: list, y: list) -> float:
    """Least-squares slope of y against x (finite points only; nan with fewer than 2)."""
    pts = [(a, b) for a, b in zip(x, y) if b == b and math.isfinite(b)]
    if len(pts) < 2:
        return math.nan
    mx, my = (sum(c) / len(pts) for c in zip(*pts))
    var = sum((a - mx) ** 2 for a, _ in pts)
    return sum((a - mx) * (b - my) for a, b in pts) / var if var else math.nan
