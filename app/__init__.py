"""The Gradio diagnostics app: one module per tab, each exposing build_...(compute functions)."""
