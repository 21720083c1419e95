"""A span's keys in the Queries' basis, y = x U, on tensor cores at FP32's accuracy: the twin of
quantwm.core.query_basis.key_rotate_ref (torch.bmm(x.float(), U)), for the allocator's Keys (docs/method.md §2.7).

x (S, N, D) is BF16, as a model's keys are, so every product of x with a BF16 number is exact in FP32. U (S, D, D)
FP32 is split into three BF16 parts, U = U1 + U2 + U3 to 24 bits (each the rounding of what the others leave), and
y = x U1 + x U2 + x U3: three BF16 dots accumulated in FP32, where one FP32 product ran on the FP32 units at a
fifteenth of the tensor cores' rate. The result equals the FP32 product to its rounding (the terms are summed in
another order). One program per (stream, BLOCK_N tokens, BLOCK_J output columns), reading those columns of U (D at
most 128). Under TRITON_INTERPRET=1 the interpreter's BF16 dot is unusable (kernels/span_attention.py `_dot_f32`):
there the parts are widened and multiplied in IEEE FP32 (span_tiles `_dot`), the same sum of the same products.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .span_tiles import _dot

BLOCK_N, BLOCK_J = 64, 64  # tokens a program, and the output columns (of U's) it writes


@triton.jit
def _split(u):
    """(u1, u2, u3) BF16 with u1 + u2 + u3 = u to 24 bits: each part the rounding of what the earlier ones leave."""
    u1 = u.to(tl.bfloat16)
    r = u - u1.to(tl.float32)
    u2 = r.to(tl.bfloat16)
    return u1, u2, (r - u2.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _key_rotate_kernel(x_ptr, u_ptr, y_ptr, N, D, INTERP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_J: tl.constexpr):
    s = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    j = tl.program_id(2) * BLOCK_J + tl.arange(0, BLOCK_J)  # the output columns this program writes
    rmask, dmask, jmask = rows < N, d < D, j < D
    x = tl.load(x_ptr + (s * N + rows[:, None]).to(tl.int64) * D + d[None, :], mask=rmask[:, None] & dmask[None, :],
                other=0.0)
    u = tl.load(u_ptr + (s * D + d[:, None]).to(tl.int64) * D + j[None, :], mask=dmask[:, None] & jmask[None, :],
                other=0.0)
    u1, u2, u3 = _split(u)
    y = _dot(x, u1, tl.bfloat16, INTERP) + _dot(x, u2, tl.bfloat16, INTERP) + _dot(x, u3, tl.bfloat16, INTERP)
    tl.store(y_ptr + (s * N + rows[:, None]).to(tl.int64) * D + j[None, :], y, mask=rmask[:, None] & jmask[None, :])


def key_rotate(x: torch.Tensor, U: torch.Tensor) -> torch.Tensor:
    """x (S, N, D) bfloat16, U (S, D, D) float32 (D at most 128) -> y = x U (S, N, D) float32."""
    S, N, D = x.shape
    if x.dtype != torch.bfloat16 or U.dtype != torch.float32 or tuple(U.shape) != (S, D, D) or D > 128:
        raise ValueError(f"key_rotate takes x (S, N, D) bfloat16 and U (S, D, D) float32 with D <= 128, got "
                         f"{x.dtype} {tuple(x.shape)} and {U.dtype} {tuple(U.shape)}")
    if U.device != x.device:
        raise ValueError(f"key_rotate's basis must be on the keys' device {x.device}, got {U.device}")
    y = torch.empty(S, N, D, dtype=torch.float32, device=x.device)
    if S and N and D:
        block_d = max(16, triton.next_power_of_2(D))
        block_j = min(BLOCK_J, block_d)
        _key_rotate_kernel[(S, triton.cdiv(N, BLOCK_N), triton.cdiv(D, block_j))](
            x.contiguous(), U.contiguous(), y, N, D, INTERP=os.environ.get("TRITON_INTERPRET") == "1", BLOCK_N=BLOCK_N,
            BLOCK_D=block_d, BLOCK_J=block_j, num_warps=8)
    return y
