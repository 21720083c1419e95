"""A span's per-channel grids stretched so that each coded channel's decode has a least-squares slope of 1 on the
values it coded (docs/method.md §2.6, step 5), from the partial sums kernels/pack_channels.py wrote while it coded
them: the twin of quantwm.core.layouts.channels.unshrink_channels_ref.

Per channel (S·D of them, BLOCK_C a program): the four sums over its N tokens, added up block by block, of u = x −
mid, u², c = code − (2^b − 1)/2 and c·u give the values' variance var(x) and the codes' covariance with them,
cov(c, x); the grid's slope is s = step · cov(c, x) / var(x), kept in [floor, 1] (1 where the channel has no
width, no spread or no positive covariance; those channels, and any at s = 1, keep their grids). The decode is
stretched about its mean m = low + step · (mean c + (2^b − 1)/2): low' = m + (low − m) / s, step' = step / s, both
stored in fp16, and low' as float32 where the kernel view reads it (0 on 0-bit channels). One launch; the span is
not read again.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_C, BLOCK_P = 32, 32  # a program's channels; partial sums added BLOCK_P at a time


@triton.jit
def _unshrink_channels_kernel(sums_ptr, bits_ptr, low_ptr, step_ptr, low_out, step_out, read_out, n, C, NB, floor,
                              BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr):
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    acc_u = tl.zeros((BLOCK_C, BLOCK_P), tl.float32)
    acc_uu = tl.zeros((BLOCK_C, BLOCK_P), tl.float32)
    acc_c = tl.zeros((BLOCK_C, BLOCK_P), tl.float32)
    acc_cu = tl.zeros((BLOCK_C, BLOCK_P), tl.float32)
    for p0 in range(0, NB, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        m = cmask[:, None] & (p[None, :] < NB)
        at = c.to(tl.int64)[:, None] * NB + p[None, :]
        acc_u += tl.load(sums_ptr + at, mask=m, other=0.0)
        acc_uu += tl.load(sums_ptr + C * NB + at, mask=m, other=0.0)
        acc_c += tl.load(sums_ptr + 2 * C * NB + at, mask=m, other=0.0)
        acc_cu += tl.load(sums_ptr + 3 * C * NB + at, mask=m, other=0.0)
    mean_u = tl.math.div_rn(tl.sum(acc_u, 1), n)
    mean_c = tl.math.div_rn(tl.sum(acc_c, 1), n)
    var = tl.math.div_rn(tl.sum(acc_uu, 1), n) - mean_u * mean_u
    cov = tl.math.div_rn(tl.sum(acc_cu, 1), n) - mean_c * mean_u
    b = tl.load(bits_ptr + c, mask=cmask, other=0)
    low = tl.load(low_ptr + c, mask=cmask, other=0.0).to(tl.float32)
    step = tl.load(step_ptr + c, mask=cmask, other=1.0).to(tl.float32)
    live = (b > 0) & (var > 0) & (cov > 0)
    s = tl.where(live, tl.math.div_rn(step * cov, tl.where(live, var, 1.0)), 1.0)
    s = tl.minimum(tl.maximum(s, floor), 1.0)
    shrunk = live & (s < 1)  # the rest keep their grids bit for bit
    mean = low + step * (mean_c + ((1 << b) - 1).to(tl.float32) / 2)
    new_low = tl.where(shrunk, mean + tl.math.div_rn(low - mean, s), low).to(tl.float16)
    tl.store(low_out + c, new_low, mask=cmask)
    tl.store(step_out + c, tl.where(shrunk, tl.math.div_rn(step, s), step).to(tl.float16), mask=cmask)
    tl.store(read_out + c, tl.where(b > 0, new_low.to(tl.float32), 0.0), mask=cmask)


def unshrink_channels(sums: torch.Tensor, bits: torch.Tensor, low: torch.Tensor, step: torch.Tensor, n_tokens: int,
                      floor: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """sums (4, S·D, blocks) float32 (pack_channels' partial sums), widths bits (S, D), the grids' low ends and steps
    (S, D) fp16, the span's N tokens and the least slope undone, floor in (0, 1] -> (low, step (S, D) fp16, low as
    float32 with 0 on 0-bit channels) of the stretched grids (the module)."""
    S, D = bits.shape
    if sums.dim() != 3 or sums.shape[:2] != (4, S * D) or low.shape != bits.shape or step.shape != bits.shape:
        raise ValueError(f"expected sums (4, S*D, blocks) and bits, low, step (S, D), got {tuple(sums.shape)}, "
                         f"{tuple(bits.shape)}, {tuple(low.shape)}, {tuple(step.shape)}")
    if not 0 < floor <= 1:
        raise ValueError(f"the least slope undone must be in (0, 1], got {floor}")
    if not (S * D and n_tokens):  # nothing to stretch: the grids as they are
        return low.half(), step.half(), torch.where(bits > 0, low.float(), 0.0)
    new_low = torch.empty(S, D, dtype=torch.float16, device=low.device)
    new_step = torch.empty(S, D, dtype=torch.float16, device=low.device)
    read = torch.empty(S, D, dtype=torch.float32, device=low.device)
    _unshrink_channels_kernel[(triton.cdiv(S * D, BLOCK_C),)](
        sums.contiguous(), bits.to(torch.int32).contiguous(), low.half().contiguous(), step.half().contiguous(),
        new_low, new_step, read, float(n_tokens), S * D, sums.shape[2], float(floor), BLOCK_C=BLOCK_C, BLOCK_P=BLOCK_P)
    return new_low, new_step, read
