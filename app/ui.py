"""Glue between plain handler results and Gradio outputs (no numerics, no torch)."""
from __future__ import annotations

import gradio as gr
import pandas as pd


def unchecked(component):
    """The component with its value passed to the handler as sent: no rounding, no range check in Gradio, so a
    bad value (from the page or the API) gets the handler's one **Error:** line naming the field and its
    range. (An instance attribute: a subclass would make Gradio write a stub file beside this module.)"""
    component.preprocess = lambda payload: payload
    return component


def Slider(*args, **kwargs) -> gr.Slider:  # noqa: N802 (a component constructor)
    return unchecked(gr.Slider(*args, **kwargs))


def Number(*args, **kwargs) -> gr.Number:  # noqa: N802
    return unchecked(gr.Number(*args, **kwargs))


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
