"""Handlers of the world-model tabs: plain values in, a dict of plain values out (no torch, no gradio).

Every handler takes the run registry first (`quantwm.drivers.registry.RunRegistry`: every run shown, built-in
or opened, by run id, and the Workbench as `runs.wb`); app/assemble.py binds it. Bad input
never raises: the dict then holds an "**Error:** ..." status and None for every output it leaves alone
(the tabs turn None into "no change"). Anything else that goes wrong inside a handler (`guarded`) also
ends in a message, with the traceback on the server's stderr: the app stays up for everyone.

The Generate tab shows BF16 and up to two methods' runs against it side by side: method A's run (`run_id`) and
method B's (`run_b`, "" when none); the views take both, and `maps` ("A" or "B") names the one whose maps,
pixel trace and exports they show. The pixel-trace handlers live in app/trace_handlers.py and the Memory
control's helpers in app/sizing.py; both are re-exported here with the tab's other handlers.

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
from .media import factor_for
from .sizing import DEFAULT_BUDGET, SIZINGS, budget_value, memory_flag, sized_budget  # noqa: F401 (re-exported)
from .trace_handlers import THUMB, click_pixel_handler, trace_pixel_handler  # noqa: F401 (re-exported)
from .values import choice, error, integer, name, readable_file, shown_pair

FACTOR = 4  # the built-in model's 64x64 frames are shown enlarged 4x on the server (`factor_for`)
JUMP_SHARE = 0.5  # the top-1 overlay tints a token whose top-1 moved in at least this share of the chosen layers/heads
OVERLAYS = ("flicker map", "warping error", "top-1 jumps")
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


def run_key(seed, trajectory, method, target, bits, frames, world="photo"):
    """The `RunKey` of request values, each checked (ValueError naming the control)."""
    from quantwm.drivers.runs import RunKey

    return RunKey(integer(seed, "world seed"), name(trajectory, "trajectory"), name(method, "method"),
                  name(target, "target"), integer(bits, "bits"), integer(frames, "frames"),
                  world=name(world, "world"))


def _video(run_id: str, which: str, frames: np.ndarray) -> str:
    return app_files().video(run_id, which, frames, factor_for(frames.shape[1:3]))


def rounded(x, digits=4):
    """A number as a table or summary shows it (None stays None)."""
    return None if x is None else round(float(x), digits)


NO_METHOD = "none"  # method B's choice for no second method (one method against BF16)


def generate_handler(runs, seed, trajectory, method, target, bits, frames, budget=None, sizing=None,
                     progress: Callable | None = None, world="photo", method_b=None) -> dict:
    """Generate (or fetch) BF16 and the method on the `world` kind (`scene.WORLDS`) and, when `method_b` names
    another method ("none", "" or None: none; method A's own name: shown once), method B beside them, from the
    same world and noise: one prefetch makes every rollout missing, two at a time where they fit, its progress
    over all of them. Videos, one per-frame figure of both methods, summaries, the worst frame. `sizing`
    "budget" (the page's default: equal memory for every method): each method configures itself by its rule
    within `budget` bits per element, a number in (0, 16] (0 or none is an error, as is 20); "bits": a fixed
    grid of `bits` (`sized_budget`). The status says what each method chose and flags a run over its budget or
    over BF16's bytes (`memory_flag`, as the Methods table does); a run over its budget is never said to be
    within it. A method B that cannot run (it cannot fit the budget here, or its run would not fit in the results
    cache beside the others) is left out, the status saying why."""
    from dataclasses import replace

    from quantwm.drivers import studies

    wb = runs.wb
    try:
        key = run_key(seed, trajectory, method, target, bits, frames, world)
        b = sized_budget(budget, sizing)
        if b is not None:
            key = replace(key, budget=b)
        other = NO_METHOD if method_b in (None, "") else name(method_b, "method B")
        key_b = None if other in (NO_METHOD, key.method) else replace(key, method=other)  # validates the name
        wb.check_frames(key.frames)
        note = f"Method B is method A ({other}): shown once." if other == key.method else ""
        if key_b is not None:
            try:  # both methods' runs and BF16 held in the results cache at once, as a Methods table's
                wb.limits.check_methods(2, key.frames)
            except ValueError as e:
                key_b, note = None, f"Method B, {other}, is left out: {e}"
        keys = [k for k in (key, key_b) if k is not None]
        cached = all(wb.cached(k) and wb.cached(k.reference()) for k in keys)
        start = time.perf_counter()
        failed = wb.prefetch(keys, progress)  # BF16 and both methods, side by side
        if key in failed or key.reference() in failed:
            raise failed.get(key) or failed[key.reference()]
        cmp = studies.compare(wb, key)
        cmp_b = None if key_b is None or key_b in failed else studies.compare(wb, key_b)
        seconds = time.perf_counter() - start  # this request's wall time, waits and every rollout included
    except ValueError as e:
        return error(str(e))
    origin = "from the cache" if cached else f"generated in {seconds:.1f} s"
    if key_b is not None and cmp_b is None:
        note = f"Method B, {key_b.method}, is left out: {str(failed[key_b]).splitlines()[0]}"
    return _shown(wb.model_facts()["context_frames"], _built_in(wb, key, cmp, origin),
                  None if cmp_b is None else _built_in(wb, key_b, cmp_b, origin), note)


def _built_in(wb, key, cmp: dict, origin: str) -> dict:
    """One built-in method's side of the page (`_shown`): its comparison, and its name with its budget or bits."""
    from quantwm.drivers import studies

    quantized = key.method != "bf16"
    over = quantized and memory_flag(cmp["summary"], key.budget) is not None
    if key.budget is None:
        size = f"{key.bits}-bit"
    else:  # "within" only where the measured spans keep to the budget
        size = f"budget {key.budget:g} bits" if over else f"within {key.budget:g} bits"
    if quantized:
        origin += (f"; fixed {key.bits}-bit grid, no budget" if key.budget is None else
                   f"; configuration {'chosen for a budget of' if over else 'within'} {key.budget:g} bits: "
                   f"{studies.configuration(wb, key)}")
    return {"cmp": cmp, "run_id": key.id, "origin": origin, "name": f"{key.method} {size}", "budget": key.budget,
            "quantized": quantized}


def _shown(ctx: int, a: dict, b: dict | None = None, note: str = "") -> dict:
    """The Generate tab's outputs for method A's comparison `a` and method B's `b` beside it, or none (each a
    `_built_in` or `_opened` side: `RunView.compare`'s numbers, run id, origin, name): the three videos, one
    per-frame figure of both, each method's label ("kivi within 2.5 bits, spans 2.50 bits/element") and its line
    in the status, which names both memory figures (`CacheMemory.summary`) and leads with the flag of a run over
    its budget or over BF16's bytes."""
    cmp = a["cmp"]
    worst_frames = [t + ctx for t in cmp["worst"]]
    flag, status, label = _described(a, ctx)
    out = {"status": status, "run_id": a["run_id"], "bf16_video": _video(a["run_id"], "bf16", cmp["bf16"]),
           "method_label": label, "method_video": _video(a["run_id"], "method", cmp["method"]),
           "frames": len(cmp["bf16"]), "frame": worst_frames[0] if worst_frames else ctx, "worst_frames": worst_frames,
           "summary": {k: rounded(v) for k, v in cmp["summary"].items()}, "over": flag, "run_b": "",
           "method_b_video": None, "method_b_label": None, "summary_b": None, "over_b": None}
    more = ()
    if b is not None:
        flag_b, status_b, label_b = _described(b, ctx, "Method B: ")
        out.update(status=f"{status}\n\n{status_b}", run_b=b["run_id"], method_b_label=label_b, over_b=flag_b,
                   method_b_video=_video(b["run_id"], "method", b["cmp"]["method"]),
                   summary_b={k: rounded(v) for k, v in b["cmp"]["summary"].items()})
        more = ((label_b, b["cmp"]["series"], [t + ctx for t in b["cmp"]["worst"]]),)
    if note:
        out["status"] += f"\n\n{note}"
    out["figure"] = plots.frame_series_figure(cmp["series"], worst_frames, ctx, label=label, more=more)
    return out


def _described(side: dict, ctx: int, lead: str = "") -> tuple[str | None, str, str]:
    """(its OVER flag or None, its status line, its label) of one method's side: its clip numbers against BF16,
    VBench's temporal flickering of its own frames and of BF16's, its memory figures, its worst frames."""
    cmp, s = side["cmp"], side["cmp"]["summary"]
    flag = memory_flag(s, side["budget"]) if side["quantized"] else None
    vb = cmp["vbench_flicker"]
    worst = ", ".join(str(t + ctx) for t in cmp["worst"]) or "none"
    status = (lead + (f"**OVER: {flag}.** " if flag else "") + f"**{side['run_id']}** ({side['origin']}): "
              f"PSNR vs BF16 {s['psnr']:.2f} dB, SSIM {s['ssim']:.4f}, tdiff {s['tdiff']:.4f}, "
              f"VBench flicker {vb['method']:.4f} (BF16 {vb['bf16']:.4f}), top-1 shift rate {s['shift_rate']:.1%}; "
              f"memory (CacheMemory): {cmp['memory']}. {'its worst' if lead else 'Worst'} flicker frames: {worst}.")
    label = f"{side['name']}, spans {s['span_bits_per_element']:.2f} bits/element" + (" OVER" if flag else "")
    return flag, status, label


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


def open_run_handler(runs, path, files: bool = True, run_b=None) -> dict:
    """Open a run file (`quantwm record`; an uploaded file's path, or the id of a run already open) and show it
    like a generated run: videos, per-frame plot, and every view (scrub, overlays, pixel trace, energy).
    `files=False` accepts only ids of opened runs (what the page's run list sends). `run_b`: the id of another
    run (say another method's file recorded from the same noise) shown beside it as method B; it must hold the
    same BF16 frames ("none", "" or None: none)."""
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
        lr, other = runs.pair(run_id, None if run_b in (None, "", NO_METHOD) else str(run_b))
        cmp, cmp_b = lr.compare(), None if other is None else other.compare()
    except (ValueError, TypeError) as e:
        return error(str(e))
    f, meta = lr.facts, lr.run.meta
    shown_layers = {"layers": f.layers, "heads": f.heads, "logit_layers": meta["logit_layers"],
                    "logit_heads": meta["logit_heads"], "frame_hw": tuple(lr.run.bf16.shape[1:3])}
    controls = {"method": meta["method"], "target": meta["target"], "bits": meta["bits"]}
    if f.model == "quantwm built-in world model":  # the same world can be generated again from these
        source = meta["source"]
        controls.update(seed=source["seed"], trajectory=source["trajectory"], frames=source["frames"],
                        world=source.get("world", "photo"))  # files written before worlds were named: photo
    return {**_shown(lr.context_frames, _opened(lr, run_id, cmp), None if other is None else _opened(other, run_b, cmp_b)),
            **shown_layers, "controls": controls}


def _opened(view, run_id: str, cmp: dict) -> dict:
    """One opened run's side of the page (`_shown`): its comparison, the model it came from, its method and bits."""
    f, meta = view.facts, view.run.meta
    origin = (f"opened: {f.model}, latent grid {f.latent_grid[0]}x{f.latent_grid[1]}, {f.pixels_per_token} pixels "
              f"per token, {f.vae_temporal} output frame(s) per latent frame")
    for said in (meta.get("frames_are"), *(meta.get("notes") or ())):  # FastVideo runs: what the frames are
        if isinstance(said, str) and said:
            origin += f"; {said}"
    return {"cmp": cmp, "run_id": run_id, "origin": origin, "name": f"{meta['method']} {meta['bits']}-bit",
            "budget": None, "quantized": True}


def scrub_handler(runs, run_id, frame, overlays=(), layer="all", head="all", traced=None, run_b=None,
                  maps="A") -> dict:
    """BF16's frame `frame`, method A's (run `run_id`) and method B's (run `run_b`, when one is shown: "method_b"),
    enlarged; the chosen overlays on the frame of the run `maps` picks ("A" or "B"), each scaled to this frame
    (`overlay_scale`) and keyed in "scale" (a colour bar per tinted overlay, None when none); the trace panel's
    pixel (`traced`, when a trace of either run) marked on every frame."""
    overlays = list(overlays or [])
    try:
        unknown = [o for o in overlays if o not in OVERLAYS]
        if unknown:
            raise ValueError(f"unknown overlay {unknown[0]!r}; choose from {', '.join(OVERLAYS)}")
        if frame is None:
            raise ValueError("no frame given")
        t = integer(frame, "frame")
        run_id, run_b = str(run_id or ""), str(run_b or "")
        shown_pair(run_id, run_b, maps)  # maps is "A" or "B", B only with a run_b
        view, view_b = runs.pair(run_id, run_b)
        v = (view if maps == "A" else view_b).frame_view(t, choice(layer, "layer"), choice(head, "head"))
        frames = {"A": view.frame(t), "B": None if view_b is None else view_b.frame(t)}
    except ValueError as e:
        return error(str(e))
    frames[maps], notes, bars = _tinted(v, overlays, layer, head)
    notes.insert(1, f"maps of method {maps} ({(view if maps == 'A' else view_b).run.meta['method']})")
    f = factor_for(v["bf16"].shape)
    shown = {k: None if img is None else media.enlarge(img, f) for k, img in {"bf16": v["bf16"], **frames}.items()}
    traced = trace_of(traced, run_id) or (trace_of(traced, run_b) if run_b else None)
    if traced is not None:
        x, y = (integer(c, "pixel") for c in traced["pixel"])
        shown = {k: None if img is None else media.mark_pixel(img, x, y, f) for k, img in shown.items()}
        notes.append(f"yellow square: the traced pixel ({x}, {y})")
    return {"status": ", ".join(notes) + ".", "bf16": shown["bf16"], "method": shown["A"], "method_b": shown["B"],
            "frame": v["frame"], "maps": maps, "scale": np.concatenate(bars) if bars else None}


def _tinted(v: dict, overlays: list, layer, head) -> tuple[np.ndarray, list[str], list[np.ndarray]]:
    """A method's frame (`RunView.frame_view`) with the chosen overlays, the notes that describe the frame and them,
    and a colour bar per tinted overlay."""
    method, scales, bars = v["method"], [], []
    notes = [f"Frame **{v['frame']}**" + (" (context: given, identical in every run)" if v["context"] else ""),
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
    return method, notes, bars


def overlay_scale(heat: np.ndarray) -> float:
    """What shows full colour on an overlay: the frame's own 99th percentile (a fixed scale left a frame whose
    flicker is small nearly untinted, and one outlier pixel would wash out the rest)."""
    return float(np.percentile(heat, 99)) if heat.size else 0.0


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


def export_handler(runs, run_id, frame, layer="all", head="all", formats=("pdf",), traced=None, run_b=None,
                   maps="A") -> dict:
    """Print figures (matplotlib) of what the Generate tab shows of the run its maps are of (method A's `run_id`,
    or, `maps` "B", method B's `run_b`), built-in or opened: its per-frame plot; the maps of the slider's `frame`
    with the jump map of `layer` and `head` (the page's layer/head picker; "all" or an index); and the trace
    panel's trace (`traced`, its result: frame, pixel, layer, head) when it is one of this run, none otherwise.
    Every file name says the run and what it draws."""
    from quantwm.drivers.run_figures import run_figures

    try:
        run_id = shown_pair(run_id, run_b, maps)[0]
        if frame is None or frame == "":
            raise ValueError("no frame given")
        t = integer(frame, "frame")
        view = runs.view(run_id)  # generated (not evicted) or opened?
        view.check_frame(t)
        out = app_files().export_dir("run")
        paths = run_figures(runs, run_id, out, ["frames", "maps"], list(formats or []), frame=t,
                            map_layer=choice(layer, "layer"), map_head=choice(head, "head"))
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
