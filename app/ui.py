"""Glue between plain handler results and Gradio outputs (no numerics, no torch)."""
from __future__ import annotations

import gradio as gr
import pandas as pd

VIEW = dict(concurrency_limit=4, concurrency_id="view")  # the views' events: four at a time, beside generations


def _unchecked(base: type) -> type:
    """`base` with its value passed to the handler as sent: no rounding and no range check in Gradio, so a bad
    value (from the page or the API) gets the handler's one **Error:** line naming the field and its range.

    A subclass, so that it survives Gradio's re-instantiation of a component whose props an event updates (a
    slider's new maximum). It keeps the base's name (the page picks its widget by the class name) and is made
    with `type.__new__`, which skips Gradio's component metaclass hook: that hook writes a .pyi stub beside
    the module defining a component class."""
    return type.__new__(type(base), base.__name__, (base,), {
        "__module__": __name__, "__doc__": _unchecked.__doc__, "preprocess": lambda self, payload: payload})


Slider = _unchecked(gr.Slider)
Number = _unchecked(gr.Number)
# A dropdown of numbers ("all", layers, heads, bits): its choices are strings, as the API lists them ('1'); "1" and 1
# alike reach the handler, which converts and checks them (`values.integer`), its error naming the allowed values.
NumberChoice = _unchecked(gr.Dropdown)


def number_choices(values, first: tuple = ()) -> list[str]:
    """A `NumberChoice`'s choices: `first` ("all") then the numbers, all as strings."""
    return [*first, *map(str, values)]


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
