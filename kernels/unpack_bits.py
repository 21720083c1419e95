"""Unpack little-endian bit rows into codes: the twin of quantwm.core.quant.unpack_bits_ref.

Code i of a row is (byte[i*b // 8] >> (i*b % 8)) & (2^b - 1) for b in {2, 4, 8}. One program unpacks a
(BLOCK_R rows x BLOCK_N codes) tile; each code reads its own byte (neighbours share it through the cache).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _unpack_bits_kernel(packed_ptr, out_ptr, R, n, n_bytes,
                        BITS: tl.constexpr, PER: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    col = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < R) & (col[None, :] < n)
    b = tl.load(packed_ptr + rows[:, None].to(tl.int64) * n_bytes + col[None, :] // PER, mask=mask, other=0)
    code = (b.to(tl.int32) >> ((col[None, :] % PER) * BITS)) & ((1 << BITS) - 1)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * n + col[None, :], code.to(tl.uint8), mask=mask)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """uint8 (..., ceil(n * bits / 8)) -> uint8 codes (..., n); bits in {2, 4, 8}."""
    if bits not in (2, 4, 8):
        raise ValueError(f"unpack_bits supports bits 2, 4 and 8, got {bits}")
    *lead, n_bytes = packed.shape
    if n_bytes != (n * bits + 7) // 8:
        raise ValueError(f"packed row has {n_bytes} bytes, expected {(n * bits + 7) // 8} for n={n}, bits={bits}")
    p = packed.reshape(-1, n_bytes).contiguous()
    R = p.shape[0]
    out = torch.empty(R, n, dtype=torch.uint8, device=packed.device)
    if R and n:
        BLOCK_R, BLOCK_N = 16, min(128, triton.next_power_of_2(n))
        grid = (triton.cdiv(R, BLOCK_R), triton.cdiv(n, BLOCK_N))
        _unpack_bits_kernel[grid](p, out, R, n, n_bytes, BITS=bits, PER=8 // bits, BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N)
    return out.reshape(*lead, n)
