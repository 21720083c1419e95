"""What the fused span-attention kernel reads of one cached span: the typed arguments of
kernels/span_attention.py, built once per span by the span's layout (quantwm/core/layouts) and kept with it.

A span has a key side and a value side, each in one of three forms:

* FULL: `data` is the span itself, (S, N, D) in its stored dtype.
* GROUPED: `data` holds packed codes (S, N, D * bits / 8) uint8; `scales` and `zeros` (None on a symmetric
  grid) are per token in groups of `group_size` channels, (S, N, D / G), or per channel in groups of
  `group_size` tokens, (S, ceil(N / G), D) (`axis_token`). A value is code * scale + zero, or
  (code - (2^(b-1) - 1)) * scale when symmetric.
* CHANNELS: per-channel grids over the whole span with 0-8 bits each (QuantWM's allocator). `data` is one uint8
  buffer with every stream's codes; `meta` (S, D) int64 holds each channel's byte offset in it times 16 plus
  its bits; `scales` are the grid steps (S, D) as stored (fp16) and `zeros` the low ends (S, D) fp32 (a single mean row per stream,
  when the span kept one, already folded in). Code j of a b-bit channel sits at bits [j b, j b + b) from the
  channel's offset, little-endian, so it may straddle two bytes. `max_bits` is the widest channel.

GROUPED and CHANNELS sides may add a codebook stage: `codebook` (S, K, D) and `ids` (S, N), the row of every
token added to its value. A key side may carry PSAC coefficients; their per-query terms come as `PsacArgs`.
Nothing here imports Triton or QuantWM.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

FULL, GROUPED, CHANNELS = 0, 1, 2
# key rows per tile of the fused kernel; the 8-bit path's PV blocks (quantwm/core/fp8.py) and the token groups whose
# codes it reads as they are follow it
BLOCK_N = 32
FORMS = {FULL: "full", GROUPED: "grouped", CHANNELS: "channels"}


class SideArgs(NamedTuple):
    """One side (keys or values) of a span as the kernel reads it; see the module docstring."""

    form: int
    data: torch.Tensor
    n_tokens: int
    scales: torch.Tensor | None = None
    zeros: torch.Tensor | None = None
    meta: torch.Tensor | None = None
    codebook: torch.Tensor | None = None
    ids: torch.Tensor | None = None
    bits: int = 0
    group_size: int = 1
    axis_token: bool = False
    symmetric: bool = False
    max_bits: int = 0


class PsacArgs(NamedTuple):
    """PSAC's per-query inputs for one key span: qs (S, Nq, R) fp32 = (Uᵀq) times each direction's coefficient
    scale, c0 (S, Nq) fp32 = Σ_r (Uᵀq)_r zero_r, codes uint8 (S, N, R * bits / 8), bits 2, 4 or 8."""

    qs: torch.Tensor
    c0: torch.Tensor
    codes: torch.Tensor
    bits: int


def full_side(x: torch.Tensor) -> SideArgs:
    """A full-precision span (S, N, D)."""
    return SideArgs(FULL, x, x.shape[1])
