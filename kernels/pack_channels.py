"""A span's residual coded on per-channel grids (each set from the channel's range and clip) and packed into the
`Channels` buffer in one pass: the twin of
quantwm.core.layouts.channels.pack_channels_ref (QuantWM's allocator format, docs/method.md §2.6).

Channel i of stream s holds N codes of b_si bits (0-8) from its first byte, code t at bits [t b, t b + b),
little-endian, so a code may straddle two bytes; channels start on whole bytes (quantwm/core/layouts/channels.py).
One program per (block of 16 neighbouring channels, block of 32 bytes of each): each byte gathers the (at most 9)
codes that touch it, each code round((x − low) / step) half to even, as torch.round, clamped to [0, 2^b − 1], and
writes the byte once. Nothing of tokens x channels size is materialised; bytes past the last channel stay as the
caller zeroed them. Asked for (`sums`), each program also writes, per channel, four sums over the codes whose first
bit lies in its bytes (so every token counts once): of u = x − mid (mid the middle of the channel's range), u², c =
code − (2^b − 1)/2 and c·u, the partial sums kernels/unshrink_channels.py adds up to stretch the grid to a slope of
1 (docs/method.md §2.6, step 5) without reading the span again. Given the trellis's states (quantwm-trellis, §2.10)
and which channels stay on their grid (kernels/trellis_choice.py), a trellis channel's code t is instead the top b
bits of its state t (state >> (L − b)), packed the same way.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .grid_tiles import _channel_grid, _grid_code
from .span_args import TRELLIS_STATE_BITS

BLOCK_C, BLOCK_B = 16, 32  # a program's channels and bytes of each (16 x 64 spilled on sm_90: docs/kernels.md)
STATE_BITS = tl.constexpr(TRELLIS_STATE_BITS)  # L: a trellis code is its state's top bits


@triton.jit
def _pack_channels_kernel(x_ptr, lo_ptr, hi_ptr, alpha_ptr, bits_ptr, off_ptr, out_ptr, low_ptr, step_ptr, read_ptr,
                          sums_ptr, state_ptr, grid_ptr, N, D, C, NB, BLOCK_C: tl.constexpr, BLOCK_B: tl.constexpr,
                          SUMS: tl.constexpr, TRELLIS: tl.constexpr):
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)  # channels s * D + i: neighbours in memory
    cmask = c < C
    s = c // D
    i = c % D
    b = tl.load(bits_ptr + c, mask=cmask, other=0)
    off = tl.load(off_ptr + c, mask=cmask, other=0)
    top = (1 << b) - 1
    lo = tl.load(lo_ptr + c, mask=cmask, other=0.0)
    hi = tl.load(hi_ptr + c, mask=cmask, other=0.0)
    mid, low, step = _channel_grid(lo, hi, tl.load(alpha_ptr + c, mask=cmask, other=0.0), b, top)
    if TRELLIS:
        on_grid = tl.load(grid_ptr + c, mask=cmask, other=0) != 0
    if tl.program_id(1) == 0:
        tl.store(low_ptr + c, low.to(tl.float16), mask=cmask)  # exact: both already hold fp16 values
        tl.store(step_ptr + c, step.to(tl.float16), mask=cmask)
        tl.store(read_ptr + c, low, mask=cmask)
    nbytes = (N * b + 7) // 8
    j = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)  # the channels' bytes: (BLOCK_C, BLOCK_B) below
    on = cmask[:, None] & (j[None, :] < nbytes[:, None])
    first = (8 * j[None, :]) // tl.maximum(b, 1)[:, None]  # the first code that touches byte j
    acc = tl.zeros((BLOCK_C, BLOCK_B), tl.int32)
    centre = (top.to(tl.float32) / 2)[:, None]  # the codes' middle, (2^b - 1) / 2
    su = tl.zeros((BLOCK_C, BLOCK_B), tl.float32)  # the sums' terms, added up over the bytes at the end
    suu = tl.zeros((BLOCK_C, BLOCK_B), tl.float32)
    sc = tl.zeros((BLOCK_C, BLOCK_B), tl.float32)
    scu = tl.zeros((BLOCK_C, BLOCK_B), tl.float32)
    for k in tl.static_range(9):  # a byte meets at most 8 one-bit codes and one that straddles into it
        t = first + k
        p = t * b[:, None] - 8 * j[None, :]  # the code's first bit within the byte (negative: began in the byte before)
        hit = on & (t < N) & (p < 8)
        x = tl.load(x_ptr + (s[:, None] * N + t).to(tl.int64) * D + i[:, None], mask=hit, other=0.0)
        qf = _grid_code(x, low[:, None], step[:, None], top.to(tl.float32)[:, None])
        q = qf.to(tl.int32)
        if TRELLIS:  # a trellis channel's code: its state's top b bits
            state = tl.load(state_ptr + c.to(tl.int64)[:, None] * N + t, mask=hit, other=0).to(tl.int32)
            q = tl.where(on_grid[:, None], q, state >> (-b + STATE_BITS)[:, None])
        part = tl.where(p >= 0, q << tl.maximum(p, 0), q >> tl.maximum(-p, 0)) & 255
        acc = acc | tl.where(hit, part, 0)
        if SUMS:  # each code counted in the byte that holds its first bit
            u = tl.where(hit & (p >= 0), x - mid[:, None], 0.0)
            cq = tl.where(hit & (p >= 0), qf - centre, 0.0)
            su += u
            suu += u * u
            sc += cq
            scu += cq * u
    tl.store(out_ptr + off[:, None] + j[None, :], acc.to(tl.uint8), mask=on & (b > 0)[:, None])
    if SUMS:  # (4, C, NB): every (channel, block) written, zeros where the block holds no code of the channel
        at = c.to(tl.int64) * NB + tl.program_id(1)
        tl.store(sums_ptr + at, tl.sum(su, 1), mask=cmask)
        tl.store(sums_ptr + C * NB + at, tl.sum(suu, 1), mask=cmask)
        tl.store(sums_ptr + 2 * C * NB + at, tl.sum(sc, 1), mask=cmask)
        tl.store(sums_ptr + 3 * C * NB + at, tl.sum(scu, 1), mask=cmask)


def pack_channels(r: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, alpha: torch.Tensor, bits: torch.Tensor,
                  offsets: torch.Tensor, total: int, sums: bool = False, states: torch.Tensor | None = None,
                  grid: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """r (S, N, D) float32; per channel (S, D): its range lo/hi, clip alpha, width bits (0-8) and first byte
    offsets -> (the uint8 buffer (total,), zeros past the last channel; low (S, D) and step (S, D) fp16 of each
    channel's grid, 0 and 1 on 0-bit channels; low as float32, as the kernel view reads it), and with `sums` the
    partial sums (4, S·D, ceil(N / BLOCK_B)) float32 of u, u², c and c·u per block of BLOCK_B bytes (the module).
    Given `states` (S, D, N) uint8, a trellis's paths, and `grid` (S, D) bool, the channels kept on their grid, the
    other channels' codes are their states' top bits (no sums then)."""
    shapes = (lo.shape, hi.shape, alpha.shape, bits.shape, offsets.shape)
    if r.dim() != 3 or any(x != r.shape[::2] for x in shapes):
        raise ValueError(f"expected r (S, N, D) and lo, hi, alpha, bits, offsets (S, D), got {tuple(r.shape)}, "
                         f"{[tuple(x) for x in shapes]}")
    S, N, D = r.shape
    trellis = states is not None
    if trellis != (grid is not None) or (trellis and sums):
        raise ValueError("trellis states and their grid flags go together, and without sums")
    if trellis and (tuple(states.shape) != (S, D, N) or states.dtype != torch.uint8 or tuple(grid.shape) != (S, D)):
        raise ValueError(f"expected states (S, D, N) = {(S, D, N)} uint8 and grid (S, D), got "
                         f"{tuple(states.shape)} {states.dtype} and {tuple(grid.shape)}")
    out = torch.zeros(total, dtype=torch.uint8, device=r.device)
    low = torch.zeros(S, D, dtype=torch.float16, device=r.device)
    step = torch.ones(S, D, dtype=torch.float16, device=r.device)
    read = torch.zeros(S, D, dtype=torch.float32, device=r.device)
    NB = triton.cdiv(N, BLOCK_B)  # a channel has at most N bytes (8 bits a code)
    partial = torch.empty(4, S * D, NB, dtype=torch.float32, device=r.device) if sums else read
    if S and N and D:
        state_arg = states.contiguous() if trellis else out  # unread unless TRELLIS
        grid_arg = grid.to(torch.int8).contiguous() if trellis else out
        _pack_channels_kernel[(triton.cdiv(S * D, BLOCK_C), NB)](
            r.float().contiguous(), lo.float().contiguous(), hi.float().contiguous(), alpha.float().contiguous(),
            bits.to(torch.int32).contiguous(), offsets.to(torch.int64).contiguous(), out, low, step, read, partial,
            state_arg, grid_arg, N, D, S * D, NB, BLOCK_C=BLOCK_C, BLOCK_B=BLOCK_B, SUMS=sums, TRELLIS=trellis,
            num_warps=8 if trellis else 4)  # with states at 4 warps it spilled 40 B on sm_90
    return (out, low, step, read, partial) if sums else (out, low, step, read)
