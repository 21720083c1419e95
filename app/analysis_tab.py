"""Trace analysis tab: pick a trace file and methods, get the attention-fidelity table (no torch here)."""
from __future__ import annotations

from typing import Callable

import gradio as gr

TARGETS = [("Keys only", "k"), ("Values only", "v"), ("Keys and Values", "kv")]


def build_analysis_tab(analyze: Callable, methods: list[str], default_trace: str | None) -> None:
    """analyze(trace_path, methods, target, bits) -> (markdown status, header, rows)."""
    gr.Markdown("Attention fidelity of each method on a trace (queries, cached keys and values of a real "
                "or built-in model): top-1 shift rate, top-k overlap, attention KL, logit RMSE, errors, bits.")
    with gr.Row():
        trace = gr.File(label="Trace file (.safetensors); empty = the built-in synthetic world trace",
                        file_types=[".safetensors"], type="filepath")
        with gr.Column():
            chosen = gr.CheckboxGroup(methods, value=["rtn", "kivi", "qvg", "quantwm"], label="Methods")
            target = gr.Radio(TARGETS, value="k", label="Quantize")
            bits = gr.Dropdown([2, 3, 4, 8], value=2, label="Bits")
    run = gr.Button("Analyze", variant="primary")
    status = gr.Markdown()
    table = gr.Dataframe(label="Means over layers and heads", interactive=False)

    def handler(path, names, tgt, b):
        message, header, rows = analyze(path or default_trace, names, tgt, int(b))
        return message, gr.Dataframe(value=rows, headers=header) if header else gr.Dataframe(value=None)

    run.click(handler, [trace, chosen, target, bits], [status, table], api_name="analyze")
