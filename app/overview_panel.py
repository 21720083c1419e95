"""Long run overview, under Generate & play: the error-over-time strip of the run shown (curves over thumbnails;
a click jumps the player's frame slider there) and its per-(layer, head) table with heatmaps (bits the cache
gave each head, its shift, and the layer sensitivity when recorded). Layout and wiring only; the handlers come
from app/overview_handlers.py."""
from __future__ import annotations

from collections.abc import Callable

import gradio as gr

from .ui import VIEW, table  # the views' queue, as the player's


def build_overview_panel(controls: dict, show: Callable, click: Callable) -> None:
    """`controls`: the Generate & play tab's shared controls (run_id, frame); show(run_id, frame) -> {status,
    strip, header, rows, heatmap}; click(run_id, x) -> {frame, status}."""
    with gr.Accordion("Long run: error over time and the (layer, head) table", open=True):
        status = gr.Markdown(elem_id="overview-status")
        # the caption above, not Gradio's label badge on the image: it would hide the first curve's scale
        gr.Markdown("**Error over time**, frame by frame over thumbnails: click to jump the player there",
                    elem_id="overview-strip-caption")
        strip = gr.Image(label="Error over time", show_label=False, format="png", interactive=False, buttons=[],
                         elem_id="overview-strip")
        with gr.Row():
            rows = gr.Dataframe(label="Per (layer, head): bits, shift, layer sensitivity", interactive=False,
                                elem_id="layer-table", wrap=True)
            heatmap = gr.Plot(label="Per (layer, head) heatmaps", elem_id="layer-heatmap")

    def on_show(run_id, frame=None):
        """The strip (the player's frame marked), the table and the heatmaps of the run shown."""
        if not run_id:
            return (gr.skip(),) * 4
        r = show(run_id, frame)
        return (r["status"], r.get("strip", gr.skip()), table(r), r.get("heatmap", gr.skip()))

    def on_click(run_id, evt: gr.SelectData):
        r = click(run_id, evt.index[0])
        return r["frame"] if r.get("frame") is not None else gr.skip(), r.get("status") or gr.skip()

    def strip_frame(run_id: str, x: float) -> int:
        """The click's twin: the frame under column `x` of the strip."""
        r = click(run_id, x)
        if r.get("frame") is None:
            raise gr.Error(r["status"])
        return r["frame"]

    run_id, frame = controls["run_id"], controls["frame"]
    run_id.change(on_show, [run_id], [status, strip, rows, heatmap], api_name="overview", **VIEW)
    strip.select(on_click, [run_id], [frame, status], api_name="click_strip", **VIEW).then(
        lambda rid, f: on_show(rid, f)[:2], [run_id, frame], [status, strip], api_name=False, **VIEW)
    gr.api(strip_frame, api_name="strip_frame")
