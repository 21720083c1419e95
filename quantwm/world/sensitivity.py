"""Layer sensitivity of the built-in world model (issue 35, part 3): which layer's quantization moves the video.

For one method at a budget, over the same seeds and trajectories as `quantwm eval`, against the BF16 rollout:

* "only":   one layer at a time quantized, the rest kept BF16 (`CacheConfig(layers=(l,))`);
* "all_but": one layer at a time kept BF16, the rest quantized;

each with the clip's PSNR against BF16 and the place shift rate (top-1 jumps to another world place, exact vs
stored keys, every layer), and their change against the run with every layer quantized ("all"). Beside it,
the allocation the method made in the "all" run: per (layer, head), the mean bits per channel of Keys and of
Values and the narrowest and widest channel (`KVCache.head_bits`, averaged over spans; None for a method whose
grid is one for all channels), and the (layer, head)'s own top-1 shift and place shift rate in that run
(`head_shift`), so each head's bits stand beside what its quantization moved.
Runs 2 L + 2 rollouts per seed (L layers), so keep the frames few.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace

from ..core.cache import CacheConfig
from .evaluate import method_configs, place_shift_rate
from .generate import generate
from .model import WorldModel

MODES = ("only", "all_but")


def _clip_psnr(run, ref) -> float:
    """PSNR of the generated frames against BF16 from their mean MSE (capped at 100 dB where they are equal)."""
    ctx = run.config.context_frames
    mse = float(((run.frames[ctx:].float() - ref.frames[ctx:].float()) ** 2).mean())
    return 100.0 if mse == 0 else min(100.0, -10 * math.log10(mse))


def head_shift(run) -> tuple[list[list[float]], list[list[float]]]:
    """Per (layer, head) of a rollout: the share of probed queries whose top-1 cached token changes under the stored
    keys, and the share whose top-1 moves to another world place (`evaluate.place_shift_rate`, head by head)."""
    L = run.config.layers
    changed, moved, total = [0] * L, [0] * L, [0] * L
    for p in run.probes:
        pos = p.positions if p.positions is not None else run.cache.positions(0)
        for layer, (e, q) in enumerate(zip(p.top1_exact, p.top1_quant)):  # (H, N) each
            changed[layer] = changed[layer] + (e != q).sum(-1)
            moved[layer] = moved[layer] + (run.places[pos[e]] != run.places[pos[q]]).any(-1).sum(-1)
            total[layer] += e.shape[-1]
    if not total[0]:
        raise ValueError("the rollout has no probed chunk: nothing to count")
    return ([(c / t).tolist() for c, t in zip(changed, total)], [(m / t).tolist() for m, t in zip(moved, total)])


def layer_sensitivity(model: WorldModel, method: str, seeds: list[int] = (0,), n_frames: int = 16, bits: int = 2,
                      trajectory_kind: str = "loop", steps: int = 4, target: str = "kv", budget: tuple = (None, None),
                      method_options: tuple = (), progress: Callable | None = None) -> dict:
    """{"method", "all": {psnr, place_shift_rate}, "rows": [{mode, layer, psnr, place_shift_rate, d_psnr,
    d_place_shift_rate}], "allocation": [{layer, k_bits: {mean, min, max: [per head]} | None,
    v_bits: ..., shift_rate: [per head], place_shift_rate: [per head]}], "seconds"}; figures are
    means over seeds; d_ is the change against "all" (every layer quantized). ValueError for a method the budget
    leaves out."""
    configs, left_out = method_configs(model, [method], target, bits, method_options, budget)
    if method not in configs:
        raise ValueError(f"{method} does not fit the budget: {left_out.get(method, 'left out')}")
    cc, L = configs[method], model.cfg.layers
    variants = {("all", None): cc}
    for layer in range(L):
        variants[("only", layer)] = replace(cc, layers=(layer,))
        variants[("all_but", layer)] = replace(cc, layers=tuple(x for x in range(L) if x != layer))
    sums = {key: [0.0, 0.0] for key in variants}
    heads = {kind: [[] for _ in range(L)] for kind in "kv"}
    shifts = {"shift_rate": [[0.0] * model.cfg.heads for _ in range(L)],
              "place_shift_rate": [[0.0] * model.cfg.heads for _ in range(L)]}
    total, done, t0 = len(seeds) * (1 + len(variants)), 0, time.time()
    for seed in seeds:
        ref = generate(model, seed, trajectory_kind, n_frames, CacheConfig(), steps=steps)
        for key, c in variants.items():
            run = generate(model, seed, trajectory_kind, n_frames, c, steps=steps)
            sums[key][0] += _clip_psnr(run, ref) / len(seeds)
            sums[key][1] += place_shift_rate(run)[0] / len(seeds)
            if key[0] == "all":
                for kind in "kv":
                    for layer in range(L):
                        heads[kind][layer].append(run.cache.head_bits(layer, kind))
                for name, per_layer in zip(shifts, head_shift(run)):
                    shifts[name] = [[a + b / len(seeds) for a, b in zip(x, y)] for x, y in zip(shifts[name], per_layer)]
            done += 1
            if progress:
                progress(done, total, f"seed {seed} {key[0]} {'' if key[1] is None else key[1]}")
    base_psnr, base_shift = sums[("all", None)]
    rows = [{"mode": mode, "layer": layer, "psnr": p, "place_shift_rate": s, "d_psnr": p - base_psnr,
             "d_place_shift_rate": s - base_shift}
            for (mode, layer), (p, s) in sums.items() if mode != "all"]
    rows.sort(key=lambda r: (MODES.index(r["mode"]), r["layer"]))

    def per_head(xs):  # [(H, D) per seed] -> {"mean", "min", "max"}: one number per head
        if not xs or any(x is None for x in xs):
            return None
        w = sum(xs) / len(xs)
        return {"mean": w.mean(1).tolist(), "min": w.min(1).values.tolist(), "max": w.max(1).values.tolist()}
    allocation = [{"layer": layer, "k_bits": per_head(heads["k"][layer]), "v_bits": per_head(heads["v"][layer]),
                   "shift_rate": shifts["shift_rate"][layer], "place_shift_rate": shifts["place_shift_rate"][layer]}
                  for layer in range(L)]
    return {"method": method, "budget": {"k": budget[0], "v": budget[1]}, "seeds": list(seeds), "frames": n_frames,
            "all": {"psnr": base_psnr, "place_shift_rate": base_shift}, "rows": rows, "allocation": allocation,
            "seconds": time.time() - t0}
