"""Query energy, Key vs Value and Methods tabs: studies of the current world (layout and wiring only)."""
from __future__ import annotations

from collections.abc import Callable

import gradio as gr

from .study_handlers import KV_COLUMNS, KV_SEEDS, METHOD_COLUMNS, default_methods
from .ui import Number, NumberChoice, number_choices, progress_callback, table, unpack
from .world_handlers import DEFAULT_BUDGET


def build_energy_tab(energy: Callable, controls: dict, layers: int, export: Callable | None = None,
                     figure_formats: tuple = ()) -> None:
    """energy(run_id, layer) -> {status, figure, header, rows}; export(run_id, layer, formats) -> {status, files}:
    the shown layer's spectra as a print figure."""
    gr.Markdown("History-Query energy of the current run: eigenvalues of S = E[q qᵀ] (the statistics QSAC and "
                "PSAC use) per layer and head, and the cumulative energy with the top 8 directions marked. "
                "Concentrated energy is why correcting only the principal subspace (PSAC) protects the logits.")
    with gr.Row():
        layer = NumberChoice(number_choices(range(layers)), value="0", label="Layer")
        show = gr.Button("Show spectra", variant="primary", elem_id="energy-btn")
    status = gr.Markdown(elem_id="energy-status")
    plot = gr.Plot(label="Query energy", elem_id="energy-plot")
    top8 = gr.Dataframe(label="Top-8 energy fraction per layer and head", interactive=False)

    def run(run_id, layer):
        r = energy(run_id, layer)
        return (*unpack(r, ["status", "figure"]), table(r))

    gr.on([show.click, layer.change], run, [controls["run_id"], layer], [status, plot, top8], api_name="energy",
          concurrency_limit=4, concurrency_id="view")
    if export is None:
        return
    with gr.Row():
        formats = gr.CheckboxGroup(list(figure_formats), value=["pdf"], label="Formats")
        export_btn = gr.Button("Export this layer's spectra", elem_id="energy-export-btn")
    export_status = gr.Markdown(elem_id="energy-export-status")
    files = gr.File(label="Figure", file_count="multiple", interactive=False)

    def do_export(run_id, layer, formats):
        r = export(run_id, layer, formats)
        return r["status"], r.get("files")

    export_btn.click(do_export, [controls["run_id"], layer, formats], [export_status, files], api_name="export_energy",
                     concurrency_limit=4, concurrency_id="view")
    # a new run shown on the Generate tab: this tab's spectra and export were of the run before
    controls["run_id"].change(lambda run_id: ("", None, None, "", None), [controls["run_id"]],
                              [status, plot, top8, export_status, files], api_name=False, queue=False)


def build_key_value_tab(key_value: Callable, controls: dict, baselines: list[str], default_baseline: str) -> None:
    """key_value(seed, trajectory, baseline, budget, frames, seeds, progress) -> {status, header, rows, figure}."""
    gr.Markdown("Quantize only the Keys, then only the Values, each within the same budget by its method's rule, for "
                "a baseline and for quantwm beside it, on several held-out worlds from the Generate tab's seed on "
                "(its trajectory and frames too). Per seed, the table puts the reconstruction error of K and V beside "
                "the damage each causes: PSNR, flicker (tdiff), LPIPS, place shift (a Query's top-1 moved to another "
                "world place) and attention-output error, then their mean ± sd; the chart draws them all. The "
                "sentence says what holds on every seed and what does not, computed from the table. The default "
                f"baseline, {default_baseline}, is the one whose rows show the paper's finding most clearly on "
                "held-out worlds (docs/world-model.md).")
    with gr.Row():
        baseline = gr.Dropdown(baselines, value=default_baseline, label="Baseline")
        budget = Number(DEFAULT_BUDGET, label="Budget (bits per element)", step=0.25, elem_id="kv-budget")
        seeds = Number(KV_SEEDS, label="Seeds (worlds from the Generate tab's seed on)", elem_id="kv-seeds")
        go = gr.Button("Run Keys only vs Values only", variant="primary", elem_id="kv-btn")
    status = gr.Markdown(elem_id="kv-status")
    rows = gr.Dataframe(label="Keys only (k) vs Values only (v), per seed", headers=list(KV_COLUMNS), interactive=False,
                        elem_id="kv-table")
    plot = gr.Plot(label="Errors and damage, mean ± sd over the seeds", elem_id="kv-plot")

    def run(seed, trajectory, baseline, budget, frames, seeds, progress=gr.Progress()):
        r = key_value(seed, trajectory, baseline, budget, frames, seeds,
                      progress=progress_callback(progress, "Keys only, then Values only, seed by seed"))
        return (*unpack(r, ["status", "figure"]), table(r))

    c = controls
    go.click(run, [c["seed"], c["trajectory"], baseline, budget, c["frames"], seeds], [status, plot, rows],
             api_name="key_vs_value", concurrency_limit=1, concurrency_id="generate", trigger_mode="multiple")


def build_methods_tab(methods_table: Callable, export: Callable, methods: list[str], controls: dict,
                      figure_formats: tuple) -> None:
    """methods_table(seed, trajectory, target, frames, methods, budget, progress) -> {status, header, rows};
    export(..., methods, budget, formats, progress) -> {status, files}: the comparison as a print figure."""
    gr.Markdown("Every chosen method on the current world (seed, trajectory, target and frames of the Generate "
                "tab) at one budget: each method configures itself within the bits per element you pick, by its "
                "own rule (the configuration column says what it chose; a method that cannot fit is named and left "
                "out). Rows come in order of measured bits per element: compression, cache memory in MB (BF16 vs "
                "stored), top-1 shift rate, PSNR, SSIM, LPIPS and flicker against BF16 (tdiff), beside VBench's "
                "temporal-flickering score of each run's own frames (BF16's in the status, a dashed line on the "
                "chart); the status says how far apart the two scores put the methods. Ticked at first: the "
                "strongest published baselines, the textbook transform coder in our format and quantwm; every "
                "method can be chosen. Runs are cached.")
    with gr.Row():
        chosen = gr.CheckboxGroup([m for m in methods if m != "bf16"], value=default_methods(methods), label="Methods",
                                  scale=4, elem_id="methods-choice")
        budget = Number(DEFAULT_BUDGET, label="Budget (bits per element, Keys and Values)", step=0.25, elem_id="methods-budget", scale=1)
    go = gr.Button("Compare methods", variant="primary", elem_id="methods-btn")
    status = gr.Markdown(elem_id="methods-status")
    # columns the same in every row are left out (the status names them); long configurations wrap in their cell
    rows = gr.Dataframe(label="Methods", headers=list(METHOD_COLUMNS), interactive=False, elem_id="methods-table",
                        wrap=True)
    plot = gr.Plot(label="The table's metrics (OVER: over the budget or BF16's bytes)", elem_id="methods-plot")

    def run(seed, trajectory, target, frames, methods, budget, progress=gr.Progress()):
        r = methods_table(seed, trajectory, target, frames, methods, budget, progress=progress_callback(progress, "methods"))
        status_, figure = unpack(r, ["status", "figure"])
        return status_, table(r), figure

    def fit_columns(shown):
        """Every column in view: the configuration a fifth of the width (its text wraps), the numbers share the
        rest (the shown columns vary: those the same in every row are left out)."""
        header = [str(c) for c in getattr(shown, "columns", [])]
        if not header:
            return gr.skip()
        text = {"method": 9, "fits": 7, "configuration": 20}
        share = (98 - sum(text.values())) / max(1, len(header) - len(text))  # 2%: the table's borders
        return gr.Dataframe(column_widths=[f"{text.get(c, share):.1f}%" for c in header])

    c = controls
    inputs = [c["seed"], c["trajectory"], c["target"], c["frames"], chosen, budget]
    go.click(run, inputs, [status, rows, plot], api_name="methods_table", concurrency_limit=1,
             concurrency_id="generate", trigger_mode="multiple").then(fit_columns, [rows], [rows], api_name=False,
                                                                     queue=False)
    with gr.Row():
        formats = gr.CheckboxGroup(list(figure_formats), value=["pdf"], label="Formats", elem_id="methods-formats")
        export_btn = gr.Button("Export the comparison figure (what the table shows)", elem_id="methods-export-btn")
    export_status = gr.Markdown(elem_id="methods-export-status")
    files = gr.File(label="Figure", file_count="multiple", interactive=False, elem_id="methods-export-files")

    def do_export(seed, trajectory, target, frames, methods, budget, formats, progress=gr.Progress()):
        r = export(seed, trajectory, target, frames, methods, budget, formats,
                   progress=progress_callback(progress, "methods"))
        return r["status"], r.get("files")

    export_btn.click(do_export, [*inputs, formats], [export_status, files], api_name="export_methods_figure",
                     concurrency_limit=1, concurrency_id="generate", trigger_mode="multiple")
