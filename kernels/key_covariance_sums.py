"""The sums of a span's key covariance on tensor cores at FP32's accuracy: the twin of
quantwm.core.query_basis.key_covariance_sums_ref, from which quantwm.core.query_basis.key_covariance forms the
covariance the allocator prices a basis with and the Queries' basis check reads (docs/method.md §2.7).

x (S, N, D) BF16 keys, keep (N,) bool or None. Each key is shifted by the stream's first, y_t = x_t − x_0 (exact in
FP32: both are BF16), and zeroed where not kept; then Σ_t y_t y_tᵀ and Σ_t y_t. y is split into three BF16 parts,
y = y1 + y2 + y3 to 24 bits, so y yᵀ = Σ_ij y_i y_jᵀ with every product exact in FP32; the six terms down to y1 y3ᵀ
are kept (the others are below 2^−24 of it) as BF16 dots accumulated in FP32, where one FP32 product ran on the FP32
units at a fifteenth of the tensor cores' rate. A program sums one stretch of one stream's tokens into a (D, D)
partial and a (D,) one (grid: streams × stretches, enough programs for the GPU), returned as they are; the caller
adds the stretches up and forms C = Σ y yᵀ / n − ȳ ȳᵀ (PyTorch ops, counted as such). The sums equal the twin's to
FP32 rounding (another order). Under TRITON_INTERPRET=1 the parts are multiplied in IEEE FP32 (span_tiles `_dot`; the
interpreter's BF16 dot is unusable: kernels/span_attention.py `_dot_f32`).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .key_rotate import _split
from .span_tiles import _dot

BLOCK_T = 32  # tokens a step
PROGRAMS = 264  # programs a launch aims at (two per SM of an H100 / H200), in stretches of at least 256 tokens


@triton.jit
def _key_covariance_kernel(x_ptr, keep_ptr, part_ptr, sum_ptr, N, D, span, P, KEEP: tl.constexpr,
                           INTERP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    s = tl.program_id(0)
    p = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    base = s.to(tl.int64) * N * D
    x0 = tl.load(x_ptr + base + d, mask=dmask, other=0.0).to(tl.float32)
    acc = tl.zeros((BLOCK_D, BLOCK_D), tl.float32)
    total = tl.zeros((BLOCK_D,), tl.float32)
    end = tl.minimum(N, (p + 1) * span)
    for t0 in range(p * span, end, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        live = t < end
        if KEEP:
            live &= tl.load(keep_ptr + t, mask=live, other=0) != 0
        m = live[:, None] & dmask[None, :]
        y = tl.where(m, tl.load(x_ptr + base + t[:, None].to(tl.int64) * D + d[None, :], mask=m, other=0.0)
                     .to(tl.float32) - x0[None, :], 0.0)
        total += tl.sum(y, axis=0)
        y1, y2, y3 = _split(y)
        t1, t2 = tl.trans(y1), tl.trans(y2)
        acc += (_dot(t1, y1, tl.bfloat16, INTERP) + _dot(t1, y2, tl.bfloat16, INTERP) + _dot(t2, y1, tl.bfloat16, INTERP)
                + _dot(t2, y2, tl.bfloat16, INTERP) + _dot(t1, y3, tl.bfloat16, INTERP)
                + _dot(tl.trans(y3), y1, tl.bfloat16, INTERP))
    at = (s * P + p).to(tl.int64)
    tl.store(part_ptr + at * D * D + d[:, None] * D + d[None, :], acc, mask=dmask[:, None] & dmask[None, :])
    tl.store(sum_ptr + at * D + d, total, mask=dmask)


def key_covariance_sums(x: torch.Tensor, keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (S, N, D) bfloat16 (D at most 128), keep (N,) bool or None -> (Σ y yᵀ (S, P, D, D), Σ y (S, P, D)) float32
    over P stretches of the tokens, y_t = x_t − x_0 where kept, else 0 (the module)."""
    S, N, D = x.shape
    if x.dtype != torch.bfloat16 or D > 128 or N == 0:
        raise ValueError(f"key_covariance_sums takes keys (S, N, D) bfloat16 with D <= 128 and N > 0, got {x.dtype} "
                         f"{tuple(x.shape)}")
    if keep is not None and (tuple(keep.shape) != (N,) or keep.device != x.device):
        raise ValueError(f"the kept tokens must be ({N},) on the keys' device {x.device}, got "
                         f"{tuple(keep.shape)} on {keep.device}")
    P = max(1, min(triton.cdiv(N, 256), triton.cdiv(PROGRAMS, S)))
    span = triton.cdiv(triton.cdiv(N, P), BLOCK_T) * BLOCK_T
    P = triton.cdiv(N, span)
    part = torch.empty(S, P, D, D, dtype=torch.float32, device=x.device)
    sums = torch.empty(S, P, D, dtype=torch.float32, device=x.device)
    _key_covariance_kernel[(S, P)](x.contiguous(), x if keep is None else keep.contiguous(), part, sums, N, D, span, P,
                                   KEEP=keep is not None, INTERP=os.environ.get("TRITON_INTERPRET") == "1",
                                   BLOCK_T=BLOCK_T, BLOCK_D=max(16, triton.next_power_of_2(D)), num_warps=8)
    return part, sums
