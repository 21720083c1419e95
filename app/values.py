"""Parsing request values strictly, and the answer to a bad one (shared by the handlers; no gradio, no torch)."""
from __future__ import annotations

import math
import os


def integer(value, name: str) -> int:
    """An integer request value: ints, integral floats (3.0) and integer strings; anything else (2.5, NaN,
    True, None, "abc", a list) is a ValueError naming the control."""
    if isinstance(value, bool) or value is None or isinstance(value, (list, tuple, dict)):
        raise ValueError(f"{name} must be an integer, got {value!r:.60}")
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        return int(value)
    try:
        return int(str(value).strip())
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r:.60}") from None


def error(message: str, **keep) -> dict:
    """A handler's answer to bad input: its "**Error:** ..." status (and the outputs in `keep`), no other output."""
    return {"status": f"**Error:** {message}", **keep}


def choice(value, name: str):
    """A layer/head picker's value: 'all' / None -> None; otherwise an int (ValueError naming the control)."""
    if value is None or (isinstance(value, str) and value in ("", "all")):
        return None
    try:
        return integer(value, name)
    except ValueError:
        raise ValueError(f"{name} must be 'all' or an integer, got {value!r:.60}") from None


MAPS = ("A", "B")  # which shown method's run the maps, the pixel trace and the exports are of


def shown_pair(run_id, run_b, maps="A") -> tuple[str, str]:
    """Of the runs shown side by side, method A's `run_id` and method B's `run_b` ("" or None: none): (the run the
    maps, the trace and the exports are of, picked by `maps`, "A" or "B"; the other method's run, "" when none)."""
    run_id, run_b = str(run_id or ""), str(run_b or "")
    if maps not in MAPS or (maps == "B" and not run_b):
        raise ValueError(f"maps must be 'A' (method A's run) or 'B' (method B's run, given as run_b), got {maps!r:.60}"
                         + ("" if run_b else " with no method B shown"))
    return (run_id, run_b) if maps == "A" else (run_b, run_id)


def name(value, what: str) -> str:
    """A name-valued request value (method, target, trajectory): a string, else a ValueError naming the control."""
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a name, got {value!r:.60}")
    return value


def readable_file(path, what: str, check_upload=None) -> str:
    """`path` as a string, checked: an existing file within the upload limit (`check_upload(path, what)`
    raises ValueError for one over it)."""
    path = str(path)
    if not os.path.isfile(path):
        raise ValueError(f"{what} {path!r:.120} does not exist (or is not a file)")
    if check_upload is not None:
        check_upload(path, what)
    return path
