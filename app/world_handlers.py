"""Handlers of the world-model tabs: plain values in, a dict of plain values out (no torch, no gradio).

Every handler takes the run registry first (`quantwm.drivers.registry.RunRegistry`: every run shown, built-in
or opened, by run id, and the Workbench as `runs.wb`); app/assemble.py binds it. Bad input
never raises: the dict then holds an "**Error:** ..." status and None for every output it leaves alone
(the tabs turn None into "no change"). Anything else that goes wrong inside a handler (`guarded`) also
ends in a message, with the traceback on the server's stderr: the app stays up for everyone.

Files (videos, exported figures) go to `FILES` (`media.TempFiles`): one folder per process, a run's videos
deleted when the results cache evicts the run (`track_evictions`), everything removed at shutdown.
"""
from __future__ import annotations

import functools
import os
import sys
import time
import traceback
from collections.abc import Callable

import numpy as np

from . import media, plots
from .values import integer, name, readable_file

FACTOR = 4  # the built-in model's 64x64 frames are shown enlarged 4x on the server (`factor_for`)
DISPLAY = 256  # frames are enlarged by an integer factor to about this many pixels on their longer side
THUMB = 3  # source thumbnails: 192 x 192 for the built-in 64 x 64 frames, each labelled with its frame
JUMP_SHARE = 0.5  # the top-1 overlay tints a token whose top-1 moved in at least this share of the chosen layers/heads
OVERLAYS = ("flicker map", "warping error", "top-1 jumps")
DEFAULT_BUDGET = 2.5  # bits per element the Generate and Methods tabs open on: every method at equal memory
FILES: media.TempFiles | None = None  # made by `use_files` (the app, at start-up) or on first use


def use_files(files: media.TempFiles) -> media.TempFiles:
    global FILES
    FILES = files
    return files


def app_files() -> media.TempFiles:
    """The app's temporary files (made on first use when the entry point did not set them)."""
    return FILES or use_files(media.TempFiles())


def track_evictions(runs) -> None:
    """Delete a run's videos when the workbench's results cache evicts it or the registry drops an opened run."""
    runs.wb.on_evict.append(lambda key: app_files().forget(key.id))
    runs.on_evict.append(lambda run_id: app_files().forget(run_id))


def error(message: str, **keep) -> dict:
    return {"status": f"**Error:** {message}", **keep}


def guarded(handler: Callable) -> Callable:
    """Wrap a handler so an unexpected exception becomes an error message (and a traceback on stderr)."""
    @functools.wraps(handler)
    def wrapper(*args, **kwargs):
        try:
            return handler(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the app must answer every request
            traceback.print_exc(file=sys.stderr)
            return error(f"the request failed ({type(e).__name__}: {e}); nothing else was affected")
    return wrapper


def _choice(value, name: str):
    """'all' / None -> None; otherwise an int (ValueError naming the control)."""
    if value is None or (isinstance(value, str) and value in ("", "all")):
        return None
    try:
        return integer(value, name)
    except ValueError:
        raise ValueError(f"{name} must be 'all' or an integer, got {value!r:.60}") from None


def run_key(seed, trajectory, method, target, bits, frames):
    """The `RunKey` of request values, each checked (ValueError naming the control)."""
    from quantwm.drivers.runs import RunKey

    return RunKey(integer(seed, "world seed"), name(trajectory, "trajectory"), name(method, "method"),
                  name(target, "target"), integer(bits, "bits"), integer(frames, "frames"))


def factor_for(shape) -> int:
    """The integer enlargement of a frame of `shape` (H, W, ...): a click at image pixel (x, y) is frame pixel
    (x // factor, y // factor). 4 for the built-in 64x64 frames, 1 for a real model's 480x832."""
    return max(1, DISPLAY // max(int(shape[0]), int(shape[1])))


def _video(run_id: str, which: str, frames: np.ndarray) -> str:
    return app_files().video(run_id, which, frames, factor_for(frames.shape[1:3]))


def rounded(x, digits=4):
    """A number as a table or summary shows it (None stays None)."""
    return None if x is None else round(float(x), digits)


def generate_handler(runs, seed, trajectory, method, target, bits, frames, budget=None, sizing=None,
                     progress: Callable | None = None) -> dict:
    """Generate (or fetch) BF16 and the method: videos, per-frame figure, summary, the worst frame. `sizing`
    "budget" (the page's default: equal memory for every method): the method configures itself by its rule
    within `budget` bits per element, a number in (0, 16] (0 or none is an error, as is 20); "bits": a fixed
    grid of `bits` (`sized_budget`). The status says what the method chose and flags a run over its budget or
    over BF16's bytes (`memory_flag`, as the Methods table does); a run over its budget is never said to be
    within it."""
    from dataclasses import replace

    from quantwm.drivers import studies

    wb = runs.wb
    try:
        key = run_key(seed, trajectory, method, target, bits, frames)
        b = sized_budget(budget, sizing)
        if b is not None:
            key = replace(key, budget=b)
        wb.check_frames(key.frames)
        cached = wb.cached(key) and wb.cached(key.reference())
        start = time.perf_counter()
        cmp = studies.compare(wb, key, progress)
        seconds = time.perf_counter() - start  # this request's wall time, waits and both rollouts included
    except ValueError as e:
        return error(str(e))
    quantized = key.method != "bf16"
    over = quantized and memory_flag(cmp["summary"], key.budget) is not None
    origin = "from the cache" if cached else f"generated in {seconds:.1f} s"
    if key.budget is None:
        size = f"{key.bits}-bit"
    else:  # "within" only where the measured spans keep to the budget
        size = f"budget {key.budget:g} bits" if over else f"within {key.budget:g} bits"
    if quantized:
        origin += (f"; fixed {key.bits}-bit grid, no budget" if key.budget is None else
                   f"; configuration {'chosen for a budget of' if over else 'within'} {key.budget:g} bits: "
                   f"{studies.configuration(wb, key)}")
    return _shown(cmp, key.id, wb.model_facts()["context_frames"], origin, f"{key.method} {size}", key.budget,
                  quantized)


SIZINGS = ("budget", "bits")  # the Memory control: equal memory (a budget) or a fixed grid of bits


def sized_budget(budget, sizing=None) -> float | None:
    """The budget a request runs within, or None for a fixed grid: `sizing` "budget" checks `budget` (bits per
    element in (0, 16]: 0, empty or 20 is an error naming the explicit other mode); "bits" is None; None (a
    handler called without it) reads as "budget" when a budget is given, else "bits"."""
    if sizing is None:
        sizing = "bits" if budget is None else "budget"
    if sizing not in SIZINGS:
        raise ValueError(f"sizing must be one of {', '.join(SIZINGS)}, got {sizing!r:.60}")
    if sizing == "bits":
        return None
    try:
        return budget_value(budget)
    except ValueError as e:
        raise ValueError(f'{e}; for a fixed grid of bits, choose Memory: "Fixed bits" (sizing="bits")') from None


def memory_flag(summary: dict, budget: float | None) -> str | None:
    """Why a run's memory is out of bounds, or None: its quantized spans over `budget` bits per element, or its
    spans or whole cache bigger than BF16's (the Generate tab's flag, the Methods and trace tables' `fits`).
    `summary`: span_bits_per_element, and cache_mb and bf16_mb where the whole cache is known."""
    bpe, over = summary["span_bits_per_element"], []
    cache, bf16 = summary.get("cache_mb"), summary.get("bf16_mb")  # a trace analysis has the spans' bits alone
    if budget is not None and bpe > budget + 1e-9:
        over.append(f"its quantized spans store {bpe:.2f} bits/element, over the budget of {budget:g}")
    if bpe > 16 + 1e-9 or (cache is not None and bf16 is not None and cache > bf16):
        whole = "" if cache is None or bf16 is None else f"; whole cache {cache:.2f} MB vs {bf16:.2f} MB"
        over.append(f"it stores more than BF16 (spans {bpe:.2f} bits/element vs 16{whole})")
    return "; ".join(over) or None


def _shown(cmp: dict, run_id: str, ctx: int, origin: str, method: str, budget: float | None = None,
           quantized: bool = True) -> dict:
    """The Generate tab's outputs for a comparison (`RunView.compare`, built-in or opened); `method` names the
    quantized side ("kivi 3-bit") for its label. The status names both memory figures (`CacheMemory.summary`)
    and leads with the flag of a run over its budget or over BF16's bytes."""
    s = cmp["summary"]
    worst = cmp["worst"][0] + ctx if cmp["worst"] else ctx
    worst_frames = [t + ctx for t in cmp["worst"]]
    flag = memory_flag(s, budget) if quantized else None
    status = ((f"**OVER: {flag}.** " if flag else "") + f"**{run_id}** ({origin}): "
              f"PSNR vs BF16 {s['psnr']:.2f} dB, SSIM {s['ssim']:.4f}, tdiff {s['tdiff']:.4f}, "
              f"top-1 shift rate {s['shift_rate']:.1%}; memory (CacheMemory): {cmp['memory']}. "
              f"Worst flicker frames: {', '.join(map(str, worst_frames)) or 'none'}.")
    return {"status": status, "run_id": run_id, "bf16_video": _video(run_id, "bf16", cmp["bf16"]),
            "method_label": f"{method}, spans {s['span_bits_per_element']:.2f} bits/element" + (" OVER" if flag else ""),
            "method_video": _video(run_id, "method", cmp["method"]), "frames": len(cmp["bf16"]),
            "figure": plots.frame_series_figure(cmp["series"], worst_frames, ctx), "frame": worst,
            "worst_frames": worst_frames, "summary": {k: rounded(v) for k, v in s.items()}, "over": flag}


def live_generate_handler(runs, live, embeddings, seed, method, target, bits, latent_frames, prompt=None,
                          progress: Callable | None = None) -> dict:
    """Generate BF16 and `method` live with a real model's backend (`live`, e.g. adapters.self_forcing.
    SelfForcingLive) from a prompt or a prompt-embeddings file, and show the pair like an opened run."""
    try:
        prompt = prompt.strip() if isinstance(prompt, str) else ""
        seed, bits, n = integer(seed, "noise seed"), integer(bits, "bits"), integer(latent_frames, "latent frames")
        method, target = name(method, "method"), name(target, "target")
        live.check(seed, method, target, bits, n, prompt, embeddings)
        if embeddings:
            embeddings = readable_file(embeddings, "prompt embeddings file", runs.wb.limits.check_upload)
        with runs.wb.generation():  # one generation at a time, shared with the built-in model's
            run = live.generate(seed, method, target, bits, n, prompt, embeddings, progress=progress)
    except ValueError as e:
        return error(str(e))
    run_id = live.run_id(seed, method, target, bits, n)
    runs.add(run, run_id)
    r = open_run_handler(runs, run_id, files=False)
    if r.get("run_id"):
        r["status"] = r["status"].replace("(opened:", "(generated live:", 1)
    return r


def open_run_handler(runs, path, files: bool = True) -> dict:
    """Open a run file (`quantwm record`; an uploaded file's path, or the id of a run already open) and show it
    like a generated run: videos, per-frame plot, and every view (scrub, overlays, pixel trace, energy).
    `files=False` accepts only ids of opened runs (what the page's run list sends)."""
    try:
        if not path:
            raise ValueError("no run file given")
        if runs.is_opened(str(path)):
            run_id = str(path)
        elif not files:
            raise ValueError(f"{str(path)!r:.120} is not an opened run; opened: {', '.join(runs.opened()) or 'none'} "
                             "(upload the file, or start the app with --run FILE)")
        else:
            run_id = runs.open(readable_file(path, "run file", runs.wb.limits.check_upload))
        lr = runs.view(run_id)
        cmp = lr.compare()
    except (ValueError, TypeError) as e:
        return error(str(e))
    f = lr.facts
    shown_layers = {"layers": f.layers, "heads": f.heads, "logit_layers": lr.run.meta["logit_layers"],
                    "logit_heads": lr.run.meta["logit_heads"], "frame_hw": tuple(lr.run.bf16.shape[1:3])}
    origin = (f"opened: {f.model}, latent grid {f.latent_grid[0]}x{f.latent_grid[1]}, {f.pixels_per_token} pixels "
              f"per token, {f.vae_temporal} output frame(s) per latent frame")
    meta = lr.run.meta
    for said in (meta.get("frames_are"), *(meta.get("notes") or ())):  # FastVideo runs: what the frames are
        if isinstance(said, str) and said:
            origin += f"; {said}"
    controls = {"method": meta["method"], "target": meta["target"], "bits": meta["bits"]}
    if f.model == "quantwm built-in world model":  # the same world can be generated again from these
        controls.update(seed=meta["source"]["seed"], trajectory=meta["source"]["trajectory"],
                        frames=meta["source"]["frames"])
    return {**_shown(cmp, run_id, lr.context_frames, origin, f"{meta['method']} {meta['bits']}-bit"),
            **shown_layers, "controls": controls}


def scrub_handler(runs, run_id, frame, overlays=(), layer="all", head="all", traced=None) -> dict:
    """Both runs at `frame`, enlarged, with the chosen overlays on the method's frame, each scaled to this frame
    (`overlay_scale`) and keyed in "scale" (a colour bar per tinted overlay, None when none); the trace panel's
    pixel (`traced`, when a trace of this run) marked on both frames."""
    overlays = list(overlays or [])
    try:
        unknown = [o for o in overlays if o not in OVERLAYS]
        if unknown:
            raise ValueError(f"unknown overlay {unknown[0]!r}; choose from {', '.join(OVERLAYS)}")
        if frame is None:
            raise ValueError("no frame given")
        v = runs.view(run_id).frame_view(integer(frame, "frame"), _choice(layer, "layer"), _choice(head, "head"))
    except ValueError as e:
        return error(str(e))
    method, scales, bars = v["method"], [], []
    notes = [f"Frame **{v['frame']}**" + (" (context: given, identical in both runs)" if v["context"] else ""),
             f"mean flicker {float(v['flicker'].mean()):.4f}",
             f"mean warping error {float(v['warp'].mean()):.4f} (above BF16's, per pixel; 0 = BF16, lower is better)"]
    for overlay, key, color, what in (("flicker map", "flicker", media.RED, "red"),
                                      ("warping error", "warp", media.ORANGE, "orange")):
        if overlay in overlays:
            top = overlay_scale(v[key])
            method = media.tint(method, media.normalise(v[key], top), color)
            if top > 0:
                bars.append(media.colour_bar(color, top, f"{overlay} (this frame's 99th percentile)"))
            scales.append(f"{what} {overlay} from 0 to full at this frame's 99th percentile, {top:.4f} "
                          f"(its maximum {float(v[key].max()):.4f})" if top > 0 else f"{what}: no {overlay} on this frame")
    if v["jumps"] is not None:
        moved = v["jumps"] >= JUMP_SHARE
        notes.append(f"tokens whose top-1 moved in at least half the chosen layers and heads: {float(moved.mean()):.1%}"
                     f" (layer {layer}, head {head}; in any of them: {float((v['jumps'] > 0).mean()):.1%})")
        if "top-1 jumps" in overlays:
            method = media.tint(method, moved.astype(np.float32), media.CYAN, strength=0.6)
            scales.append("cyan: a token whose top-1 source moved in at least half of the chosen layers and heads")
    elif "top-1 jumps" in overlays:
        notes.append("no top-1 jump map for a context frame")
    if scales:
        notes.append("overlays: " + "; ".join(scales))
    f = factor_for(v["bf16"].shape)
    bf16, method = media.enlarge(v["bf16"], f), media.enlarge(method, f)
    shown = trace_of(traced, run_id)
    if shown is not None:
        x, y = (integer(c, "pixel") for c in shown["pixel"])
        bf16, method = (media.mark_pixel(img, x, y, f) for img in (bf16, method))
        notes.append(f"yellow square: the traced pixel ({x}, {y})")
    return {"status": ", ".join(notes) + ".", "bf16": bf16, "method": method, "frame": v["frame"],
            "scale": np.concatenate(bars) if bars else None}


def overlay_scale(heat: np.ndarray) -> float:
    """What shows full colour on an overlay: the frame's own 99th percentile (a fixed scale left a frame whose
    flicker is small nearly untinted, and one outlier pixel would wash out the rest)."""
    return float(np.percentile(heat, 99)) if heat.size else 0.0


def trace_pixel_handler(runs, run_id, frame, x, y, layer="all", head="all") -> dict:
    """Twin of the click: trace frame pixel (x, y) (0..63) of `frame` to its Query's top-1 cached source, in the
    layer and head of the page's one picker ("all": the first whose top-1 moved at this Query; the status and
    the result say which)."""
    try:
        for name, val in (("frame", frame), ("x", x), ("y", y)):
            if val is None or val == "":
                raise ValueError(f"no {name} given")
        r = runs.view(run_id).pixel_trace(*(integer(v, n) for n, v in (("frame", frame), ("x", x), ("y", y))),
                                          _choice(layer, "layer"), _choice(head, "head"))
    except ValueError as e:
        return error(str(e))
    layer, head = r["layer"], r["head"]
    key_method = r["method"]
    grid = r["grid"][0]
    cell = r["frames"].shape[1] // grid
    t, row, col = r["query"]
    eb, em = r["source_bf16"], r["source_method"]

    def thumb(src, color):
        f, rr, cc = src
        return media.label(media.draw_box(media.enlarge(r["frames"][f], THUMB), rr, cc, cell * THUMB, color, 2),
                           f"frame {f}")

    verdict = "**jumped**: quantized keys fetch a different token" if r["jumped"] else "same source: no jump"
    from quantwm.evaluation.diagnostics import trace_margins

    mg = trace_margins(r["logits_bf16"], r["logits_method"], eb, r["grid"])
    picked = f"; {r['picked']}" if r["picked"] else ""
    status = (f"Query frame {t}, row {row}, col {col} (layer {layer}, head {head}{picked}) — BF16 source: frame {eb[0]}, "
              f"row {eb[1]}, col {eb[2]}; {key_method} source: frame {em[0]}, row {em[1]}, col {em[2]} — {verdict}. "
              f"Logit margin (top-1 minus runner-up): BF16 {mg['margin_bf16']:.3f}, {key_method} "
              f"{mg['margin_method']:.3f}; the BF16 source ranks {mg['bf16_source_rank']} under {key_method}'s keys.")
    return {"status": status, "query_image": thumb(r["query"], media.YELLOW),
            "bf16_source": thumb(eb, media.YELLOW), "method_source": thumb(em, media.RED),
            "figure": plots.logit_heatmaps_figure(r["logits_bf16"], r["logits_method"], eb, em, key_method, grid),
            "result": {"run": str(run_id), "frame": integer(frame, "frame"), "pixel": [integer(x, "x"), integer(y, "y")],
                       "query": list(r["query"]), "layer": int(layer), "head": int(head),
                       "source_bf16": list(eb), "source_method": list(em), "jumped": bool(r["jumped"]), **mg}}


def click_pixel_handler(runs, run_id, frame, index, layer="all", head="all") -> dict:
    """A click at `index` = (x, y) on the enlarged frame image: the trace of that frame pixel."""
    if not index or len(index) != 2:
        return error("no pixel clicked")
    try:
        f = factor_for(runs.frame_size(run_id))
        x, y = integer(index[0], "x") // f, integer(index[1], "y") // f
    except ValueError as e:
        return error(str(e))
    return {**trace_pixel_handler(runs, run_id, frame, x, y, layer, head), "pixel": (x, y)}


def energy_handler(runs, run_id, layer=0) -> dict:
    """Eigen spectrum and cumulative energy of the history-Query second moment, per head; top-8 table."""
    try:
        spectra = runs.view(run_id).energy()
        layer = integer(layer, "layer")
        if not 0 <= layer < len(spectra):
            raise ValueError(f"layer {layer} out of range: the model has {len(spectra)} layers")
    except ValueError as e:
        return error(str(e))
    H = len(spectra[0]["top_fraction"])
    rows = [[l, *[round(float(s["top_fraction"][h]), 4) for h in range(H)]] for l, s in enumerate(spectra)]
    best = max((v, l, h) for l, row in enumerate(rows) for h, v in enumerate(row[1:]))
    return {"status": f"Run **{run_id}**: the top 8 of {spectra[0]['eigenvalues'].shape[1]} eigen-directions hold "
                      f"up to {best[0]:.1%} of the query energy (layer {best[1]}, head {best[2]}); the paper reports "
                      ">71% in one LingBot-World-v2 layer.",
            "figure": plots.energy_figure(spectra, layer), "header": ["layer", *[f"head {h} top-8" for h in range(H)]],
            "rows": rows}


def budget_value(value) -> float:
    """A budget from the page or the API: a number of bits per element in (0, 16]."""
    from quantwm.core.quant import check_budget

    try:
        b = float(value)
    except (TypeError, ValueError):
        b = None
    return check_budget(b, shown=value)


def exported(paths) -> dict:
    """An export's outputs: its status line and the files written."""
    return {"status": f"{len(paths)} file(s): {', '.join(os.path.basename(p) for p in paths)}",
            "files": [str(p) for p in paths]}


def trace_of(traced, run_id) -> dict | None:
    """The trace panel's result (`trace_pixel_handler`'s "result") when it is a trace of run `run_id`, else None:
    a view, or an export, of one run never shows another run's trace."""
    if isinstance(traced, dict) and traced.get("frame") is not None and traced.get("run") == str(run_id or ""):
        return traced
    return None


def export_handler(runs, run_id, frame, layer="all", head="all", formats=("pdf",), traced=None) -> dict:
    """Print figures (matplotlib) of what the Generate tab shows of the current run, built-in or opened: its
    per-frame plot; the maps of the slider's `frame` with the jump map of `layer` and `head` (the page's
    layer/head picker; "all" or an index); and the trace panel's trace (`traced`, its result: frame, pixel, layer, head)
    when it is one of this run, none otherwise. Every file name says the run and what it draws."""
    from quantwm.drivers.run_figures import run_figures

    try:
        run_id = str(run_id or "")
        if frame is None or frame == "":
            raise ValueError("no frame given")
        t = integer(frame, "frame")
        view = runs.view(run_id)  # generated (not evicted) or opened?
        view.check_frame(t)
        out = app_files().export_dir("run")
        paths = run_figures(runs, run_id, out, ["frames", "maps"], list(formats or []), frame=t,
                            map_layer=_choice(layer, "layer"), map_head=_choice(head, "head"))
        shown = trace_of(traced, run_id)
        if shown is not None:
            x, y = shown["pixel"]
            paths += run_figures(runs, run_id, out, ["trace"], list(formats or []), frame=integer(shown["frame"], "frame"),
                                 pixel=[integer(x, "x"), integer(y, "y")], layer=integer(shown["layer"], "layer"),
                                 head=integer(shown["head"], "head"))
    except (ValueError, TypeError) as e:
        return error(str(e))
    return exported(paths)


def export_energy_handler(runs, run_id, layer=0, formats=("pdf",)) -> dict:
    """The Query-energy tab's spectra of `layer` as a print figure (its file name says the run and the layer)."""
    from quantwm.drivers.run_figures import run_figures

    try:
        run_id = str(run_id or "")
        layers = runs.view(run_id).model_facts()["layers"]
        li = integer(layer, "layer")
        if not 0 <= li < layers:
            raise ValueError(f"layer {li} out of range: the model has {layers} layers")
        paths = run_figures(runs, run_id, app_files().export_dir("energy"), ["energy"], list(formats or []), layer=li)
    except (ValueError, TypeError) as e:
        return error(str(e))
    return exported(paths)
