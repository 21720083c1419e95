"""Quantize a span against its stored scales and zeros and pack the codes, in one pass: the twin of
quantwm.core.quant.quantize_pack_ref.

x (S, T, D) float; groups run along channels (axis "channel": scale (S, T, D/G)) or along tokens (axis
"token": scale (S, ceil(T/G), D), KIVI's Key layout). Asymmetric: code = round((x - zero) / scale) clamped to
[0, 2^b - 1]; symmetric: round(x / scale) clamped to ±(2^(b-1) - 1), offset by 2^(b-1) - 1. Rounding is to
nearest even and the division is correctly rounded, so codes equal torch's bit for bit. Scales and zeros
(fp16 or fp8) are computed by the caller, who also decides how they are rounded for storage.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _quantize_pack_kernel(x_ptr, scale_ptr, zero_ptr, out_ptr, T, D, n_bytes, n_groups_t,
                          BITS: tl.constexpr, PER: tl.constexpr, G: tl.constexpr, AXIS_TOKEN: tl.constexpr,
                          SYMMETRIC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr):
    s = tl.program_id(0)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    byte = tl.arange(0, BLOCK_B)
    j = tl.arange(0, PER)
    ch = byte[None, :, None] * PER + j[None, None, :]  # (1, BB, PER) channel index
    tt = t[:, None, None]
    mask = (tt < T) & (ch < D)
    x = tl.load(x_ptr + (s * T + tt).to(tl.int64) * D + ch, mask=mask, other=0.0).to(tl.float32)
    if AXIS_TOKEN:  # (S, ceil(T/G), D)
        sidx = (s * n_groups_t + tt // G).to(tl.int64) * D + ch
    else:  # (S, T, D/G)
        sidx = (s * T + tt).to(tl.int64) * (D // G) + ch // G
    sc = tl.load(scale_ptr + sidx, mask=mask, other=1.0).to(tl.float32)
    if SYMMETRIC:
        QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
        y = tl.math.div_rn(x, sc)
    else:
        QMAX: tl.constexpr = (1 << BITS) - 1
        z = tl.load(zero_ptr + sidx, mask=mask, other=0.0).to(tl.float32)
        y = tl.math.div_rn(x - z, sc)
    f = tl.floor(y)
    d = y - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    r = f + tl.where((d > 0.5) | ((d == 0.5) & odd), 1.0, 0.0)  # round half to even, as torch.round
    if SYMMETRIC:
        r = tl.minimum(tl.maximum(r, -QMAX), QMAX) + QMAX
    else:
        r = tl.minimum(tl.maximum(r, 0.0), QMAX)
    c = tl.where(mask, r.to(tl.int32), 0)
    packed = tl.sum(c << (j[None, None, :] * BITS), axis=2)  # (BT, BB)
    omask = (t[:, None] < T) & (byte[None, :] < n_bytes)
    tl.store(out_ptr + (s * T + t[:, None]).to(tl.int64) * n_bytes + byte[None, :], packed.to(tl.uint8), mask=omask)


def quantize_pack(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int, group_size: int,
                  axis: str = "channel", symmetric: bool = False) -> torch.Tensor:
    """x (S, T, D), stored scale/zero in the layout of `axis` -> packed codes uint8 (S, T, D * bits / 8)."""
    if bits not in (2, 4, 8):
        raise ValueError(f"quantize_pack supports bits 2, 4 and 8, got {bits}")
    if axis not in ("channel", "token"):
        raise ValueError(f"axis must be 'channel' or 'token', got {axis!r}")
    if (zero is None) != symmetric:
        raise ValueError("asymmetric grids need zeros and symmetric grids take none")
    S, T, D = x.shape
    if axis == "channel" and D % group_size:
        raise ValueError(f"head dim {D} does not divide by group_size={group_size}")
    n_groups_t = triton.cdiv(T, group_size)
    want = (S, n_groups_t, D) if axis == "token" else (S, T, D // group_size)
    if tuple(scale.shape) != want or (zero is not None and tuple(zero.shape) != want):
        raise ValueError(f"scales/zeros must have shape {want} for axis {axis!r}, got {tuple(scale.shape)}")
    n_bytes = (D * bits + 7) // 8
    out = torch.empty(S, T, n_bytes, dtype=torch.uint8, device=x.device)
    if S and T:
        BLOCK_T = 16
        grid = (S, triton.cdiv(T, BLOCK_T))
        sc = scale.contiguous()
        _quantize_pack_kernel[grid](x.contiguous(), sc, sc if zero is None else zero.contiguous(), out, T, D,
                                    n_bytes, n_groups_t, BITS=bits, PER=8 // bits, G=group_size,
                                    AXIS_TOKEN=axis == "token", SYMMETRIC=symmetric, BLOCK_T=BLOCK_T,
                                    BLOCK_B=triton.next_power_of_2(n_bytes))
    return out
