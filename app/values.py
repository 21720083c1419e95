"""Parsing request values strictly (shared by the handlers; no gradio, no torch)."""
from __future__ import annotations

import math


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
