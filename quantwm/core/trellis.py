"""A bitshift trellis code for one coordinate of a span: fractional-rate coding at an integer number of bits a
sample, read at random (docs/method.md §2.10; issue 44's block code).

A coordinate's N samples, normalised x_t = (y_t − mean) / scale, are coded with k bits each (k = 1..8), exactly
as many bits as a k-bit uniform grid stores, in the same little-endian bitstream (`Channels`' buffer: code t at
bits [t k, t k + k)). What differs is what a code means. The reader of sample t takes the STATE_BITS = L bits of
the stream that end where code t ends, bits [(t + 1) k − L, (t + 1) k) (bits before the coordinate's first one
read 0), as an integer s_t, and decodes

    ŷ_t = mean + scale · CODEBOOK[s_t]      (scale: the coordinate's standard deviation times SCALES[k]).

So s_t = (s_{t−1} >> k) | (code_t << (L − k)): a shift register, and each code picks one of 2^k successors of the
previous state, a path through a trellis of 2^L states. The encoder finds the path of least squared error by the
Viterbi search (one step per token, every sequence and state at once). CODEBOOK holds 2^L values whose histogram
is close to the unit Gaussian's, computed from s alone (QTIP's "1MAD": a 32-bit linear congruential step of s,
then the sum of its four bytes, centred and scaled: `mad`), so the paths through it fill space better than any
scalar grid (the "bitshift trellis" of QTIP, Tseng et al., arXiv 2406.11235). Decoding needs no scan and no
table: one window read and a few integer operations per sample.

Measured on unit-Gaussian tuning samples (24 sequences of 1728, generator seed 7; no trace or world seed):
`python benchmarks/trellis_gain.py --tables`. The mean squared error per sample, at the best of the codebook's
scales 0.8 .. 1.8, against a uniform grid with the allocator's clip search on the same samples:

    k                1      2      3       4        5        6        7        8
    trellis MSE      0.283  0.0753 0.0193  0.00509  0.00137  0.000399 0.000119 0.0000341
    / uniform grid   0.602  0.579  0.477   0.414    0.391    0.403    0.486    0.558
    codebook scale   0.9    1.0    1.1     1.2      1.2      1.3      1.4      1.5

(the Gaussian bound 2^−2k: 0.25, 0.0625, 0.0156, 0.0039; a Lloyd-Max scalar grid: 0.363, 0.118, 0.0345, 0.0095).
The allocator prices a trellis coordinate as its uniform grid's measured error times the ratio (ERROR_RATIO).
The constants the fused kernel needs live in quantwm/kernels/span_args.py.
"""
from __future__ import annotations

import functools
import math

import torch

from ..kernels.span_args import (
    MAD_ADD,
    MAD_CENTER,
    MAD_MULT,
    MAD_SCALE,
    TRELLIS_SCALES,
    TRELLIS_STATE_BITS,
    TRELLIS_UNIT_MSE,
)
from .backend import kernel, use_kernels
from .tables import on_device

STATE_BITS = TRELLIS_STATE_BITS  # L = 12: the state a sample decodes from (4096 trellis states)
WIDTHS = tuple(range(1, 9))  # the widths a trellis coordinate may take
SCALES = TRELLIS_SCALES[1:]  # codebook scale per width 1..8 (module docstring's table)
UNIT_MSE = TRELLIS_UNIT_MSE  # per unit variance, widths 0..8
ERROR_RATIO = (1.0, 0.602, 0.579, 0.477, 0.414, 0.391, 0.403, 0.486, 0.558)  # trellis / uniform MSE, widths 0..8
BACKPOINTER_BYTES = 1 << 27  # the Viterbi search keeps at most this many bytes of backpointers at once
_SCALE_TABLE = torch.tensor(TRELLIS_SCALES, device="cpu")


def mad(state: torch.Tensor) -> torch.Tensor:
    """CODEBOOK[state] computed from the state alone (int64 in, float32 out): x = (MAD_MULT·s + MAD_ADD) mod 2^32,
    the sum of its four bytes, centred and scaled to unit variance. What kernels/span_tiles.py computes in the
    same integer and float32 steps."""
    x = (state.long() * MAD_MULT + MAD_ADD) & 0xFFFFFFFF
    total = (x & 255) + ((x >> 8) & 255) + ((x >> 16) & 255) + (x >> 24)
    return (total.float() - MAD_CENTER) * MAD_SCALE  # an fp32 value: the product is fp32's on any device


@functools.cache
def codebook() -> torch.Tensor:
    """(2^L,) float32 on the host: CODEBOOK[s] for every state (`mad`), the Viterbi search's table."""
    return mad(torch.arange(1 << STATE_BITS, device="cpu"))


def viterbi(x: torch.Tensor, bits: int, values: torch.Tensor) -> torch.Tensor:
    """Codes (M, N) int64 in [0, 2^bits) of the least-squared-error path of every row of x (M, N) through the trellis
    whose state s decodes to values[s] (2^L,), starting from state 0. One step per token for every row and state at
    once; rows in batches whose backpointers (N x rows x 2^(L − bits) bytes) stay within BACKPOINTER_BYTES."""
    M, N = x.shape
    if not 1 <= bits <= 8:
        raise ValueError(f"trellis widths are 1-8 bits, got {bits}")
    n_states, keep = values.numel(), values.numel() >> bits  # 2^L states; each is reached from 2^bits of them
    rows = max(1, BACKPOINTER_BYTES // max(1, N * keep))
    out = torch.empty(M, N, dtype=torch.long, device=x.device)
    for at in range(0, M, rows):  # one batch at the shapes a span meets
        xb = x[at:at + rows].float()
        m = xb.shape[0]
        cost = torch.full((m, n_states), math.inf, device=x.device)
        cost[:, 0] = 0.0
        back = torch.empty(N, m, keep, dtype=torch.uint8, device=x.device)
        for t in range(N):  # s' = (code << (L − bits)) | (s >> bits): the low bits of s are what is forgotten
            best, back[t] = cost.view(m, keep, 1 << bits).min(2)
            cost = best.repeat(1, 1 << bits) + (xb[:, t:t + 1] - values[None]).square()
        state = cost.argmin(1)
        for t in range(N - 1, -1, -1):
            out[at:at + m, t] = state >> (STATE_BITS - bits)
            high = state & (keep - 1)
            state = (high << bits) | back[t].gather(1, high[:, None])[:, 0].long()
    return out


def encode(y: torch.Tensor, widths: torch.Tensor, mean: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Integer codes (S, N, D) of y (S, N, D) coded coordinate by coordinate along its tokens with widths (S, D)
    (0: nothing, code 0) against the stored mean and scale (S, D) (their fp16 values; ŷ = mean + scale ·
    CODEBOOK[state]): kernels/trellis_viterbi.py on the fast path (every width in one launch), else one search per
    width present (`viterbi`; the widths' counts read on the host once)."""
    S, N, D = y.shape
    x = ((y.float() - mean[:, None]) / scale[:, None]).permute(0, 2, 1).reshape(S * D, N)
    flat = widths.reshape(-1).long()
    table = on_device(codebook(), y.device)
    if use_kernels(y):  # one launch per batch of rows, every width at once, nothing read back
        return kernel("trellis_viterbi")(x, flat, table).reshape(S, D, N).permute(0, 2, 1)
    order = flat.argsort(stable=True)  # the rows, grouped by width
    counts = torch.bincount(flat, minlength=len(WIDTHS) + 1).tolist()  # host read: one a span
    codes = torch.zeros(S * D, N, dtype=torch.long, device=y.device)
    start = counts[0]
    for k in WIDTHS:  # at most eight searches a span, one per width present
        rows = order[start:start + counts[k]]
        start += counts[k]
        if counts[k]:
            codes[rows] = viterbi(x[rows], k, table)
    return codes.reshape(S, D, N).permute(0, 2, 1)


def states(buffer: torch.Tensor, offsets: torch.Tensor, widths: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """The state (S, N, D) int64 each sample decodes from: the L bits of its coordinate's stream ending where its
    code ends (bits before the stream read 0), from the uint8 buffer, first bytes `offsets` and widths (S, D)."""
    b = widths.long()[:, None, :]
    end = (torch.arange(n_tokens, device=b.device)[None, :, None] + 1) * b  # (S, N, D) bit after the code
    first = (end - STATE_BITS).clamp_min(0)
    byte = offsets[:, None, :] * 8 + first
    buf = torch.nn.functional.pad(buffer.long(), (0, 3))  # a window spans at most three bytes
    at = torch.where(b > 0, byte >> 3, 0)
    word = buf[at] | (buf[at + 1] << 8) | (buf[at + 2] << 16)
    window = (word >> (byte & 7)) & ((1 << (end - first)) - 1)
    return torch.where(b > 0, window << (STATE_BITS - (end - first)), 0)


def values(state: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """CODEBOOK[state]: the normalised samples (S, N, D) float32, 0 at width 0."""
    return torch.where(widths[:, None, :] > 0, mad(state), 0.0)


def scale_of(std: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """The stored scale (S, D) of coordinates of standard deviation std at widths (S, D): std times the width's
    codebook scale (SCALES; 1 at width 0)."""
    factor = on_device(_SCALE_TABLE, std.device)[widths.long()]
    return std * factor
