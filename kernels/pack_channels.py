"""A span's residual coded on per-channel grids (each set from the channel's range and clip) and packed into the
`Channels` buffer in one pass: the twin of
quantwm.core.layouts.channels.pack_channels_ref (QuantWM's allocator format, docs/method.md §2.6).

Channel i of stream s holds N codes of b_si bits (0-8) from its first byte, code t at bits [t b, t b + b),
little-endian, so a code may straddle two bytes; channels start on whole bytes (quantwm/core/layouts/channels.py).
One program per (block of 16 neighbouring channels, block of 32 bytes of each): each byte gathers the (at most 9)
codes that touch it, each code round((x − low) / step) half to even, as torch.round, clamped to [0, 2^b − 1], and
writes the byte once. Nothing of tokens x channels size is materialised; bytes past the last channel stay as the
caller zeroed them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FP16_TINY = tl.constexpr(6.103515625e-05)  # torch.finfo(torch.float16).tiny: the least step a grid stores (a constexpr: a
# kernel may read no other global)


@triton.jit
def _pack_channels_kernel(x_ptr, lo_ptr, hi_ptr, alpha_ptr, bits_ptr, off_ptr, out_ptr, low_ptr, step_ptr, N, D, C,
                          BLOCK_C: tl.constexpr, BLOCK_B: tl.constexpr):
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)  # channels s * D + i: neighbours in memory
    cmask = c < C
    s = c // D
    i = c % D
    b = tl.load(bits_ptr + c, mask=cmask, other=0)
    off = tl.load(off_ptr + c, mask=cmask, other=0)
    top = (1 << b) - 1
    lo = tl.load(lo_ptr + c, mask=cmask, other=0.0)
    hi = tl.load(hi_ptr + c, mask=cmask, other=0.0)
    mid = (hi + lo) / 2  # the grid: [lo, hi] shrunk by alpha about its middle, low end and step stored in fp16
    half = (hi - lo) / 2 * tl.load(alpha_ptr + c, mask=cmask, other=0.0)
    low = (mid - half).to(tl.float16).to(tl.float32)
    step = tl.where(half > 0, tl.math.div_rn(2 * half, tl.maximum(top, 1).to(tl.float32)), 1.0)
    step = tl.maximum(step.to(tl.float16).to(tl.float32), FP16_TINY)
    low, step = tl.where(b > 0, low, 0.0), tl.where(b > 0, step, 1.0)  # 0 bits: no grid (decodes to 0)
    if tl.program_id(1) == 0:
        tl.store(low_ptr + c, low, mask=cmask)
        tl.store(step_ptr + c, step, mask=cmask)
    nbytes = (N * b + 7) // 8
    j = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)  # the channels' bytes: (BLOCK_C, BLOCK_B) below
    on = cmask[:, None] & (j[None, :] < nbytes[:, None])
    first = (8 * j[None, :]) // tl.maximum(b, 1)[:, None]  # the first code that touches byte j
    acc = tl.zeros((BLOCK_C, BLOCK_B), tl.int32)
    for k in tl.static_range(9):  # a byte meets at most 8 one-bit codes and one that straddles into it
        t = first + k
        p = t * b[:, None] - 8 * j[None, :]  # the code's first bit within the byte (negative: began in the byte before)
        hit = on & (t < N) & (p < 8)
        x = tl.load(x_ptr + (s[:, None] * N + t).to(tl.int64) * D + i[:, None], mask=hit, other=0.0)
        v = tl.math.div_rn(x - low[:, None], step[:, None])
        f = tl.floor(v)
        frac = v - f
        q = tl.where(frac > 0.5, f + 1, tl.where(frac < 0.5, f, f + (f - 2 * tl.floor(f * 0.5))))
        q = tl.minimum(tl.maximum(q, 0.0), top.to(tl.float32)[:, None]).to(tl.int32)
        part = tl.where(p >= 0, q << tl.maximum(p, 0), q >> tl.maximum(-p, 0)) & 255
        acc = acc | tl.where(hit, part, 0)
    tl.store(out_ptr + off[:, None] + j[None, :], acc.to(tl.uint8), mask=on & (b > 0)[:, None])


def pack_channels(r: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, alpha: torch.Tensor, bits: torch.Tensor,
                  offsets: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """r (S, N, D) float32; per channel (S, D): its range lo/hi, clip alpha, width bits (0-8) and first byte
    offsets -> (the uint8 buffer (total,), zeros past the last channel; low (S, D) and step (S, D) of each
    channel's grid, float32 holding their fp16 values; 0 and 1 on 0-bit channels)."""
    shapes = (lo.shape, hi.shape, alpha.shape, bits.shape, offsets.shape)
    if r.dim() != 3 or any(x != r.shape[::2] for x in shapes):
        raise ValueError(f"expected r (S, N, D) and lo, hi, alpha, bits, offsets (S, D), got {tuple(r.shape)}, "
                         f"{[tuple(x) for x in shapes]}")
    S, N, D = r.shape
    out = torch.zeros(total, dtype=torch.uint8, device=r.device)
    low = torch.zeros(S, D, dtype=torch.float32, device=r.device)
    step = torch.ones(S, D, dtype=torch.float32, device=r.device)
    if S and N and D:
        BLOCK_C, BLOCK_B = 16, 32
        grid = (triton.cdiv(S * D, BLOCK_C), triton.cdiv(N, BLOCK_B))  # a channel has at most N bytes (8 bits a code)
        _pack_channels_kernel[grid](r.float().contiguous(), lo.float().contiguous(), hi.float().contiguous(),
                                    alpha.float().contiguous(), bits.to(torch.int32).contiguous(),
                                    offsets.to(torch.int64).contiguous(), out, low, step, N, D, S * D,
                                    BLOCK_C=BLOCK_C, BLOCK_B=BLOCK_B)
    return out, low, step
