"""What the fused span-attention kernel reads of one cached span: the typed arguments of
kernels/span_attention.py, built once per span by the span's layout (quantwm/core/layouts) and kept with it.

A span has a key side and a value side, each in one of four forms:

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

* TRELLIS: per-channel bitshift trellis codes over the whole span (`quantwm-trellis`), stored as CHANNELS stores
  its grids: `data` as there, `meta` = byte offset * 32 + 16 on a grid channel + bits, `scales` the channels'
  scales (S, D) fp16 and `zeros` their means (S, D) fp32. Sample j of a b-bit trellis channel decodes from the L = 8
  bits of the channel's stream that end where its code ends (bits [(j + 1) b − 8, (j + 1) b); bits before the
  channel's first are its last where its stream holds at least 8 bits (tail-biting), else 0) as a window w:
  zero + scale · table[b, w], `table` (9, 2^L) fp32 the widths' values of each window (quantwm/core/trellis.py's
  `tables`: at b = 1-4 a stored table read by w's top b + 4 bits, at 5-8 the codebook computed from w, `mad`). A
  grid channel (flag 16) decodes as CHANNELS does, zero + scale · code, its zero and scale then its low end and
  step.

GROUPED, CHANNELS and TRELLIS sides may add a codebook stage: `codebook` (S, K, D) and `ids` (S, N), the row of every
token added to its value. A key side may carry PSAC coefficients; their per-query terms come as `PsacArgs`.
Nothing here imports Triton or QuantWM.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .trellis_tables import MEMORY as TRELLIS_MEMORY
from .trellis_tables import TRAINED as TRELLIS_TRAINED  # noqa: F401 (the tables' values, for quantwm.core.trellis)

FULL, GROUPED, CHANNELS, TRELLIS = 0, 1, 2, 3
# key rows per tile of the fused kernel; the 8-bit path's PV blocks (quantwm/core/fp8.py) and the token groups whose
# codes it reads as they are follow it
BLOCK_N = 32
FORMS = {FULL: "full", GROUPED: "grouped", CHANNELS: "channels", TRELLIS: "trellis"}

# The TRELLIS form's code (quantwm/core/trellis.py; measured by benchmarks/trellis_gain.py --tables)
TRELLIS_STATE_BITS = 8  # the state a sample decodes from
MAD_MULT, MAD_ADD = 34038481, 76625530  # QTIP's "1MAD" codebook: a 32-bit linear congruential step of the state,
MAD_CENTER = 510.0  # then the sum of its four bytes less their mean,
MAD_SCALE = 0.006765875034034252  # times 1 / their standard deviation (√(4 (256² − 1) / 12)), exact in fp32
# widths 1-4 decode through stored tables of 2^(k + 4) values (kernels/trellis_tables.py) read by the top k + 4 bits
# of the state, widths 5-8 through the computed codebook read by all 8: the bits of the state each width reads
TRELLIS_TABLE_BITS = (0,) + tuple(min(k + TRELLIS_MEMORY, TRELLIS_STATE_BITS) for k in range(1, 9))
TRELLIS_SCALES = (1.0, 1.0, 1.0, 1.0, 1.0, 1.4, 1.4, 1.4, 1.6)  # the code's scale at widths 0-8 (a table holds its own)
TRELLIS_UNIT_MSE = (1.0, 0.312, 0.0901, 0.025, 0.00651, 0.00204, 0.000642, 0.000308, 0.000124)  # unit Gaussian
# a channel's equivalent grid step (the Jensen term's Δ) per unit of its stored scale: √(12 MSE) / codebook scale
TRELLIS_ERROR_STEP = tuple(0.0 if b == 0 else (12 * m) ** 0.5 / c
                           for b, (m, c) in enumerate(zip(TRELLIS_UNIT_MSE, TRELLIS_SCALES)))


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
    table: torch.Tensor | None = None
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


def rows_of(x: torch.Tensor, mean: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> tuple[int, int, int]:
    """(rows M, samples N, channels D) of a trellis search's samples: an (M, N) x (D = 1), or a span (S, N, D) (M =
    S·D); `mean` and `scale`, the rows' normalisation, both None or both (M,). The kernel and its twin check so."""
    if x.dim() == 2:
        M, N, D = x.shape[0], x.shape[1], 1
    elif x.dim() == 3:
        M, N, D = x.shape[0] * x.shape[2], x.shape[1], x.shape[2]
    else:
        raise ValueError(f"trellis samples must be (rows, samples) or (streams, samples, channels), got {tuple(x.shape)}")
    if (mean is None) != (scale is None) or any(t is not None and tuple(t.shape) != (M,) for t in (mean, scale)):
        raise ValueError(f"need mean and scale both None or both ({M},), got "
                         f"{None if mean is None else tuple(mean.shape)} and {None if scale is None else tuple(scale.shape)}")
    return M, N, D
