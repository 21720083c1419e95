"""Parsing request values strictly (shared by the handlers; no gradio, no torch)."""
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
