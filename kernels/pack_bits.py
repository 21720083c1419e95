"""Pack integer codes into little-endian bit rows: the twin of quantwm.core.quant.pack_bits_ref.

Element i of a row lives in bits [i*b, (i+1)*b) of the row's byte stream (b in {2, 4, 8}, so a code never
straddles a byte). One program packs a (BLOCK_R rows x BLOCK_B bytes) tile; codes past the row's end
count as 0, as in the reference's padding.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _pack_bits_kernel(codes_ptr, out_ptr, R, n, n_bytes,
                      BITS: tl.constexpr, PER: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    byte = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    j = tl.arange(0, PER)
    col = byte[None, :, None] * PER + j[None, None, :]  # (1, BB, PER) element index
    mask = (rows[:, None, None] < R) & (col < n)
    c = tl.load(codes_ptr + rows[:, None, None].to(tl.int64) * n + col, mask=mask, other=0).to(tl.int32)
    packed = tl.sum(c << (j[None, None, :] * BITS), axis=2)  # (BR, BB)
    omask = (rows[:, None] < R) & (byte[None, :] < n_bytes)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * n_bytes + byte[None, :], packed.to(tl.uint8), mask=omask)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes (..., n) integers in [0, 2^bits) -> uint8 (..., ceil(n * bits / 8)); bits in {2, 4, 8}."""
    if bits not in (2, 4, 8):
        raise ValueError(f"pack_bits supports bits 2, 4 and 8, got {bits}")
    *lead, n = codes.shape
    c = codes.reshape(-1, n).contiguous()
    R, n_bytes = c.shape[0], (n * bits + 7) // 8
    out = torch.empty(R, n_bytes, dtype=torch.uint8, device=codes.device)
    if R and n_bytes:
        BLOCK_R, BLOCK_B = 16, min(64, triton.next_power_of_2(n_bytes))
        grid = (triton.cdiv(R, BLOCK_R), triton.cdiv(n_bytes, BLOCK_B))
        _pack_bits_kernel[grid](c, out, R, n, n_bytes, BITS=bits, PER=8 // bits, BLOCK_R=BLOCK_R, BLOCK_B=BLOCK_B)
    return out.reshape(*lead, n_bytes)
