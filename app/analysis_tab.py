"""Trace analysis tab: a trace file from a real model (or the built-in one): the method comparison table,
one Query's logit heatmaps and top-1 jump, the layer's jump map on its frame, Query energy spectra.
Layout and wiring only (no torch here)."""
from __future__ import annotations

from collections.abc import Callable

import gradio as gr

from .playback_tab import SIZING_CHOICES
from .ui import Number, NumberChoice, number_choices, unpack
from .world_handlers import DEFAULT_BUDGET

TARGETS = [("Keys only", "k"), ("Values only", "v"), ("Keys and Values", "kv")]


def build_analysis_tab(analyze: Callable, methods: list[str], default_trace: str | None,
                       inspect: Callable | None = None, energy: Callable | None = None,
                       click: Callable | None = None, trace_name: str = "the built-in synthetic world trace") -> None:
    """`trace_name`: what the page calls the default trace (never a server path);
    analyze(trace_path, methods, target, bits, budget, sizing) -> (markdown status, header, rows): the methods
    within `budget` bits per element, each by its rule (sizing "budget", the default), or at fixed `bits`;
    inspect(trace_path, method, target, bits, layer, head, query) -> {status, figure, jump_image, result};
    click(..., query, index) -> the same plus query_index: the query at the clicked token of the shown frame;
    energy(trace_path, layer_index) -> {status, figure}."""
    gr.Markdown("Attention fidelity of each method on a trace (queries, cached keys and values of a real "
                "or built-in model): top-1 shift rate, top-k overlap, attention KL, logit RMSE, errors, bits. "
                "Methods are compared at equal memory by default, as on the other tabs: each configures itself "
                "within the budget (bits per element) by its own rule; a row over it or over BF16's bytes is "
                f"flagged OVER. Default trace: {trace_name}. Press **Analyze** for the table.")
    with gr.Row():
        trace = gr.File(label="Trace file (.safetensors); empty = the default trace",
                        file_types=[".safetensors"], type="filepath")
        with gr.Column():
            chosen = gr.CheckboxGroup(methods, value=["rtn", "kivi", "qvg", "quantwm"], label="Methods")
            target = gr.Radio(TARGETS, value="k", label="Quantize")
            with gr.Row():
                sizing = gr.Radio(SIZING_CHOICES, value="budget", label="Memory", elem_id="trace-sizing")
                budget = Number(DEFAULT_BUDGET, label="Budget (bits per element; each method by its rule)",
                                step=0.25, elem_id="trace-budget")
                bits = NumberChoice(number_choices((2, 3, 4, 8)), value="2",
                                    label="Bits (fixed-bits mode; and the one Query below)")
    run = gr.Button("Analyze", variant="primary", elem_id="analyze-btn")
    status = gr.Markdown(elem_id="analyze-status")
    table = gr.Dataframe(label="Means over layers and heads", interactive=False, visible=False)  # until analysed

    def handler(path, methods, target, bits, budget=DEFAULT_BUDGET, sizing="budget"):
        """sizing "budget": every method within `budget` bits per element; "bits": fixed grids of `bits`."""
        message, header, rows = analyze(path or default_trace, methods, target, bits, budget, sizing)
        return message, (gr.Dataframe(value=rows, headers=header, visible=True) if header
                         else gr.Dataframe(value=None, visible=False))

    run.click(handler, [trace, chosen, target, bits, budget, sizing], [status, table], api_name="analyze")
    sizing.change(lambda mode: gr.update(interactive=mode == "budget"), [sizing], [budget], api_name=False,
                  queue=False)
    if inspect is None or energy is None:
        return
    gr.Markdown("### One Query: top-1 source and logits under exact vs quantized keys")
    with gr.Row():
        method = gr.Dropdown([m for m in methods if m != "bf16"], value="qvg", label="Method")
        layer = Number(0, label="Layer")
        head = Number(0, label="Head")
        query = Number(0, label="Query index")
        go = gr.Button("Inspect query", elem_id="trace-inspect-btn")
    q_status = gr.Markdown(elem_id="trace-inspect-status")
    with gr.Row():
        jump_img = gr.Image(label="Query frame (click a token to inspect its query): cyan = share of heads whose "
                                  "top-1 moved; yellow = the query", format="png", interactive=False, buttons=[],
                            elem_id="trace-jump-image")
        result = gr.JSON(label="Query result")
    heat = gr.Plot(label="Logits over the cached keys (frames x positions)")
    def do_inspect(path, method, target, bits, layer, head, query):
        r = inspect(path or default_trace, method, target, bits, layer, head, query)
        return unpack(r, ["status", "figure", "jump_image", "result"])

    go.click(do_inspect, [trace, method, target, bits, layer, head, query], [q_status, heat, jump_img, result],
             api_name="trace_inspect")
    if click is not None:
        def on_click(path, method, target, bits, layer, head, query, evt: gr.SelectData):
            r = click(path or default_trace, method, target, bits, layer, head, query, evt.index)
            return (*unpack(r, ["status", "figure", "jump_image", "result"]),
                    r["query_index"] if "query_index" in r else gr.skip())

        jump_img.select(on_click, [trace, method, target, bits, layer, head, query],
                        [q_status, heat, jump_img, result, query], api_name="trace_click_query")
    gr.Markdown("### Query energy of the trace (from q_hist when present)")
    with gr.Row():
        e_layer = Number(0, label="Layer index (order in the file)")
        e_go = gr.Button("Show spectra", elem_id="trace-energy-btn")
    e_status = gr.Markdown(elem_id="trace-energy-status")
    e_plot = gr.Plot(label="Query energy")
    def do_energy(path, layer):
        return unpack(energy(path or default_trace, layer), ["status", "figure"])

    e_go.click(do_energy, [trace, e_layer], [e_status, e_plot], api_name="trace_energy")
