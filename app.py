"""QuantWM diagnostics app: `python app.py [--trace FILE] [--port N]`.

Assembles the tabs of app/; the numerical work lives in quantwm/. With no trace given it analyses the
built-in synthetic world trace (made at start-up, no downloads).
"""
from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402

from app.analysis_tab import build_analysis_tab  # noqa: E402
from app.handlers import analyze_handler  # noqa: E402
from quantwm.methods import known_methods  # noqa: E402
from quantwm.synthetic import make_synthetic_trace  # noqa: E402
from quantwm.trace import read_trace  # noqa: E402


def default_trace(path: str | None) -> str:
    if path:
        read_trace(path)  # fail at start-up, clearly, on a bad file
        return path
    out = os.path.join(tempfile.mkdtemp(prefix="quantwm-"), "synthetic-world.safetensors")
    make_synthetic_trace(seed=0, n_layers=2, n_heads=4).save(out)
    return out


def build_app(trace: str | None = None) -> gr.Blocks:
    trace_path = default_trace(trace)
    with gr.Blocks(title="QuantWM") as demo:
        gr.Markdown("# QuantWM: where 2-bit KV caches make video world models flicker")
        with gr.Tab("Trace analysis"):
            build_analysis_tab(analyze_handler, known_methods(), trace_path)
    return demo


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", help="a QuantWM trace file (.safetensors)")
    ap.add_argument("--port", type=int, default=7860)
    ap.add_argument("--host", default="127.0.0.1")
    a = ap.parse_args()
    try:
        app = build_app(a.trace)
    except ValueError as e:
        raise SystemExit(f"quantwm app: error: {e}")
    app.queue(default_concurrency_limit=1).launch(server_name=a.host, server_port=a.port)
