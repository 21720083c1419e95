"""Squared error of every channel of a span on uniform grids, for a table of (levels, clip) candidates: the twin of
quantwm.core.allocate.channel_errors_ref (QuantWM's allocator measures these error tables on each span it codes).

One program per (stream, block of channels, candidate) walks the span's sampled tokens in tiles: each channel's grid
(its range [lo, hi] shrunk by the candidate's clip about the middle, low end and step rounded to fp16 as stored)
codes the tile (round half to even, as torch.round, clamped to the candidate's top code) and the squared error is
summed per channel. The span is read once per candidate from L2/HBM instead of materialising candidates × tokens ×
channels values, the cost that dominated the PyTorch twin on a GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FP16_TINY = 6.103515625e-05  # torch.finfo(torch.float16).tiny: the least step a grid stores


@triton.jit
def _channel_errors_kernel(x_ptr, lo_ptr, hi_ptr, qmax_ptr, alpha_ptr, out_ptr, N, D, scale,
                           BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    s = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    c = tl.program_id(2)
    S = tl.num_programs(0)
    on = d < D
    lo = tl.load(lo_ptr + s * D + d, mask=on, other=0.0)
    hi = tl.load(hi_ptr + s * D + d, mask=on, other=0.0)
    qmax = tl.load(qmax_ptr + c)
    alpha = tl.load(alpha_ptr + c)
    mid = (hi + lo) / 2
    half = (hi - lo) / 2 * alpha
    low = (mid - half).to(tl.float16).to(tl.float32)
    step = tl.where(half > 0, tl.math.div_rn(2 * half, qmax), 1.0).to(tl.float16).to(tl.float32)
    step = tl.maximum(step, FP16_TINY)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for n0 in range(0, N, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        m = (n[:, None] < N) & on[None, :]
        x = tl.load(x_ptr + (s * N + n[:, None]).to(tl.int64) * D + d[None, :], mask=m, other=0.0)
        v = tl.math.div_rn(x - low[None, :], step[None, :])
        f = tl.floor(v)
        frac = v - f
        odd = f - 2 * tl.floor(f * 0.5)  # 1 where f is odd: a tie rounds to the even neighbour
        q = tl.where(frac > 0.5, f + 1, tl.where(frac < 0.5, f, f + odd))
        q = tl.minimum(tl.maximum(q, 0.0), qmax)
        e = x - (low[None, :] + q * step[None, :])
        acc += tl.sum(tl.where(m, e * e, 0.0), axis=0)
    tl.store(out_ptr + (c * S + s) * D + d, acc * scale, mask=on)


def channel_errors(sample: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, qmax: torch.Tensor,
                   alpha: torch.Tensor, scale: float) -> torch.Tensor:
    """sample (S, n, D) float32, lo/hi (S, D) its per-channel range, qmax/alpha (C,) each candidate's top code
    2^b − 1 and clip -> (C, S, D) float32: Σ_t (x − Q(x))² per channel, times `scale`."""
    if sample.dim() != 3 or lo.shape != sample.shape[::2] or hi.shape != lo.shape or qmax.shape != alpha.shape:
        raise ValueError(f"expected sample (S, n, D), lo/hi (S, D), qmax/alpha (C,), got {tuple(sample.shape)}, "
                         f"{tuple(lo.shape)}, {tuple(hi.shape)}, {tuple(qmax.shape)}, {tuple(alpha.shape)}")
    S, N, D = sample.shape
    C = qmax.shape[0]
    out = torch.zeros(C, S, D, dtype=torch.float32, device=sample.device)
    if S and D and C:
        BLOCK_D = min(64, max(16, triton.next_power_of_2(D)))
        grid = (S, triton.cdiv(D, BLOCK_D), C)
        _channel_errors_kernel[grid](sample.float().contiguous(), lo.float().contiguous(), hi.float().contiguous(),
                                     qmax.float().contiguous(), alpha.float().contiguous(), out, N, D, float(scale),
                                     BLOCK_N=32, BLOCK_D=BLOCK_D)
    return out
