"""Each channel's squared error on uniform grids at every width of a table, with its best clip: the twin of
quantwm.core.allocate.channel_errors_ref (QuantWM's allocator measures these error tables on each span it codes).

One program per (stream, block of channels, width): for each clip of the table (six up to 4 bits, two above) the
channel's grid (its range [lo, hi] shrunk by the clip about the middle, low end and step rounded to fp16 as stored)
codes the sampled tokens tile by tile (round half to even, as torch.round, clamped to 2^b − 1) and the squared
error is summed per channel; the least error and its clip are kept (the first of equal ones). Width 0 stores
nothing: its error is the channel's energy. The span is read once per clip; nothing of candidates x tokens x
channels size is materialised.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .grid_tiles import _channel_grid, _grid_code


@triton.jit
def _channel_errors_kernel(x_ptr, lo_ptr, hi_ptr, qmax_ptr, clips_ptr, err_ptr, clip_ptr, N, D, scale,
                           BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    s = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    j = tl.program_id(2)
    S = tl.num_programs(0)
    on = d < D
    lo = tl.load(lo_ptr + s * D + d, mask=on, other=0.0)
    hi = tl.load(hi_ptr + s * D + d, mask=on, other=0.0)
    qmax = tl.load(qmax_ptr + j)  # 2^b − 1: 0 at width 0
    n_clips = tl.where(qmax > 0, tl.where(qmax <= 15, 6, 2), 1)
    best = tl.full((BLOCK_D,), float("inf"), tl.float32)
    chosen = tl.full((BLOCK_D,), 1.0, tl.float32)
    for c in range(0, n_clips):
        alpha = tl.load(clips_ptr + c)
        _, low, step = _channel_grid(lo, hi, alpha, qmax, qmax)  # width 0 (qmax 0): its error is x itself, below
        acc = tl.zeros((BLOCK_D,), tl.float32)
        for n0 in range(0, N, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            m = (n[:, None] < N) & on[None, :]
            x = tl.load(x_ptr + (s * N + n[:, None]).to(tl.int64) * D + d[None, :], mask=m, other=0.0)
            q = _grid_code(x, low[None, :], step[None, :], qmax)
            e = tl.where(qmax > 0, x - (low[None, :] + q * step[None, :]), x)  # width 0: nothing stored
            acc += tl.sum(tl.where(m, e * e, 0.0), axis=0)
        acc = acc * scale
        better = acc < best
        chosen = tl.where(better, tl.where(qmax > 0, alpha, 1.0), chosen)
        best = tl.where(better, acc, best)
    tl.store(err_ptr + (j * S + s) * D + d, best, mask=on)
    tl.store(clip_ptr + (j * S + s) * D + d, chosen, mask=on)


def channel_errors(sample: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, qmax: torch.Tensor,
                   clips: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """sample (S, n, D) float32, lo/hi (S, D) its per-channel range, qmax (L,) each width's top code 2^b − 1 (0:
    width 0), clips (6,) -> (errors (L, S, D) float32: min over the width's clips (six up to 4 bits, two above) of
    Σ_t (x − Q(x))², times `scale`; the clip (L, S, D) that gave it, 1 at width 0)."""
    if sample.dim() != 3 or lo.shape != sample.shape[::2] or hi.shape != lo.shape or qmax.dim() != 1 \
            or clips.shape != (6,):
        raise ValueError(f"expected sample (S, n, D), lo/hi (S, D), qmax (L,), clips (6,), got {tuple(sample.shape)}, "
                         f"{tuple(lo.shape)}, {tuple(hi.shape)}, {tuple(qmax.shape)}, {tuple(clips.shape)}")
    S, N, D = sample.shape
    L = qmax.shape[0]
    err = torch.zeros(L, S, D, dtype=torch.float32, device=sample.device)
    clip = torch.ones(L, S, D, dtype=torch.float32, device=sample.device)
    if S and D and L:
        BLOCK_D = min(64, max(16, triton.next_power_of_2(D)))
        grid = (S, triton.cdiv(D, BLOCK_D), L)
        _channel_errors_kernel[grid](sample.float().contiguous(), lo.float().contiguous(), hi.float().contiguous(),
                                     qmax.float().contiguous(), clips.float().contiguous(), err, clip, N, D,
                                     float(scale), BLOCK_N=32, BLOCK_D=BLOCK_D)
    return err, clip
