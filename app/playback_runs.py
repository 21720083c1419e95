"""The Generate & play tab's panels for runs it did not generate: run files opened (`--run`, uploads), one shown
alone or another opened run beside it as method B, and runs generated live with a real model (`--model
self-forcing`). Layout and wiring only; app/playback_tab.py builds the tab around them."""
from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import gradio as gr

from .ui import VIEW, Number, NumberChoice, number_choices, progress_callback
from .world_handlers import NO_METHOD as NONE  # no run beside the opened one

ALL = ("all",)  # the layer/head picker's first choice: every layer (head)


def then_show_frame(ui: SimpleNamespace, event, api_name=False) -> None:
    """After runs are shown: the trace panel and exports of the runs before emptied, the frames and labels drawn."""
    event.then(ui.views_of, [ui.run_id, ui.result, ui.run_b], ui.views_out, api_name=False, **VIEW)
    event.then(ui.do_scrub, ui.scrub_in, ui.scrub_out, api_name=api_name, **VIEW).then(
        ui.frame_label, [ui.run_id, ui.run_b], [ui.method_img, ui.method_b_img], api_name=False, **VIEW)


def open_run_panel(ui: SimpleNamespace, opened: list[str]) -> None:
    with gr.Accordion("Open a recorded run (any model: quantwm record)", open=bool(opened)):
        with gr.Row():
            ui.run_choice = gr.Dropdown(list(opened), value=opened[0] if opened else None, label="Opened runs",
                                        elem_id="run-choice", allow_custom_value=True)
            ui.run_choice_b = gr.Dropdown([NONE, *opened], value=NONE, elem_id="run-choice-b",
                                          label="Beside it as method B (another method's run of the same BF16 "
                                                "generation, e.g. recorded with the same seed)")
            ui.open_btn = gr.Button("Show this run", elem_id="open-run-btn")
            ui.run_upload = gr.File(label="Upload a run file (.safetensors)", file_types=[".safetensors"],
                                    type="filepath", elem_id="run-upload")


def live_panel(ui: SimpleNamespace, live: dict) -> None:
    with gr.Accordion(f"Generate live with {live['kind']} on {live['device']} (method A, target and bits from "
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


def _pixel_boxes(h: int, w: int):
    return (gr.Number(w // 2, label=f"x (0..{w - 1})"), gr.Number(h // 2, label=f"y (0..{h - 1})"))


def _controls_for(r):
    """The layer/head picker and the pixel boxes sized to an opened or live run ("all", the frame's centre: a
    trace picks among the layers and heads the run holds logits for)."""
    if not r.get("run_id"):
        return (gr.skip(),) * 4
    L, H = r["layers"], r["heads"]
    return (gr.Dropdown(choices=number_choices(range(L), ALL), value="all"),
            gr.Dropdown(choices=number_choices(range(H), ALL), value="all"), *_pixel_boxes(*r["frame_hw"]))


SETTINGS = ("seed", "trajectory", "method", "target", "bits", "frames", "world")


def _settings_for(r):
    """An opened run sets the controls to the settings it was made with (what it holds of them)."""
    c = {**(r.get("controls") or {})}
    if "bits" in c:
        c["bits"] = str(c["bits"])  # the dropdown's choices are strings
    return tuple(c.get(n, gr.skip()) for n in SETTINGS)


def wire_open_run(ui: SimpleNamespace, open_run: Callable, opened: list[str], shown: Callable) -> None:
    """Show an opened run (and another beside it as method B), or upload one; `shown` puts a comparison on the page."""
    known = list(opened)  # the run ids this page lists: start-up runs, then uploads

    def on_open(run, run_b=NONE):
        """run_b: another opened run shown beside it as method B ("none": none)."""
        r = open_run(run, files=False, run_b=run_b)
        return (*shown(r), *_controls_for(r), *_settings_for(r))

    def on_upload(path):
        r = open_run(path)
        if r.get("run_id") and r["run_id"] not in known:
            known.append(r["run_id"])
        if not r.get("run_id"):
            return (*shown(r), *_controls_for(r), *_settings_for(r), gr.skip(), gr.skip())
        return (*shown(r), *_controls_for(r), *_settings_for(r), gr.Dropdown(choices=known, value=r["run_id"]),
                gr.Dropdown(choices=[NONE, *known], value=NONE))

    outputs = [*ui.gen_out, *ui.pickers, *(getattr(ui, n) for n in SETTINGS)]
    then_show_frame(ui, ui.open_btn.click(on_open, [ui.run_choice, ui.run_choice_b], outputs, api_name="open_run",
                                          **VIEW))
    then_show_frame(ui, ui.run_upload.upload(on_upload, [ui.run_upload], [*outputs, ui.run_choice, ui.run_choice_b],
                                             api_name="upload_run", **VIEW))


def wire_live(ui: SimpleNamespace, live: dict, shown: Callable) -> None:
    def on_live(embeddings, seed, method, target, bits, latent_frames, prompt, progress=gr.Progress()):
        r = live["generate"](embeddings, seed, method, target, bits, latent_frames, prompt,
                             progress=progress_callback(progress, f"generating BF16 and the method ({live['kind']})"))
        return (*shown(r), *_controls_for(r))

    inputs = [ui.live_embeddings, ui.live_seed, ui.method, ui.target, ui.bits, ui.live_frames, ui.live_prompt]
    then_show_frame(ui, ui.live_btn.click(on_live, inputs, [*ui.gen_out, *ui.pickers], api_name="generate_live",
                                          concurrency_limit=1, concurrency_id="generate"))
