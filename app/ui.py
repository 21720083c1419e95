"""Glue between plain handler results and Gradio outputs (no numerics, no torch)."""
from __future__ import annotations

import gradio as gr
import pandas as pd


class Slider(gr.Slider):
    """A slider whose value reaches the handler as sent: no rounding and no range check here, so a bad value
    (from the page or the API) gets the handler's one **Error:** line naming the field and its range."""

    def preprocess(self, payload):
        return payload


class Number(gr.Number):
    """A number box that passes what was typed to the handler unrounded and unchecked (see `Slider`)."""

    def preprocess(self, payload):
        return payload


def unpack(result: dict, names: list[str]) -> tuple:
    """Handler dict -> output tuple in `names` order; a missing or None entry leaves that output as it is."""
    return tuple(gr.skip() if result.get(n) is None else result[n] for n in names)


def table(result: dict, headers_key: str = "header", rows_key: str = "rows"):
    """A Dataframe value (pandas, so the headers travel with it) from a handler's header and rows (no change when the handler gave none)."""
    if result.get(rows_key) is None:
        return gr.skip()
    return pd.DataFrame(result[rows_key], columns=result[headers_key])


def progress_callback(progress: gr.Progress, desc: str):
    """(done, total) callback for the workbench that drives a Gradio progress bar."""
    return lambda done, total, *_: progress((done, total), desc=desc)
