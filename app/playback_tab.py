"""Generate & play tab: BF16 and up to two methods' runs side by side (method A and method B, as the paper's
demo page plays BF16, QVG and QuantWM), played in lockstep, frame scrubbing, one per-frame plot of both methods,
overlays and exports of the run clicked, and click-a-pixel attention tracing under every shown method's keys.
Layout and wiring only; the handlers come from app.world_handlers, the opened and live runs' panels from
app/playback_runs.py."""
from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import gradio as gr

from quantwm.core.cache import TARGETS
from quantwm.world.scene import TRAJECTORIES, WORLDS

from .playback_runs import ALL, live_panel, open_run_panel, then_show_frame, wire_live, wire_open_run
from .ui import VIEW, Number, NumberChoice, Slider, number_choices, progress_callback, unpack
from .world_handlers import DEFAULT_BUDGET, FACTOR, NO_METHOD, OVERLAYS, SIZINGS, trace_of

# The world the page opens on: the place world (one held-out photograph whole, the camera moving over it) of seed
# 6, the cameraman, whose 32-frame loop starts on his face. A choice of what to show first, not of any result.
DEFAULT_WORLD, DEFAULT_SEED = "place", 6
# The methods it opens on, each within the budget by its own rule: the paper's demo page plays these two beside BF16.
DEFAULT_METHOD, DEFAULT_METHOD_B = "quantwm", "qvg"

TARGET_CHOICES = [("Keys and Values", "kv"), ("Keys only", "k"), ("Values only", "v")]
# The page opens on equal memory: every method configured within one budget by its own rule (quantwm/core/budget.py);
# fixed bits per element are the explicit other mode (a grid's "2-bit" stores from 2.5 to over 16 bits per element).
SIZING_CHOICES = [("Equal memory: a budget", "budget"), ("Fixed bits", "bits")]
# Why the pre-RoPE methods are not in the list (Workbench.methods): said where a user looks for them.
METHOD_INFO = ("kivi-pre quantizes keys before RoPE, which the built-in model's world-coordinate RoPE does not "
               "allow: compare it on a trace (Trace analysis)")
METHOD_B_INFO = "played beside method A, from the same world and noise; none: method A alone against BF16"
WORLD_INFO = "place: one held-out photograph, the camera moving over it; photo: a mosaic of them; procedural"
assert {v for _, v in TARGET_CHOICES} == set(TARGETS)
assert tuple(v for _, v in SIZING_CHOICES) == SIZINGS


def build_playback_tab(generate: Callable, scrub: Callable, trace_pixel: Callable, click_pixel: Callable,
                       export: Callable, methods: list[str], facts: dict, figure_formats: tuple,
                       default_frames: int = 32, max_frames: int | None = None, open_run: Callable | None = None,
                       opened: list[str] = (), live: dict | None = None) -> dict:
    """Build the tab; returns the shared controls (seed, world, trajectory, method, method_b, target, bits, frames,
    run_id: method A's run, run_b: method B's, and the frame slider).

    generate(seed, trajectory, method, target, bits, frames, budget, sizing, progress=, world=, method_b=);
    scrub(run_id, frame, overlays, layer, head, traced, run_b, maps); trace_pixel(run_id, frame, x, y, layer, head,
    run_b, maps); click_pixel(run_id, frame, index, layer, head, run_b, maps): `maps` "A" or "B" picks the run whose
    maps and trace they show; export(run_id, frame, layer, head, formats, traced, run_b, maps) -> {status, files}:
    print figures of what the tab shows of that run (the slider frame's maps with the picked layer and head, the
    trace panel's trace when it is of this run);
    open_run(path or opened run id, files=, run_b=) -> the same outputs as generate, for a run file (`quantwm
    record`), another opened run beside it as method B; `opened`: the ids of run files opened at start-up (`--run`);
    live: {"kind", "device", "latent_frames", "generate"(embeddings, seed, method, target, bits, latent_frames, prompt, progress)}: a real
    model loaded for generating on demand (`python app.py --model self-forcing`), or None."""
    gr.Markdown("Pick a world and up to two quantization methods, press **Generate**: the BF16 reference and each "
                "method's run use the same world, trajectory and noise, so they differ only by the KV cache, and "
                "they play side by side in lockstep. Methods are compared at equal memory by default: each "
                "configures itself within the budget (bits per element, counted from stored bytes) by its own rule; "
                "a run over its budget or over BF16's bytes is flagged OVER. Click a pixel of any frame to trace its "
                "Query to the cached token it attends to most, under BF16's keys and each method's.")
    ui = _settings(methods, facts, default_frames, max_frames)
    if open_run is not None:
        open_run_panel(ui, opened)
    if live is not None:
        live_panel(ui, live)
    _frames_panel(ui, facts, default_frames)
    _trace_panel(ui, facts)
    _export_panel(ui, figure_formats)
    ui.views_of = _views_of(ui, trace_of)
    shown = _wire_generate(ui, generate, scrub, facts, rerun_pickers=open_run is not None or live is not None)
    if open_run is not None:
        wire_open_run(ui, open_run, opened, shown)
    if live is not None:
        wire_live(ui, live, shown)
    _wire_views(ui, scrub, trace_pixel, click_pixel, export)
    return {n: getattr(ui, n) for n in ("seed", "world", "trajectory", "method", "method_b", "target", "bits", "frames",
                                        "run_id", "run_b", "frame")}


GEN_NAMES = ["status", "run_id", "bf16_video", "method_video", "figure", "frame_slider"]
SCRUB_NAMES = ["status", "bf16", "method"]
# the trace panel's outputs; the result stays the last (API clients read it as the last output)
TRACE_NAMES = ["status", "query_image", "bf16_source", "method_source", "figure", "other_source", "result"]
PICKER_INFO = ("the jump map and the pixel trace; 'all': the jump map over every layer and head, the trace in the "
               "first whose top-1 moved at the pixel")
MAPS_INFO = "the run whose overlays, trace heatmaps and exports are shown: clicking a method's frame picks it"
BITS = (2, 3, 4, 8)  # the fixed-bits mode's grids
VIDEO_KW = dict(autoplay=False, loop=True, height=300, min_width=200)


# ---- layout -------------------------------------------------------------------------------------------
def _settings(methods: list[str], facts: dict, default_frames: int, max_frames: int | None) -> SimpleNamespace:
    """The runs' settings, Generate and the current runs' ids."""
    ui = SimpleNamespace()
    with gr.Row():
        ui.seed = Number(DEFAULT_SEED, label="World seed (0..99999, held-out photographs)", elem_id="seed")
        ui.world = gr.Dropdown(list(WORLDS), value=DEFAULT_WORLD, label="World", info=WORLD_INFO, elem_id="world")
        ui.trajectory = gr.Dropdown(list(TRAJECTORIES), value="loop", label="Trajectory")
        ui.method = gr.Dropdown(methods, value=DEFAULT_METHOD, label="Method A", info=METHOD_INFO, elem_id="method-a")
        ui.method_b = gr.Dropdown([NO_METHOD, *methods], value=DEFAULT_METHOD_B, label="Method B", info=METHOD_B_INFO,
                                  elem_id="method-b")
        ui.target = gr.Radio(TARGET_CHOICES, value="kv", label="Quantize")
        ui.sizing = gr.Radio(SIZING_CHOICES, value="budget", label="Memory", elem_id="sizing")
        ui.budget = Number(DEFAULT_BUDGET, label="Budget (bits per element; each method by its rule)", step=0.25,
                           elem_id="budget")
        ui.bits = NumberChoice(number_choices(BITS), value="2", label="Bits (fixed-bits mode)", interactive=False,
                               elem_id="bits")
        ui.frames = Number(default_frames, label=f"Frames (at most {max_frames})" if max_frames else "Frames",
                           step=facts["chunk_frames"], elem_id="frames")
    with gr.Row():
        ui.go = gr.Button("Generate", variant="primary", elem_id="generate-btn")
        ui.run_id = gr.Textbox(label="Current run (method A)", interactive=False, elem_id="run-id")
        ui.run_b = gr.Textbox(label="Method B's run (empty: none)", interactive=False, elem_id="run-id-b")
    return ui


def _frames_panel(ui: SimpleNamespace, facts: dict, default_frames: int) -> None:
    """The status, the three videos, the per-frame plot, the frame slider with its overlays and the three frames."""
    size = facts["frame_size"]
    ui.status = gr.Markdown(elem_id="generate-status")
    img_kw = dict(format="png", interactive=False, height=size * FACTOR + 2, width=size * FACTOR + 2, buttons=[])
    with gr.Row():
        # the plot needs room for its titles and legend: on a narrow page it wraps below the videos, full width
        ui.bf16_video = gr.Video(label="BF16 (reference)", elem_id="video-bf16", **VIDEO_KW)
        ui.method_video = gr.Video(label="Method A", elem_id="video-method", **VIDEO_KW)
        ui.method_b_video = gr.Video(label="Method B", elem_id="video-method-b", visible=False, **VIDEO_KW)
        ui.plot = gr.Plot(label="Per-frame flicker, PSNR and shift rate of both methods (click a point to jump)",
                          elem_id="frame-plot", min_width=400)
    ui.frame = Slider(0, default_frames - 1, value=0, step=1, label="Frame (scrubs every run)", elem_id="frame-slider")
    with gr.Row():
        ui.overlays = gr.CheckboxGroup(list(OVERLAYS), value=[], label="Overlays on the frame of the run the maps "
                                       "are of, scaled to the frame (red: flicker vs BF16; orange: warping error above "
                                       "BF16's, motion-compensated; cyan: tokens whose top-1 source moved in at least "
                                       "half the chosen layers and heads)")
        ui.maps_of = gr.Radio([("A", "A")], value="A", label="Maps of", info=MAPS_INFO, elem_id="maps-of")
        # one layer/head picker for the jump map and the pixel trace ("all": the map over every layer and head;
        # the trace, the first whose top-1 moved at the pixel, named in its status)
        ui.layer = NumberChoice(number_choices(range(facts["layers"]), ALL), value="all", label="Layer",
                                info=PICKER_INFO, elem_id="pick-layer")
        ui.head = NumberChoice(number_choices(range(facts["heads"]), ALL), value="all", label="Head",
                               elem_id="pick-head")
    ui.frame_info = gr.Markdown(elem_id="frame-info")
    ui.scale = gr.Image(format="png", interactive=False, show_label=False, buttons=[], height=64, width=260,
                        elem_id="overlay-scale", container=False, visible=False)  # the overlays' colour bars
    with gr.Row():
        ui.bf16_img = gr.Image(label="BF16 frame (click a pixel)", elem_id="frame-bf16", **img_kw)
        ui.method_img = gr.Image(label="Method A frame (click a pixel)", elem_id="frame-method", **img_kw)
        ui.method_b_img = gr.Image(label="Method B frame (click a pixel)", elem_id="frame-method-b", visible=False,
                                   **img_kw)
        ui.result = gr.JSON(label="Trace result", elem_id="trace-result", height=280)
    ui.scrub_out = [ui.frame_info, ui.bf16_img, ui.method_img, ui.scale, ui.method_b_img]


def _trace_panel(ui: SimpleNamespace, facts: dict) -> None:
    """The pixel trace: layer, head and pixel, the query and the sources' thumbnails, the logit heatmaps."""
    size = facts["frame_size"]
    with gr.Accordion("Pixel trace: Query → top-1 cached source", open=True):
        with gr.Row():
            ui.px = Number(size // 2, label=f"x (0..{size - 1})")
            ui.py = Number(size // 2, label=f"y (0..{size - 1})")
            ui.trace_btn = gr.Button("Trace pixel", elem_id="trace-btn")
        ui.trace_status = gr.Markdown(elem_id="trace-status")
        with gr.Row():
            # captions above the thumbnails, not Gradio's label badge on them: a source in the top rows stays visible
            thumb_kw = dict(format="png", interactive=False, height=size * 2 + 2, width=size * 2 + 2, buttons=[],
                            show_label=False)
            thumbs = []
            for caption, elem in (("Query (yellow)", "trace-query"), ("Top-1 source, BF16 keys (yellow)", "trace-src-bf16"),
                                  ("Top-1 source, the traced method's keys (red)", "trace-src-method"),
                                  ("Top-1 source, the other method's keys (magenta)", "trace-src-other")):
                with gr.Column(min_width=size * 2 + 2):
                    gr.Markdown(f"**{caption}**", elem_id=f"{elem}-caption")
                    thumbs.append(gr.Image(label=caption, elem_id=elem, **thumb_kw))
        ui.heatmap = gr.Plot(label="Attention logits over the cache (frames x positions) of the traced method",
                             elem_id="trace-heatmap")
    ui.trace_out = [ui.trace_status, *thumbs[:3], ui.heatmap, thumbs[3], ui.result]


def _export_panel(ui: SimpleNamespace, figure_formats: tuple) -> None:
    with gr.Accordion("Export figures for print (matplotlib) of the run the maps are of: the per-frame plot, the "
                      "maps of the slider's frame (layer and head as picked), the trace panel's logit heatmaps",
                      open=False):
        with gr.Row():
            ui.export_formats = gr.CheckboxGroup(list(figure_formats), value=["pdf"], label="Formats")
            ui.export_btn = gr.Button("Export figures of this run", elem_id="export-btn")
        ui.export_status = gr.Markdown(elem_id="export-status")
        ui.export_files = gr.File(label="Figures", file_count="multiple", interactive=False, elem_id="export-files")


# ---- events -------------------------------------------------------------------------------------------
# Every event's function names its parameters as an API user would guess them (gradio_client shows them).
def _wire_generate(ui: SimpleNamespace, generate: Callable, scrub: Callable, facts: dict,
                   rerun_pickers: bool) -> Callable:
    """Generate, then the frame it lands on; returns `shown` (a comparison's outputs on the page)."""
    labels: dict[str, str] = {}  # run id -> its method's label ("kivi within 2.5 bits, spans 2.50 bits/element")
    ui.scrub_in = [ui.run_id, ui.frame, ui.overlays, ui.layer, ui.head, ui.result, ui.run_b, ui.maps_of]
    # the API's first six outputs are those it had before method B
    ui.gen_out = [ui.status, ui.run_id, ui.bf16_video, ui.method_video, ui.plot, ui.frame, ui.run_b,
                  ui.method_b_video, ui.maps_of]
    ui.pickers = [ui.layer, ui.head, ui.px, ui.py]

    def shown(r):
        """A comparison on the page: the slider sized to it, each method's panels labelled with what they show,
        method B's video shown or hidden, the maps on method A."""
        if not r.get("run_id"):
            return (*unpack(r, GEN_NAMES), gr.skip(), gr.skip(), gr.skip())
        if r.get("frames"):
            r["frame_slider"] = gr.Slider(minimum=0, maximum=r["frames"] - 1, value=r["frame"], step=1)
        if r.get("method_video") and r.get("method_label"):
            r["method_video"] = gr.Video(value=r["method_video"], label=r["method_label"])
        b = r["run_b"]
        labels.update({r["run_id"]: r.get("method_label"), **({b: r["method_b_label"]} if b else {})})
        while len(labels) > 256:  # the labels of recent runs only
            labels.pop(next(iter(labels)), None)
        maps = [(f"A: {r.get('method_label') or r['run_id']}", "A")] + ([(f"B: {r['method_b_label']}", "B")] if b else [])
        return (*unpack(r, GEN_NAMES), b,
                gr.Video(value=r["method_b_video"], label=r["method_b_label"], visible=True) if b else
                gr.Video(value=None, visible=False), gr.Radio(choices=maps, value="A"))

    def do_scrub(run_id, frame, overlays, layer, head, traced=None, run_b=None, maps="A"):
        """traced: the trace panel's result; its pixel is marked on every frame when it is a trace of a run shown.
        run_b: method B's run (None or "": none); maps: "A" or "B", the run whose overlays are drawn. The fourth output is
        the overlays' colour bars (emptied when no overlay tints the frame), the fifth method B's frame."""
        r = scrub(run_id, frame, overlays, layer, head, traced, run_b, maps)
        if r.get("bf16") is None:
            return (*unpack(r, SCRUB_NAMES), gr.skip(), gr.skip())
        scale, b = r.get("scale"), r.get("method_b")
        return (*unpack(r, SCRUB_NAMES), gr.update(value=scale, visible=scale is not None),
                gr.update(value=b, visible=b is not None))

    def frame_label(run_id, run_b=None):
        """Each method's frame panel named after the run shown."""
        a, b = labels.get(str(run_id or "")), labels.get(str(run_b or ""))
        return (gr.Image(label=f"A: {a} (click a pixel)" if a else "Method A frame (click a pixel)"),
                gr.Image(label=f"B: {b} (click a pixel)" if b else "Method B frame (click a pixel)"))

    def on_generate(seed, trajectory, method, target, bits, frames, budget=DEFAULT_BUDGET, sizing="budget",
                    world=DEFAULT_WORLD, method_b=DEFAULT_METHOD_B, progress=gr.Progress()):
        """sizing "budget": every method within `budget` bits per element (in (0, 16]); "bits": a fixed grid of
        `bits`, the budget unused. world: the world kind; method_b: the method played beside `method` ("none")."""
        r = generate(seed, trajectory, method, target, bits, frames, budget, sizing,
                     progress=progress_callback(progress, "generating BF16 and the methods"), world=world,
                     method_b=method_b)
        return shown(r)

    def on_sizing(sizing):
        return gr.update(interactive=sizing == "budget"), gr.update(interactive=sizing == "bits")

    ui.sizing.change(on_sizing, [ui.sizing], [ui.budget, ui.bits], api_name=False, queue=False)
    ui.do_scrub, ui.frame_label = do_scrub, frame_label
    settings = [ui.seed, ui.trajectory, ui.method, ui.target, ui.bits, ui.frames, ui.budget, ui.sizing, ui.world,
                ui.method_b]
    ev = ui.go.click(on_generate, settings, ui.gen_out, api_name="generate", trigger_mode="multiple",
                     concurrency_limit=1, concurrency_id="generate")
    then_show_frame(ui, ev, api_name="show_frame")
    if rerun_pickers:
        ev.then(_builtin_pickers(facts), [ui.run_id], ui.pickers, api_name=False, **VIEW)
    return shown


def _builtin_pickers(facts: dict) -> Callable:
    size = facts["frame_size"]

    def builtin_pickers(run_id):
        """Back to the built-in model's layers, heads and frame size after a generated run (if another run
        changed them)."""
        if not str(run_id or "").startswith("seed="):
            return (gr.skip(),) * 4
        return (gr.Dropdown(choices=number_choices(range(facts["layers"]), ALL)),
                gr.Dropdown(choices=number_choices(range(facts["heads"]), ALL)),
                gr.Number(size // 2, label=f"x (0..{size - 1})"), gr.Number(size // 2, label=f"y (0..{size - 1})"))
    return builtin_pickers


def _wire_views(ui: SimpleNamespace, scrub: Callable, trace_pixel: Callable, click_pixel: Callable,
                export: Callable) -> None:
    """Scrubbing, clicking or tracing a pixel, exporting figures."""
    gr.on([ui.frame.change, ui.overlays.change, ui.layer.change, ui.head.change, ui.maps_of.input], ui.do_scrub,
          ui.scrub_in, ui.scrub_out, api_name="scrub", trigger_mode="always_last", **VIEW)

    def clicked(run_id, frame, layer, head, run_b, maps, index, picks):
        """A click's trace in the run `maps` picks; the maps move to that run when `picks` (a method's frame)."""
        r = click_pixel(run_id, frame, index, layer, head, run_b, maps)
        x, y = r.get("pixel", (None, None))
        ok = r.get("result") is not None
        return (*_trace_outputs(r), x if x is not None else gr.skip(), y if y is not None else gr.skip(),
                maps if ok and picks else gr.skip())

    def click_pixel_a(run_id, frame, layer, head, run_b=None, evt: gr.SelectData = None):
        """A click on method A's frame: its trace (method B's source named too); the maps move to method A."""
        return clicked(run_id, frame, layer, head, run_b, "A", evt.index, True)

    def click_pixel_b(run_id, frame, layer, head, run_b=None, evt: gr.SelectData = None):
        """A click on method B's frame: its trace (method A's source named too); the maps move to method B."""
        return clicked(run_id, frame, layer, head, run_b, "B", evt.index, True)

    def click_pixel_bf16(run_id, frame, layer, head, run_b=None, maps="A", evt: gr.SelectData = None):
        """A click on BF16's frame: the trace in the run the maps are of."""
        return clicked(run_id, frame, layer, head, run_b, maps, evt.index, False)

    outputs = [*ui.trace_out, ui.px, ui.py, ui.maps_of]
    pair = [ui.run_id, ui.frame, ui.layer, ui.head, ui.run_b]
    for img, fn, name, inputs in ((ui.method_img, click_pixel_a, "click_pixel", pair),
                                  (ui.method_b_img, click_pixel_b, "click_pixel_b", pair),
                                  (ui.bf16_img, click_pixel_bf16, "click_pixel_bf16", [*pair, ui.maps_of])):
        img.select(fn, inputs, outputs, api_name=name, **VIEW).then(
            ui.do_scrub, ui.scrub_in, ui.scrub_out, api_name=False, **VIEW)

    def do_trace(run_id, frame, x, y, layer, head, run_b=None, maps="A"):
        return _trace_outputs(trace_pixel(run_id, frame, x, y, layer, head, run_b, maps))

    ui.trace_btn.click(do_trace, [ui.run_id, ui.frame, ui.px, ui.py, ui.layer, ui.head, ui.run_b, ui.maps_of],
                       ui.trace_out, api_name="trace_pixel", **VIEW).then(  # the traced pixel marked on the frames
        ui.do_scrub, ui.scrub_in, ui.scrub_out, api_name=False, **VIEW)

    def do_export(run_id, frame, layer, head, formats, traced=None, run_b=None, maps="A"):
        """What the tab shows of the run the maps are of: its plot, the slider frame's maps (the picked layer and
        head), the panel's trace."""
        r = export(run_id, frame, layer, head, formats, traced, run_b, maps)
        return r["status"], r.get("files")

    ui.export_btn.click(do_export, [ui.run_id, ui.frame, ui.layer, ui.head, ui.export_formats, ui.result, ui.run_b,
                                    ui.maps_of], [ui.export_status, ui.export_files], api_name="export_figures", **VIEW)


def _trace_outputs(r: dict) -> tuple:
    """The trace panel's outputs; an error empties the panel below its Error line (no other trace stays under it),
    a trace with no other method shown empties the other method's thumbnail."""
    if r.get("result") is None:
        return (r["status"], *(None,) * (len(TRACE_NAMES) - 1))
    return (*unpack(r, TRACE_NAMES[:5]), r.get("other_source"), r["result"])


def _views_of(ui: SimpleNamespace, trace_of: Callable) -> Callable:
    """After runs are shown: the trace panel and the exports of another run are emptied (their views belong to
    the run they were made of); the panel's trace of a run still shown stays."""
    def views_of(run_id, traced, run_b=None):
        if not run_id or trace_of(traced, run_id) is not None or (run_b and trace_of(traced, run_b) is not None):
            return (gr.skip(),) * len(ui.views_out)
        return (f"Run **{run_id}**: click a pixel of any frame to trace its Query.", *(None,) * (len(ui.trace_out) - 1),
                "", None)

    ui.views_out = [*ui.trace_out, ui.export_status, ui.export_files]
    return views_of
