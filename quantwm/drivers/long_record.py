"""`quantwm record --window N`: a long run file of the built-in model, written as the rollout makes it.

BF16 and the method roll out in lockstep from the same noise (`world.generate.rollout`), each cache keeping the
sink chunks plus the `window` most recent chunks (whole-chunk eviction, as `quantwm eval --window`). Each chunk's
frames and probe (top-1 sources, the logits of the chosen layers and heads, the cached tokens' positions) go
straight to the file (`runfile.RunWriter`); what stays in memory is the window, one chunk and a few floats a frame.
Besides what `views.make_run` writes (`summary` and `series`, the numbers the app shows, computed from the float
frames chunk by chunk), the file's metadata holds:

* `long`: the window, and per generated frame the error-over-time curves of `quantwm eval --window`
  (`world.long_rollout.CURVES`: PSNR and SSIM against BF16, flicker, top-1 and place shift, revisit consistency)
  with their summary (`long_rollout.summarise`: windowed curves, first frame under `threshold_db`, drift);
* `head_table`: per layer, per head, the Keys' and Values' mean code bits per channel the cache held at the end
  (`KVCache.head_bits`; None for a method with one width for every channel) and the head's top-1 shift and
  place shift rates over the run;
* `layer_sensitivity` (optional): `world.sensitivity.layer_sensitivity` of the same method, world and trajectory
  over a short clip.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import torch

from ..core.cache import CacheConfig
from ..evaluation import metrics as M
from ..evaluation.runfile import RunWriter, memory_meta
from ..world.generate import context_coverage, rollout
from ..world.long_rollout import CURVES, THRESHOLD_DB, PlaceMemory, frame_records, summarise
from .runs import RunKey, builtin_facts


class _Series:
    """`views.RunView.series` and `summary` of a run, accumulated chunk by chunk from its float frames."""

    def __init__(self, context_frames: int):
        self.ctx, self.prev = context_frames, None
        self.series = {"psnr": [], "tdiff": [], "warp_error": [], "identical": []}
        self.mse, self.ssim = [], []

    def add(self, x: torch.Tensor, r: torch.Tensor) -> None:
        """The next frames (F, H, W, 3) in [0, 1] of the method (`x`) and of BF16 (`r`)."""
        t0 = len(self.series["psnr"])
        same = [bool(torch.equal(a, b)) or t0 + i < self.ctx for i, (a, b) in enumerate(zip(x, r))]
        self.series["identical"] += same
        self.series["psnr"] += [None if s else v for s, v in zip(same, M.psnr(x, r).tolist())]
        if self.prev is None:
            td, warp = [None] + M.tdiff(x, r).tolist(), [None] + M.warp_error(x, r).tolist()
        else:  # the pair (previous frame, this one) of every frame: the same figures as over the whole video
            xx, rr = torch.cat([self.prev[0], x]), torch.cat([self.prev[1], r])
            td, warp = M.tdiff(xx, rr).tolist(), M.warp_error(xx, rr).tolist()
        self.series["tdiff"] += td
        self.series["warp_error"] += warp
        gen = [i for i in range(len(x)) if t0 + i >= self.ctx]
        if gen:
            self.mse += (x[gen] - r[gen]).square().mean((1, 2, 3)).tolist()
            self.ssim += M.ssim(x[gen], r[gen]).tolist()
        self.prev = (x[-1:], r[-1:])

    def summary(self) -> dict:
        """`diagnostics.clip_metrics` of the generated frames (the temporal ones from the frame before)."""
        lo = max(self.ctx - 1, 0) + 1  # tdiff[t] compares frame t with t - 1
        mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
        mse = mean(self.mse)
        return {"psnr": min(100.0, -10 * torch.log10(torch.tensor(max(mse, 1e-10))).item()), "ssim": mean(self.ssim),
                "tdiff": mean(self.series["tdiff"][lo:]), "warp_error": mean(self.series["warp_error"][lo:])}


def _uint8(frames: torch.Tensor) -> torch.Tensor:
    return (frames * 255).round().to(torch.uint8)


def record_long(model, key: RunKey, path, window: int, sink_chunks: int = 1, logit_layers=(1,), logit_heads=(0,),
                source: dict | None = None, progress: Callable | None = None, threshold_db: float = THRESHOLD_DB,
                sensitivity_frames: int | None = None, steps: int = 4) -> dict:
    """Write the run file of `key` against BF16 through a rolling window to `path` (see the module); returns its
    metadata. `sensitivity_frames`: also run the layer sensitivity over this many frames (None: not)."""
    cfg = model.cfg
    if window < 1 or sink_chunks < 0:
        raise ValueError(f"window must be >= 1 chunk and sink_chunks >= 0, got {window} and {sink_chunks}")
    for name, vals, n in (("logit layer", logit_layers, cfg.layers), ("logit head", logit_heads, cfg.heads)):
        bad = [v for v in vals if not 0 <= v < n]
        if bad:
            raise ValueError(f"{name} {bad[0]} out of range: the model has {n}")
    t0 = time.time()
    kept = dict(sink_chunks=sink_chunks, max_chunks=sink_chunks + window)
    ref_run = rollout(model, key.seed, key.trajectory, key.frames, CacheConfig(**kept), steps, probe=False)
    run = rollout(model, key.seed, key.trajectory, key.frames, replace(key.cache_config(), **kept), steps,
                  logits=(tuple(logit_layers), tuple(logit_heads)))
    n_chunks = key.frames // cfg.chunk_frames
    gap = window * cfg.chunk_frames
    places = {"bf16": PlaceMemory(gap, cfg.patch), "method": PlaceMemory(gap, cfg.patch)}
    L, H = cfg.layers, cfg.heads
    changed, moved, total = torch.zeros(L, H), torch.zeros(L, H), 0
    curves, series, prev = {k: [] for k in CURVES}, _Series(cfg.context_frames), None
    frame_shift = [None] * cfg.context_frames  # `views.RunView.series`' shift_rate: per frame, over layers and heads
    poses = cache = None
    with RunWriter(path, builtin_facts(cfg)) as w:
        for ref in ref_run:
            step = next(run)
            poses, cache = step.poses, step.cache
            w.add_frames(_uint8(ref.frames), _uint8(step.frames))
            series.add(step.frames, ref.frames)
            ref_revisit, revisit = places["bf16"].update(ref), places["method"].update(step)
            p = step.probe
            if p is not None:
                e, q = torch.stack(p.top1_exact).cpu(), torch.stack(p.top1_quant).cpu()  # (L, H, N)
                logits = None
                if logit_layers and logit_heads:
                    logits = tuple(torch.stack([p.logits[layer][i] for layer in logit_layers]) for i in (0, 1))
                w.add_probe(p.chunk, e, q, logits, p.positions.cpu())
                pos = p.positions.cpu()
                jumped = (e != q).float()  # (L, H, N): per frame of the chunk, the share of its tokens' top-1s moved
                frame_shift += jumped.reshape(L * H, -1, cfg.tokens_per_frame).mean((0, 2)).tolist()
                changed += (e != q).sum(-1)
                moved += (step.places[pos[e]] != step.places[pos[q]]).any(-1).sum(-1)
                total += e.shape[-1]
                for rec in frame_records(step, ref, prev, revisit, ref_revisit):
                    for k in CURVES:
                        curves[k].append(rec[k])
            prev = (step.frames[-1:], ref.frames[-1:])
            if progress:
                progress(ref.chunk + 1, n_chunks, f"frame {(ref.chunk + 1) * cfg.chunk_frames}")
        heads = []
        for layer in range(L):
            bits = {kind: cache.head_bits(layer, kind) for kind in "kv"}
            heads.append({"layer": layer, **{f"{kind}_bits": None if b is None else {
                "mean": b.mean(1).tolist(), "min": b.min(1).values.tolist(), "max": b.max(1).values.tolist()}
                for kind, b in bits.items()},
                "shift_rate": (changed[layer] / max(total, 1)).tolist(),
                "place_shift_rate": (moved[layer] / max(total, 1)).tolist()})
        shift = float(changed.sum() / max(total * L * H, 1))
        coverage = context_coverage(poses, cfg.context_frames, cfg.view)
        long = {"window": window, "sink_chunks": sink_chunks, "threshold_db": threshold_db, "revisit_gap": gap,
                "curves": curves, **{k: v for k, v in summarise({k: [v] for k, v in curves.items()},
                                                                 cfg.context_frames, threshold_db).items()
                                     if k != "per_frame"}}
        meta = {"method": key.method, "target": key.target, "bits": key.bits, **memory_meta(cache.memory()),
                "logit_layers": list(logit_layers), "logit_heads": list(logit_heads),
                "summary": {**series.summary(), "shift_rate": shift},
                "series": {**series.series, "shift_rate": frame_shift, "seen_by_context": coverage},
                "long": long, "head_table": heads, "configuration": cache.configuration,
                "source": {"seed": key.seed, "trajectory": key.trajectory, "frames": key.frames, "window": window,
                           "sink_chunks": sink_chunks, "budget": key.budget, **(source or {})}}
        stats = torch.stack([cache.query_stats(layer).cpu() for layer in range(L)])
        if sensitivity_frames:
            from ..world.sensitivity import layer_sensitivity

            budget = (key.budget, key.budget) if key.budget is not None else (None, None)
            meta["layer_sensitivity"] = layer_sensitivity(model, key.method, [key.seed], sensitivity_frames, key.bits,
                                                          key.trajectory, steps, key.target, budget)
        meta["seconds"] = time.time() - t0
        w.close(stats, meta)
    return meta
