"""Print figures of one run (`quantwm figures`, the app's Export): the kinds of `evaluation.figures`, drawn from
the run's views and saved as PNG, PDF or SVG.

    paths = run_figures(RunRegistry(Workbench()), RunKey(seed=0, method="quantwm"), "figs", ["frames", "maps"], ["pdf"])
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..evaluation import figures as FG
from . import studies
from .runs import RunKey


def run_figures(runs, key: RunKey | str, out_dir: str | Path, kinds: list[str], formats: list[str],
                frame: int | None = None, pixel: list[int] | None = None, layer: int = 1, head: int = 0,
                methods: list[str] = (), progress: Callable | None = None, map_layer: int | None = None,
                map_head: int | None = None) -> list[Path]:
    """Write the chosen figure kinds of a run: `key` a RunKey (generated, or reused, with the registry's
    Workbench) or the id of a run the registry `runs` shows (generated or opened: every kind but "methods").
    `layer`, `head`: the trace's and the energy spectra's; `map_layer`, `map_head`: the maps' top-1 jump map
    (None: every layer or head). File names say what is drawn: the run, and for maps and traces the frame,
    pixel, layer and head."""
    unknown = [k for k in kinds if k not in FG.FIGURE_KINDS]
    if unknown or not kinds:
        raise ValueError(f"unknown figure kind {(unknown or ['(none)'])[0]!r}; choose from {', '.join(FG.FIGURE_KINDS)}")
    FG.check_formats(formats)  # before any work
    built_in = isinstance(key, RunKey)
    cmp = studies.compare(runs.wb, key, progress) if built_in else None  # generated now, or reused
    view = runs.view(key.id if built_in else key)
    facts, cmp = view.model_facts(), cmp or view.compare()
    ctx = facts["context_frames"]
    worst = [t + ctx for t in cmp["worst"]]
    t = frame if frame is not None else (worst[0] if worst else ctx)
    size = facts["frame_size"]
    x, y = pixel if pixel is not None else (size // 2, size // 2)
    out, paths = Path(out_dir), []
    for kind in kinds:
        if kind == "methods" and not (methods and built_in):
            continue
        fig, name = _figure(runs, view, kind, key, cmp, worst, t, (x, y), layer, head, methods, (map_layer, map_head))
        paths += FG.save_figure(fig, out / name, formats)
    return paths


def _figure(runs, view, kind: str, key, cmp: dict, worst: list, t: int, pixel: tuple, layer: int, head: int,
            methods: list[str], map_scope: tuple = (None, None)):
    """One kind's figure and its file name."""
    run_id, ctx = view.id, view.context_frames
    name = f"{kind}-{_file_tag(run_id)}"
    if kind == "frames":
        return FG.frame_series_figure(cmp["series"], worst, ctx, run_id), name
    if kind == "maps":
        ml, mh = map_scope
        scope = f"layer{'all' if ml is None else ml}-head{'all' if mh is None else mh}"
        return (FG.maps_figure(view.frame_view(t, ml, mh), f"{run_id}, frame {t}, jumps of {scope}"),
                f"{name}-frame{t}-{scope}")
    if kind == "trace":
        x, y = pixel
        r = view.pixel_trace(t, x, y, layer, head)
        fig = FG.logit_heatmaps_figure(r["logits_bf16"], r["logits_method"], r["source_bf16"], r["source_method"],
                                       r["method"], r["grid"][1],
                                       f"query frame {t}, pixel ({x}, {y}), layer {layer}, head {head}")
        return fig, f"{name}-frame{t}-x{x}-y{y}-layer{layer}-head{head}"
    if kind == "energy":
        return FG.energy_figure(view.energy(), layer, title=run_id), f"{name}-layer{layer}"
    rows = studies.methods_table(runs.wb, key, list(methods))
    at = f"{key.bits}-bit" if key.budget is None else f"within {key.budget:g} bits per element"
    amount = f"{key.bits}bit" if key.budget is None else f"budget{key.budget:g}"
    fig = FG.bars_figure(rows, "method", ["psnr", "shift_rate", "warp_error", "span_bits_per_element"],
                         f"{len(rows)} methods {at}: seed {key.seed}, {key.trajectory}, target {key.target}")
    return fig, f"methods-{'-'.join(r['method'] for r in rows)}-seed{key.seed}-{key.trajectory}-{key.target}-{amount}"


def _file_tag(run_id: str) -> str:
    """A run id as a file-name part: "seed=3 loop kivi kv 2-bit 32f" -> "seed3-loop-kivi-kv-2bit-32f"."""
    keep = "".join(ch if ch.isalnum() or ch in ".+-" else "-" for ch in run_id.replace("=", "").replace("-bit", "bit"))
    return "-".join(part for part in keep.split("-") if part)
