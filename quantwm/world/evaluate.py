"""`quantwm eval`: BF16 and each method rolled out from the same seeds and trajectories, compared.

Per method (generated frames only; context frames are ground truth in every run): PSNR (per frame, and
for the clip from the mean MSE over all generated frames), SSIM and LPIPS-Alex against the BF16 rollout
(LPIPS is NaN, with `config.lpips_note` saying why, when its weights are not installed), tdiff-L1 flicker
and the motion-compensated warping error against BF16, the top-1 shift rate (same cache
state, exact vs stored keys, every layer, head and query of every generated chunk) and the place shift rate
(only the top-1 changes that land on another world place; overall and per layer), Key/Value relative
reconstruction errors, the attention-output error they cause (every probed chunk and layer, exact vs
stored K/V), and the cache's memory figures (`CacheMemory`): the quantized spans' bits per element and
compression, and the whole cache's compression with its full-precision chunks; VBench's temporal-flickering
score of the run's own frames (`evaluation/vbench.py`, over the frame pairs tdiff covers, from the last context
frame on), per seed and its mean. The BF16 run reports that score too, and its memory: PSNR against ground truth
on views the context had fully seen, and per layer the attention mass each query puts on cached tokens that saw
its own world location, and the top-1 probability. World seeds used here are below TRAIN_SEED_BASE, so never seen in training.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from ..core.budget import fit_methods
from ..core.cache import CacheConfig, KVCache
from ..core.quant import BudgetError
from ..evaluation import diagnostics as D
from ..evaluation import metrics as M
from ..evaluation import vbench as V
from .generate import Rollout, generate
from .model import WorldModel
from .scene import TRAIN_SEED_BASE


def _nanmean(xs) -> float:
    t = torch.as_tensor([float(x) for x in xs], dtype=torch.float64)
    t = t[~t.isnan()]
    return float(t.mean()) if len(t) else float("nan")


def shift_rate(run) -> float:
    """Fraction of (chunk, layer, head, query) whose top-1 cached token differs between exact and stored keys;
    `run` is anything with the rollout's `probes` (a Rollout, a `drivers.runs.Record`, a `drivers.views.RunView`)."""
    changed = total = 0
    for p in run.probes:
        for e, q in zip(p.top1_exact, p.top1_quant):
            changed += int((e != q).sum())
            total += e.numel()
    return changed / total if total else float("nan")


def place_shift_rate(run: Rollout) -> tuple[float, list[float]]:
    """Fraction of (chunk, layer, head, query) whose top-1 cached token moves to another *world place*
    under the stored keys (overall, and per layer). Tokens of the same place in different frames carry
    nearly the same key, so the token-level shift rate also counts flips between copies of one place; this
    one counts only the jumps that fetch content from somewhere else."""
    L = run.config.layers
    moved, total = [0] * L, [0] * L
    for p in run.probes:
        # the cached tokens the probe saw (a rolling window evicts; without one, the final cache's prefix)
        pos = p.positions if getattr(p, "positions", None) is not None else run.cache.positions(0)
        for layer, (e, q) in enumerate(zip(p.top1_exact, p.top1_quant)):
            jumped = (run.places[pos[e]] != run.places[pos[q]]).any(-1)
            moved[layer] += int(jumped.sum())
            total[layer] += jumped.numel()
    if not sum(total):
        return float("nan"), [float("nan")] * L
    return sum(moved) / sum(total), [m / t for m, t in zip(moved, total)]


def attention_error(run: Rollout) -> float:
    """Relative attention-output error, stored vs exact K/V, over every probed chunk and layer."""
    c, L = run.cache, run.config.layers
    k_e = [c.keys(l, exact=True)[0].cpu() for l in range(L)]
    v_e = [c.values(l, exact=True)[0].cpu() for l in range(L)]
    return D.probed_attention_error(run.probes, k_e, [c.keys(l)[0].cpu() for l in range(L)], v_e,
                                    [c.values(l)[0].cpu() for l in range(L)],
                                    run.config.chunk_frames * run.config.tokens_per_frame)


def rel_errors(run: Rollout) -> tuple[float, float]:
    """Relative MSE of the stored Keys and Values over every layer of the final cache."""
    c = run.cache
    ke = [M.rel_err(c.keys(l), c.keys(l, exact=True)) for l in range(run.config.layers)]
    ve = [M.rel_err(c.values(l), c.values(l, exact=True)) for l in range(run.config.layers)]
    return sum(ke) / len(ke), sum(ve) / len(ve)


def memory_stats(run: Rollout) -> dict:
    """Per layer: mean same-place attention mass and mean top-1 probability over generated queries."""
    L = run.config.layers
    mass = [_nanmean(torch.cat([p.same_place_mass[l].flatten() for p in run.probes]).tolist()) for l in range(L)]
    top1 = [float(torch.cat([p.top1_prob[l].flatten() for p in run.probes]).mean()) for l in range(L)]
    return {"same_place_mass": mass, "top1_prob": top1}


FRAME_METRICS = ("psnr", "ssim", "lpips", "tdiff", "warp_error")  # per generated frame, against BF16
# per run: shift rates, errors, the cache's memory figures (`CacheMemory`: the spans' bits and compression, the
# whole cache's ratio) and VBench's flicker score of the run's own frames (not against BF16)
RUN_METRICS = ("shift_rate", "place_shift_rate", "bits_per_element", "compression", "cache_compression", "k_rel_err",
               "v_rel_err", "attn_out_rel_err", "vbench_flicker")
PHOTOS = {None: None, "all": "training", "matched": "training-matched"}


def evaluate(model: WorldModel, methods: list[str], target: str = "kv", seeds: list[int] = (0, 1), n_frames: int = 32,
             bits: int = 2, trajectory_kind: str = "loop", steps: int = 4, progress: Callable | None = None,
             training_seeds: bool = False, world: str = "photo", method_options: tuple = (),
             training_photos: str | None = None, budget: tuple = (None, None)) -> dict:
    """The `quantwm eval` report (see the module docstring). `world` is the world kind (`scene.WORLDS`).
    Two ways to compare with the training photographs (the memorisation check):

    * `training_photos="all"`: the same seeds (so the same mosaic layouts, trajectories and noise), with
      the tiles cut from the training photographs: each held-out world against its own twin;
      `"matched"`: one training photograph per held-out scene, grey for grey and colour for colour (a
      per-seed choice), so a twin repeats a photograph across tiles exactly where its held-out world repeats
      a scene (4 held-out scenes repeat more often than 12 training photographs) and is grey where it is;
    * `training_seeds=True`: the worlds of seeds + TRAIN_SEED_BASE, drawn as in training (other layouts
      and trajectories too, so the difference also holds the seeds' spread).

    `budget`: (Keys, Values) bits per element: each method configures itself within it (docs/method.md §3.1);
    one that cannot is left out, with its reason in `report["config"]["left_out"]`."""
    seeds = check_worlds(seeds, training_seeds, training_photos, world)
    configs, left_out = method_configs(model, methods, target, bits, method_options, budget, n_frames)
    rollout = dict(steps=steps, world=world, photos=PHOTOS[training_photos])
    lpips_note = M.lpips_unavailable()
    per = {m: {k: [] for k in (*FRAME_METRICS, *RUN_METRICS, "place_shift_rate_per_layer")} for m in configs}
    bf16: dict = {k: [] for k in ("revisit_psnr_vs_gt", "psnr_vs_gt", "same_place_mass", "top1_prob", "revisited_frames",
                                  "vbench_flicker")}
    configuration: dict = {}
    total, done, t0 = len(seeds) * (1 + len(configs)), 0, time.time()

    def step(what: str):
        nonlocal done
        done += 1
        if progress:
            progress(done, total, what)

    for seed in seeds:
        ref = generate(model, seed, trajectory_kind, n_frames, CacheConfig(), **rollout)
        flow = _measure_reference(ref, bf16)
        step(f"seed {seed} bf16")
        for m, cc in list(configs.items()):
            try:
                run = generate(model, seed, trajectory_kind, n_frames, cc, **rollout)
            except BudgetError as e:  # a budget the method's configurations fit on a Gaussian span, not on these
                left_out[m] = str(e).splitlines()[0]
                del configs[m]
                continue
            _measure_run(run, ref, flow, lpips_note, per[m])
            configuration[m] = run.cache.configuration
            step(f"seed {seed} {m}")
    config = {"target": target, "bits": bits, "seeds": list(seeds), "frames": n_frames, "trajectory": trajectory_kind,
              "world": world, "photos": rollout["photos"] or "by seed", "method_options": dict(method_options),
              "steps": steps, "context_frames": model.cfg.context_frames, "lpips_note": lpips_note,
              "model": model.config_dict(), "budget": {"k": budget[0], "v": budget[1]}, "left_out": left_out,
              "configuration": configuration, "seconds": time.time() - t0}
    return {"methods": {m: _method_report(per[m]) for m in configs}, "bf16": _bf16_report(bf16, model.cfg.layers),
            "config": config}


def check_worlds(seeds, training_seeds: bool, training_photos: str | None, world: str) -> list[int]:
    """The world seeds to run (training ones when asked); ValueError for a combination that means nothing."""
    if any(s >= TRAIN_SEED_BASE or s < 0 for s in seeds):
        raise ValueError(f"evaluation world seeds must lie in [0, {TRAIN_SEED_BASE}) (training uses the rest)")
    if training_seeds:
        seeds = [s + TRAIN_SEED_BASE for s in seeds]
    if not seeds:
        raise ValueError("give at least one seed")
    if training_photos not in PHOTOS:
        raise ValueError(f"training_photos must be None, 'all' or 'matched', got {training_photos!r}")
    if training_photos and (training_seeds or world != "photo"):
        raise ValueError("training_photos applies to the photographic world, without training_seeds")
    return list(seeds)


def method_configs(model: WorldModel, methods, target: str, bits: int, method_options: tuple,
             budget: tuple, n_frames: int | None = None) -> tuple[dict, dict]:
    """({method: CacheConfig} of the methods that fit the budget, {method: why} of those left out); every name and
    option is validated before any work. `n_frames`: the rollout's length, whose quantized chunks (all but the sink
    and recent chunk) a budget counts a per-layer constant over (oscar's rotation; core/budget.py)."""
    mc = model.cfg
    held = (max(1, n_frames // mc.chunk_frames - CacheConfig.sink_chunks - CacheConfig.recent_chunks) if n_frames
            else None)  # the configs below keep CacheConfig's sink and recent chunks
    chunk_tokens = mc.chunk_frames * mc.tokens_per_frame
    methods, left_out = fit_methods(methods, *budget, mc.head_dim, chunk_tokens, target, dict(method_options),
                                    held and mc.heads * held * chunk_tokens * mc.head_dim)
    configs = {m: CacheConfig(method=m, target=target, k_bits=bits, v_bits=bits, method_options=method_options,
                              budget_k=budget[0], budget_v=budget[1], held_chunks=held) for m in methods}
    for c in configs.values():
        KVCache(c, 1)
    return configs, left_out


def _measure_reference(ref: Rollout, bf16: dict) -> torch.Tensor:
    """Add the BF16 run's own figures to `bf16`; returns the optical flow every method's warping error uses."""
    ctx = ref.config.context_frames
    revisit = ref.revisited()
    bf16["revisited_frames"].append(revisit)
    if revisit:
        bf16["revisit_psnr_vs_gt"].append(ref.revisit_psnr())
    bf16["psnr_vs_gt"].append(M.psnr(ref.frames[ctx:], ref.ground_truth[ctx:]).tolist())
    mem = memory_stats(ref)
    bf16["same_place_mass"].append(mem["same_place_mass"]), bf16["top1_prob"].append(mem["top1_prob"])
    bf16["vbench_flicker"].append(V.temporal_flickering(ref.frames[ctx - 1:]))
    return M.reference_flow(ref.frames[ctx - 1:])


def _measure_run(run: Rollout, ref: Rollout, flow: torch.Tensor, lpips_note: str | None, out: dict) -> None:
    """Append one method run's figures against `ref` to `out` (lists by metric)."""
    ctx = run.config.context_frames
    x, r = run.frames[ctx:], ref.frames[ctx:]
    out["psnr"].append(M.psnr(x, r).tolist())
    out["ssim"].append(M.ssim(x, r).tolist())
    out["lpips"].append([math.nan] * len(x) if lpips_note else M.lpips(x, r).tolist())
    out["tdiff"].append(M.tdiff(run.frames[ctx - 1:], ref.frames[ctx - 1:]).tolist())
    out["warp_error"].append(M.warp_error(run.frames[ctx - 1:], ref.frames[ctx - 1:], flow).tolist())
    ke, ve = rel_errors(run)
    place, per_layer = place_shift_rate(run)
    mem = run.cache.memory()
    out["place_shift_rate_per_layer"].append(per_layer)
    for k, v in (("shift_rate", shift_rate(run)), ("place_shift_rate", place), ("attn_out_rel_err", attention_error(run)),
                 ("bits_per_element", mem.span_bits_per_element), ("compression", mem.span_compression),
                 ("cache_compression", mem.cache_compression), ("k_rel_err", ke), ("v_rel_err", ve),
                 ("vbench_flicker", V.temporal_flickering(run.frames[ctx - 1:]))):
        out[k].append(v)


def _method_report(per: dict) -> dict:
    """A method's means over seeds and frames, its per-frame means, its place shift rate per layer and its VBench
    flicker score per seed."""
    frame_means = {k: [sum(col) / len(col) for col in zip(*per[k])] for k in FRAME_METRICS}
    mean = {k: _nanmean(sum(per[k], [])) for k in FRAME_METRICS}
    # PSNR of the clip: from the mean MSE over all generated frames (frames identical to BF16, e.g. before
    # anything is quantized, would otherwise enter a per-frame mean at the 100 dB cap)
    mse = [10 ** (-p / 10) if p < 100 else 0.0 for p in sum(per["psnr"], [])]
    mean["psnr"] = min(100.0, -10 * math.log10(max(sum(mse) / len(mse), 1e-10)))
    mean.update({k: _nanmean(per[k]) for k in RUN_METRICS})
    return {"mean": mean, "per_frame": frame_means,
            "place_shift_rate_per_layer": [_nanmean(col) for col in zip(*per["place_shift_rate_per_layer"])],
            "vbench_flicker_per_seed": per["vbench_flicker"]}


def _bf16_report(bf16: dict, n_layers: int) -> dict:
    return {"revisit_psnr_vs_gt": _nanmean(bf16["revisit_psnr_vs_gt"]),
            "psnr_vs_gt_per_frame": [sum(col) / len(col) for col in zip(*bf16["psnr_vs_gt"])],
            "same_place_mass_per_layer": [_nanmean(s[l] for s in bf16["same_place_mass"]) for l in range(n_layers)],
            "top1_prob_per_layer": [_nanmean(s[l] for s in bf16["top1_prob"]) for l in range(n_layers)],
            "revisited_frames": bf16["revisited_frames"], "vbench_flicker": _nanmean(bf16["vbench_flicker"]),
            "vbench_flicker_per_seed": bf16["vbench_flicker"]}
