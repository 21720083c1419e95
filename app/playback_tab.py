"""Generate & play tab: BF16 and a quantized run side by side, frame scrubbing, per-frame plot, overlays,
and click-a-pixel attention tracing. Layout and wiring only; the handlers come from app.world_handlers."""
from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import gradio as gr

from quantwm.core.cache import TARGETS
from quantwm.world.scene import TRAJECTORIES

from .ui import Number, NumberChoice, Slider, number_choices, progress_callback, unpack
from .world_handlers import DEFAULT_BUDGET, FACTOR, OVERLAYS, SIZINGS, trace_of

# The world the page opens on: of seeds 0-15, the one whose first frame has the most detail (pixel standard
# deviation 0.31; seed 0's is a flat sky, 0.09). A choice of what to show first, not of any result.
DEFAULT_SEED = 4

TARGET_CHOICES = [("Keys and Values", "kv"), ("Keys only", "k"), ("Values only", "v")]
# The page opens on equal memory: every method configured within one budget by its own rule (quantwm/core/budget.py);
# fixed bits per element are the explicit other mode (a grid's "2-bit" stores from 2.5 to over 16 bits per element).
SIZING_CHOICES = [("Equal memory: a budget", "budget"), ("Fixed bits", "bits")]
# Why the pre-RoPE methods are not in the list (Workbench.methods): said where a user looks for them.
METHOD_INFO = ("kivi-pre quantizes keys before RoPE, which the built-in model's world-coordinate RoPE does not "
               "allow: compare it on a trace (Trace analysis)")
assert {v for _, v in TARGET_CHOICES} == set(TARGETS)
assert tuple(v for _, v in SIZING_CHOICES) == SIZINGS


def build_playback_tab(generate: Callable, scrub: Callable, trace_pixel: Callable, click_pixel: Callable,
                       export: Callable, methods: list[str], facts: dict, figure_formats: tuple,
                       default_frames: int = 32, max_frames: int | None = None, open_run: Callable | None = None,
                       opened: list[str] = (), live: dict | None = None) -> dict:
    """Build the tab; returns the shared controls (seed, trajectory, method, target, bits, frames, run_id, and the
    frame slider).

    export(run_id, frame, layer, head, formats, traced) -> {status, files}: print figures of what the tab shows
    (the slider frame's maps with the picked layer and head, the trace panel's trace when it is of this run);
    open_run(path or opened run id) -> the same outputs as generate, for a run file (`quantwm record`);
    `opened`: the ids of run files opened at start-up (`--run`);
    live: {"kind", "device", "latent_frames", "generate"(embeddings, seed, method, target, bits, latent_frames, prompt, progress)}: a real
    model loaded for generating on demand (`python app.py --model self-forcing`), or None."""
    gr.Markdown("Pick a world and a quantization method, press **Generate**: the BF16 reference and the "
                "quantized run use the same world, trajectory and noise, so they differ only by the KV cache. "
                "Methods are compared at equal memory by default: each configures itself within the budget (bits "
                "per element, counted from stored bytes) by its own rule; a run over its budget or over BF16's "
                "bytes is flagged OVER. "
                "Click a pixel of either frame to trace its Query to the cached token it attends to most.")
    ui = _settings(methods, facts, default_frames, max_frames)
    if open_run is not None:
        _open_run_panel(ui, opened)
    if live is not None:
        _live_panel(ui, live)
    _frames_panel(ui, facts, default_frames)
    _trace_panel(ui, facts)
    _export_panel(ui, figure_formats)
    ui.views_of = _views_of(ui, trace_of)
    shown = _wire_generate(ui, generate, scrub, facts, rerun_pickers=open_run is not None or live is not None)
    if open_run is not None:
        _wire_open_run(ui, open_run, opened, shown)
    if live is not None:
        _wire_live(ui, live, shown)
    _wire_views(ui, scrub, trace_pixel, click_pixel, export)
    return {n: getattr(ui, n) for n in ("seed", "trajectory", "method", "target", "bits", "frames", "run_id", "frame")}


GEN_NAMES = ["status", "run_id", "bf16_video", "method_video", "figure", "frame_slider"]
SCRUB_NAMES = ["status", "bf16", "method"]
TRACE_NAMES = ["status", "query_image", "bf16_source", "method_source", "figure", "result"]
PICKER_INFO = ("the jump map and the pixel trace; 'all': the jump map over every layer and head, the trace in the "
               "first whose top-1 moved at the pixel")
VIEW = dict(concurrency_limit=4, concurrency_id="view")  # the views' events: four at a time, beside generations
BITS = (2, 3, 4, 8)  # the fixed-bits mode's grids
ALL = ("all",)  # the layer/head picker's first choice: every layer (head)


# ---- layout -------------------------------------------------------------------------------------------
def _settings(methods: list[str], facts: dict, default_frames: int, max_frames: int | None) -> SimpleNamespace:
    """The run's settings, Generate and the current run id."""
    ui = SimpleNamespace()
    with gr.Row():
        ui.seed = Number(DEFAULT_SEED, label="World seed (0..99999, held-out photographs)", elem_id="seed")
        ui.trajectory = gr.Dropdown(list(TRAJECTORIES), value="loop", label="Trajectory")
        ui.method = gr.Dropdown(methods, value="quantwm", label="Method", info=METHOD_INFO)
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
        ui.run_id = gr.Textbox(label="Current run", interactive=False, elem_id="run-id")
    return ui


def _open_run_panel(ui: SimpleNamespace, opened: list[str]) -> None:
    with gr.Accordion("Open a recorded run (any model: quantwm record)", open=bool(opened)):
        with gr.Row():
            ui.run_choice = gr.Dropdown(list(opened), value=opened[0] if opened else None, label="Opened runs",
                                        elem_id="run-choice", allow_custom_value=True)
            ui.open_btn = gr.Button("Show this run", elem_id="open-run-btn")
            ui.run_upload = gr.File(label="Upload a run file (.safetensors)", file_types=[".safetensors"],
                                    type="filepath", elem_id="run-upload")


def _live_panel(ui: SimpleNamespace, live: dict) -> None:
    with gr.Accordion(f"Generate live with {live['kind']} on {live['device']} (method, target and bits from "
                      "above)", open=True):
        with gr.Row():
            ui.live_prompt = gr.Textbox(label="Prompt (the base model's UMT5 encodes it)", elem_id="live-prompt",
                                        lines=2)
            ui.live_embeddings = gr.File(label="or prompt embeddings (.safetensors with prompt_embeds)",
                                         type="filepath", file_types=[".safetensors"], elem_id="live-embeddings")
            ui.live_seed = Number(0, label="Noise seed")
            ui.live_frames = NumberChoice(number_choices(live["latent_frames"]), value=str(live["latent_frames"][-1]),
                                          label="Latent frames (21: 81 video frames)")
            ui.live_btn = gr.Button("Generate live", variant="primary", elem_id="live-btn")


def _frames_panel(ui: SimpleNamespace, facts: dict, default_frames: int) -> None:
    """The status, both videos, the per-frame plot, the frame slider with its overlays and both frames."""
    size = facts["frame_size"]
    ui.status = gr.Markdown(elem_id="generate-status")
    img_kw = dict(format="png", interactive=False, height=size * FACTOR + 2, width=size * FACTOR + 2, buttons=[])
    with gr.Row():
        # the plot needs room for its titles and legend: on a narrow page it wraps below the videos, full width
        ui.bf16_video = gr.Video(label="BF16 (reference)", elem_id="video-bf16", autoplay=False, loop=True, height=300,
                                 min_width=240)
        ui.method_video = gr.Video(label="Quantized", elem_id="video-method", autoplay=False, loop=True, height=300,
                                   min_width=240)
        ui.plot = gr.Plot(label="Per-frame flicker, PSNR and shift rate (click a point to jump)", elem_id="frame-plot",
                          min_width=400)
    ui.frame = Slider(0, default_frames - 1, value=0, step=1, label="Frame (scrubs both)", elem_id="frame-slider")
    with gr.Row():
        ui.overlays = gr.CheckboxGroup(list(OVERLAYS), value=[], label="Overlays on the quantized frame, scaled to "
                                       "the frame (red: flicker vs BF16; orange: warping error above BF16's, "
                                       "motion-compensated; cyan: tokens whose top-1 source moved in at least half "
                                       "the chosen layers and heads)")
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
        ui.method_img = gr.Image(label="Quantized frame (click a pixel)", elem_id="frame-method", **img_kw)
        ui.result = gr.JSON(label="Trace result", elem_id="trace-result", height=280)
    ui.scrub_out = [ui.frame_info, ui.bf16_img, ui.method_img, ui.scale]


def _trace_panel(ui: SimpleNamespace, facts: dict) -> None:
    """The pixel trace: layer, head and pixel, the query and both sources' thumbnails, the logit heatmaps."""
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
                                  ("Top-1 source, quantized keys (red)", "trace-src-method")):
                with gr.Column(min_width=size * 2 + 2):
                    gr.Markdown(f"**{caption}**", elem_id=f"{elem}-caption")
                    thumbs.append(gr.Image(label=caption, elem_id=elem, **thumb_kw))
        ui.heatmap = gr.Plot(label="Attention logits over the cache (frames x positions)", elem_id="trace-heatmap")
    ui.trace_out = [ui.trace_status, *thumbs, ui.heatmap, ui.result]


def _export_panel(ui: SimpleNamespace, figure_formats: tuple) -> None:
    with gr.Accordion("Export figures for print (matplotlib): the per-frame plot, the maps of the slider's frame "
                      "(layer and head as picked), the trace panel's logit heatmaps", open=False):
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
    labels: dict[str, str] = {}  # run id -> its quantized side's label ("kivi 3-bit, 2.50 bits/element")
    ui.scrub_in = [ui.run_id, ui.frame, ui.overlays, ui.layer, ui.head, ui.result]
    ui.gen_out = [ui.status, ui.run_id, ui.bf16_video, ui.method_video, ui.plot, ui.frame]
    ui.pickers = [ui.layer, ui.head, ui.px, ui.py]

    def shown(r):
        """A comparison on the page: the slider sized to it, the quantized panels labelled with what they show."""
        if r.get("frames"):
            r["frame_slider"] = gr.Slider(minimum=0, maximum=r["frames"] - 1, value=r["frame"], step=1)
        if r.get("method_video") and r.get("method_label"):
            r["method_video"] = gr.Video(value=r["method_video"], label=r["method_label"])
            labels[r["run_id"]] = r["method_label"]
            while len(labels) > 256:  # the labels of recent runs only
                labels.pop(next(iter(labels)), None)
        return unpack(r, GEN_NAMES)

    def do_scrub(run_id, frame, overlays, layer, head, traced=None):
        """traced: the trace panel's result; its pixel is marked on both frames when it is a trace of this run.
        The last output is the overlays' colour bars (emptied when no overlay tints the frame)."""
        r = scrub(run_id, frame, overlays, layer, head, traced)
        scale = r.get("scale")
        return (*unpack(r, SCRUB_NAMES),
                gr.skip() if r.get("bf16") is None else gr.update(value=scale, visible=scale is not None))

    def frame_label(run_id):
        """The quantized frame's panel named after the run shown."""
        name = labels.get(str(run_id or ""))
        return gr.Image(label=f"{name} (click a pixel)" if name else "Quantized frame (click a pixel)")

    def on_generate(seed, trajectory, method, target, bits, frames, budget=DEFAULT_BUDGET, sizing="budget",
                    progress=gr.Progress()):
        """sizing "budget": every method within `budget` bits per element (in (0, 16]); "bits": a fixed grid of
        `bits`, the budget unused."""
        r = generate(seed, trajectory, method, target, bits, frames, budget, sizing,
                     progress=progress_callback(progress, "generating BF16 and the method"))
        return shown(r)

    def on_sizing(sizing):
        return gr.update(interactive=sizing == "budget"), gr.update(interactive=sizing == "bits")

    ui.sizing.change(on_sizing, [ui.sizing], [ui.budget, ui.bits], api_name=False, queue=False)
    ui.do_scrub, ui.frame_label = do_scrub, frame_label
    settings = [ui.seed, ui.trajectory, ui.method, ui.target, ui.bits, ui.frames, ui.budget, ui.sizing]
    ev = ui.go.click(on_generate, settings, ui.gen_out, api_name="generate", trigger_mode="multiple",
                     concurrency_limit=1, concurrency_id="generate")
    ev.then(do_scrub, ui.scrub_in, ui.scrub_out, api_name="show_frame", **VIEW).then(
        frame_label, [ui.run_id], [ui.method_img], api_name=False, **VIEW)
    ev.then(ui.views_of, [ui.run_id, ui.result], ui.views_out, api_name=False, **VIEW)
    if rerun_pickers:
        ev.then(_builtin_pickers(facts), [ui.run_id], ui.pickers, api_name=False, **VIEW)
    return shown


def _pixel_boxes(h: int, w: int):
    return (gr.Number(w // 2, label=f"x (0..{w - 1})"), gr.Number(h // 2, label=f"y (0..{h - 1})"))


def _builtin_pickers(facts: dict) -> Callable:
    size = facts["frame_size"]

    def builtin_pickers(run_id):
        """Back to the built-in model's layers, heads and frame size after a generated run (if another run
        changed them)."""
        if not str(run_id or "").startswith("seed="):
            return (gr.skip(),) * 4
        return (gr.Dropdown(choices=number_choices(range(facts["layers"]), ALL)),
                gr.Dropdown(choices=number_choices(range(facts["heads"]), ALL)), *_pixel_boxes(size, size))
    return builtin_pickers


def _controls_for(r):
    """The layer/head picker and the pixel boxes sized to an opened or live run ("all", the frame's centre: a
    trace picks among the layers and heads the run holds logits for)."""
    if not r.get("run_id"):
        return (gr.skip(),) * 4
    L, H = r["layers"], r["heads"]
    return (gr.Dropdown(choices=number_choices(range(L), ALL), value="all"),
            gr.Dropdown(choices=number_choices(range(H), ALL), value="all"), *_pixel_boxes(*r["frame_hw"]))


def _settings_for(r):
    """An opened run sets the controls to the settings it was made with (what it holds of them)."""
    c = {**(r.get("controls") or {})}
    if "bits" in c:
        c["bits"] = str(c["bits"])  # the dropdown's choices are strings
    return tuple(c.get(n, gr.skip()) for n in ("seed", "trajectory", "method", "target", "bits", "frames"))


def _then_show_frame(ui: SimpleNamespace, event) -> None:
    event.then(ui.views_of, [ui.run_id, ui.result], ui.views_out, api_name=False, **VIEW)
    event.then(ui.do_scrub, ui.scrub_in, ui.scrub_out, api_name=False, **VIEW).then(
        ui.frame_label, [ui.run_id], [ui.method_img], api_name=False, **VIEW)


def _wire_open_run(ui: SimpleNamespace, open_run: Callable, opened: list[str], shown: Callable) -> None:
    known = list(opened)  # the run ids this page lists: start-up runs, then uploads
    settings = [ui.seed, ui.trajectory, ui.method, ui.target, ui.bits, ui.frames]

    def on_open(run):
        r = open_run(run, files=False)
        return (*shown(r), *_controls_for(r), *_settings_for(r))

    def on_upload(path):
        r = open_run(path)
        if r.get("run_id") and r["run_id"] not in known:
            known.append(r["run_id"])
        pick = gr.Dropdown(choices=known, value=r["run_id"]) if r.get("run_id") else gr.skip()
        return (*shown(r), *_controls_for(r), *_settings_for(r), pick)

    outputs = [*ui.gen_out, *ui.pickers, *settings]
    _then_show_frame(ui, ui.open_btn.click(on_open, [ui.run_choice], outputs, api_name="open_run", **VIEW))
    _then_show_frame(ui, ui.run_upload.upload(on_upload, [ui.run_upload], [*outputs, ui.run_choice],
                                              api_name="upload_run", **VIEW))


def _wire_live(ui: SimpleNamespace, live: dict, shown: Callable) -> None:
    def on_live(embeddings, seed, method, target, bits, latent_frames, prompt, progress=gr.Progress()):
        r = live["generate"](embeddings, seed, method, target, bits, latent_frames, prompt,
                             progress=progress_callback(progress, f"generating BF16 and the method ({live['kind']})"))
        return (*shown(r), *_controls_for(r))

    inputs = [ui.live_embeddings, ui.live_seed, ui.method, ui.target, ui.bits, ui.live_frames, ui.live_prompt]
    _then_show_frame(ui, ui.live_btn.click(on_live, inputs, [*ui.gen_out, *ui.pickers], api_name="generate_live",
                                           concurrency_limit=1, concurrency_id="generate"))


def _wire_views(ui: SimpleNamespace, scrub: Callable, trace_pixel: Callable, click_pixel: Callable,
                export: Callable) -> None:
    """Scrubbing, clicking or tracing a pixel, exporting figures."""
    gr.on([ui.frame.change, ui.overlays.change, ui.layer.change, ui.head.change], ui.do_scrub, ui.scrub_in,
          ui.scrub_out, api_name="scrub", trigger_mode="always_last", **VIEW)

    def on_click(run_id, frame, layer, head, evt: gr.SelectData):
        r = click_pixel(run_id, frame, evt.index, layer, head)
        x, y = r.get("pixel", (None, None))
        return (*_trace_outputs(r), x if x is not None else gr.skip(), y if y is not None else gr.skip())

    for img, name in ((ui.method_img, "click_pixel"), (ui.bf16_img, "click_pixel_bf16")):
        img.select(on_click, [ui.run_id, ui.frame, ui.layer, ui.head], [*ui.trace_out, ui.px, ui.py],
                   api_name=name, **VIEW).then(
            ui.do_scrub, ui.scrub_in, ui.scrub_out, api_name=False, **VIEW)

    def do_trace(run_id, frame, x, y, layer, head):
        return _trace_outputs(trace_pixel(run_id, frame, x, y, layer, head))

    ui.trace_btn.click(do_trace, [ui.run_id, ui.frame, ui.px, ui.py, ui.layer, ui.head], ui.trace_out,
                       api_name="trace_pixel", **VIEW).then(  # the traced pixel marked on both frames
        ui.do_scrub, ui.scrub_in, ui.scrub_out, api_name=False, **VIEW)

    def do_export(run_id, frame, layer, head, formats, traced=None):
        """What the tab shows: the run's plot, the slider frame's maps (the picked layer and head), the panel's trace."""
        r = export(run_id, frame, layer, head, formats, traced)
        return r["status"], r.get("files")

    ui.export_btn.click(do_export, [ui.run_id, ui.frame, ui.layer, ui.head, ui.export_formats, ui.result],
                        [ui.export_status, ui.export_files], api_name="export_figures", **VIEW)


def _trace_outputs(r: dict) -> tuple:
    """The trace panel's outputs; an error empties the panel below its Error line (no other trace stays under it)."""
    if r.get("result") is None:
        return (r["status"], None, None, None, None, None)
    return unpack(r, TRACE_NAMES)


def _views_of(ui: SimpleNamespace, trace_of: Callable) -> Callable:
    """After a run is shown: the trace panel and the exports of another run are emptied (their views belong to
    the run they were made of); the panel's trace of this same run stays."""
    def views_of(run_id, traced):
        if not run_id or trace_of(traced, run_id) is not None:
            return (gr.skip(),) * 8
        return (f"Run **{run_id}**: click a pixel of either frame to trace its Query.", None, None, None, None, None,
                "", None)

    ui.views_out = [*ui.trace_out, ui.export_status, ui.export_files]
    return views_of
