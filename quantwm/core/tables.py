"""Constant tables kept on the host (the e2m1 grid, Lloyd-Max levels, seeded rotations) and their one copy on each
device: `on_device(table, device)` copies a table at its first use on a device and hands the same copy back after,
so a path that looks a table up on every call (a decode on each attend) never copies it again. On a GPU a copy from
pageable host memory waits for the stream to drain: a host sync per call.

The tables must never be modified in place (the copies would not follow).
"""
from __future__ import annotations

import torch

_COPIES: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def on_device(table: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`table` on `device`: itself where it already is, else its copy there (made once)."""
    device = torch.device(device)
    if table.device == device:
        return table
    key = (id(table), device)
    held = _COPIES.get(key)
    if held is None or held[0] is not table:  # the table is kept beside its copy: its id stays its own
        held = _COPIES[key] = (table, table.to(device))
    return held[1]
