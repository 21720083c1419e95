"""quantwm-trellis's per-channel choice at commit, after the Viterbi search: each coded channel kept on whichever of
its two codes errs less over the span, the trellis (as the search's path of states decodes) or its uniform grid (as
quantwm-alloc's allocator sets it), and asked for, its decode stretched to a least-squares slope of 1 on the values
it coded (docs/method.md §2.6 step 5, §2.10): the twin of quantwm.core.layouts.trellis.trellis_choice_ref.

Per channel (stream s, channel i; BLOCK_C neighbouring channels a program, the span's tokens BLOCK_N at a time): the
grid is the channel's range [lo, hi] shrunk by alpha about its middle with 2^b levels (low end and step rounded to
fp16, as kernels/pack_channels.py sets them), a value's code round((x − low) / step) half to even, clamped; the
trellis decodes sample t to low + step · table[b, state_t] (the trellis's mean and scale, already fp16 values). The
program adds up both decodes' squared errors and, for the stretch, the sums of u = x − mid, u² and each decode's
deviation from mid and its product with u, then stores the chosen channel's flag and its two fp16 numbers (the
stretched ones where asked: slope = cov(decode, x) / var(x), kept in [floor, 1]; 0-bit channels keep low 0 and step
1). One launch, one read of the span and of the states; nothing comes back to the host. The codes themselves are
packed by kernels/pack_channels.py given the states and the flags.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .grid_tiles import _channel_grid, _grid_code
from .span_args import TRELLIS_STATE_BITS

BLOCK_C, BLOCK_N, WARPS = 32, 32, 8  # a program's channels, the tokens it reads at a time, its warps
STATE_BITS = tl.constexpr(TRELLIS_STATE_BITS)  # L: a b-bit sample's value is table[b · 2^L + its window]


@triton.jit
def _trellis_choice_kernel(x_ptr, state_ptr, table_ptr, lo_ptr, hi_ptr, alpha_ptr, bits_ptr, tlow_ptr, tstep_ptr,
                           grid_out, low_out, step_out, read_out, N, n, D, C, floor,
                           UNBIAS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr):
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)  # channels s * D + i: neighbours in memory
    cmask = c < C
    s = c // D
    i = c % D
    b = tl.load(bits_ptr + c, mask=cmask, other=0)
    top = (1 << b) - 1
    lo = tl.load(lo_ptr + c, mask=cmask, other=0.0)
    hi = tl.load(hi_ptr + c, mask=cmask, other=0.0)
    mid, g_low, g_step = _channel_grid(lo, hi, tl.load(alpha_ptr + c, mask=cmask, other=0.0), b, top)  # as packed
    t_low = tl.load(tlow_ptr + c, mask=cmask, other=0.0)
    t_step = tl.load(tstep_ptr + c, mask=cmask, other=1.0)
    e_grid = tl.zeros((BLOCK_N, BLOCK_C), tl.float32)
    e_trellis = tl.zeros((BLOCK_N, BLOCK_C), tl.float32)
    su = tl.zeros((BLOCK_N, BLOCK_C), tl.float32)  # the stretch's sums (UNBIAS), added up over the tokens at the end
    suu = tl.zeros((BLOCK_N, BLOCK_C), tl.float32)
    sg = tl.zeros((BLOCK_N, BLOCK_C), tl.float32)
    sgu = tl.zeros((BLOCK_N, BLOCK_C), tl.float32)
    st = tl.zeros((BLOCK_N, BLOCK_C), tl.float32)
    stu = tl.zeros((BLOCK_N, BLOCK_C), tl.float32)
    for n0 in range(0, N, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        m = (t[:, None] < N) & cmask[None, :]
        x = tl.load(x_ptr + (s[None, :] * N + t[:, None]).to(tl.int64) * D + i[None, :], mask=m, other=0.0)
        q = _grid_code(x, g_low[None, :], g_step[None, :], top.to(tl.float32)[None, :])
        on_grid = g_low[None, :] + q * g_step[None, :]
        state = tl.load(state_ptr + c.to(tl.int64)[None, :] * N + t[:, None], mask=m, other=0)
        value = tl.load(table_ptr + ((b << STATE_BITS)[None, :] + state.to(tl.int32)), mask=m, other=0.0)
        on_trellis = t_low[None, :] + value * t_step[None, :]
        e_grid += tl.where(m, (on_grid - x) * (on_grid - x), 0.0)
        e_trellis += tl.where(m, (on_trellis - x) * (on_trellis - x), 0.0)
        if UNBIAS:
            u = tl.where(m, x - mid[None, :], 0.0)
            dg = tl.where(m, on_grid - mid[None, :], 0.0)
            dt = tl.where(m, on_trellis - mid[None, :], 0.0)
            su += u
            suu += u * u
            sg += dg
            sgu += dg * u
            st += dt
            stu += dt * u
    grid = (b > 0) & (tl.sum(e_grid, 0) < tl.sum(e_trellis, 0))
    low = tl.where(grid, g_low, t_low)
    step = tl.where(grid, g_step, t_step)
    if UNBIAS:
        mean_u = tl.math.div_rn(tl.sum(su, 0), n)
        var = tl.math.div_rn(tl.sum(suu, 0), n) - mean_u * mean_u
        mean_d = tl.math.div_rn(tl.where(grid, tl.sum(sg, 0), tl.sum(st, 0)), n)
        cov = tl.math.div_rn(tl.where(grid, tl.sum(sgu, 0), tl.sum(stu, 0)), n) - mean_d * mean_u
        live = (b > 0) & (var > 0) & (cov > 0)
        slope = tl.where(live, tl.math.div_rn(cov, tl.where(live, var, 1.0)), 1.0)
        slope = tl.minimum(tl.maximum(slope, floor), 1.0)
        shrunk = live & (slope < 1)  # the rest keep their numbers bit for bit
        mean = mid + mean_d
        low = tl.where(shrunk, mean + tl.math.div_rn(low - mean, slope), low)
        step = tl.where(shrunk, tl.math.div_rn(step, slope), step)
    low16 = low.to(tl.float16)
    tl.store(grid_out + c, grid.to(tl.int8), mask=cmask)
    tl.store(low_out + c, low16, mask=cmask)
    tl.store(step_out + c, step.to(tl.float16), mask=cmask)
    tl.store(read_out + c, tl.where(b > 0, low16.to(tl.float32), 0.0), mask=cmask)


def trellis_choice(r: torch.Tensor, states: torch.Tensor, table: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                   alpha: torch.Tensor, bits: torch.Tensor, low: torch.Tensor, step: torch.Tensor, unbias: bool,
                   floor: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """r (S, N, D) float32; states (S, D, N) uint8 (the search's paths, row by row); table (9, 2^L) float32 the
    widths' values of each window (quantwm.core.trellis.tables); per channel (S, D): the range lo/hi, the grid's
    clip alpha, the width bits (0-8), the trellis's mean low and scale step (fp16 values); unbias, and the least
    slope undone, floor in (0, 1] -> (grid (S, D) bool: the channels kept on their grid; low, step (S, D) fp16 of
    the code kept, stretched where unbias; low as float32, 0 on 0-bit channels, as the kernel view reads it) (the
    module)."""
    S, N, D = r.shape
    shapes = (lo.shape, hi.shape, alpha.shape, bits.shape, low.shape, step.shape)
    if r.dim() != 3 or tuple(states.shape) != (S, D, N) or any(x != (S, D) for x in shapes):
        raise ValueError(f"expected r (S, N, D), states (S, D, N) and lo, hi, alpha, bits, low, step (S, D), got "
                         f"{tuple(r.shape)}, {tuple(states.shape)}, {[tuple(x) for x in shapes]}")
    if states.dtype != torch.uint8 or tuple(table.shape) != (9, 1 << TRELLIS_STATE_BITS):
        raise ValueError(f"trellis states must be uint8 and the widths' tables (9, {1 << TRELLIS_STATE_BITS}), got "
                         f"{states.dtype} and {tuple(table.shape)}")
    if not 0 < floor <= 1:
        raise ValueError(f"the least slope undone must be in (0, 1], got {floor}")
    grid = torch.zeros(S, D, dtype=torch.int8, device=r.device)
    new_low = torch.zeros(S, D, dtype=torch.float16, device=r.device)
    new_step = torch.ones(S, D, dtype=torch.float16, device=r.device)
    read = torch.zeros(S, D, dtype=torch.float32, device=r.device)
    if S and N and D:
        _trellis_choice_kernel[(triton.cdiv(S * D, BLOCK_C),)](
            r.float().contiguous(), states.contiguous(), table.float().contiguous(), lo.float().contiguous(),
            hi.float().contiguous(), alpha.float().contiguous(), bits.to(torch.int32).contiguous(),
            low.float().contiguous(), step.float().contiguous(), grid, new_low, new_step, read, N, float(N), D, S * D,
            float(floor), UNBIAS=bool(unbias), BLOCK_C=BLOCK_C, BLOCK_N=BLOCK_N, num_warps=WARPS)
    return grid.bool(), new_low, new_step, read
