"""Nearest centroid under QSAC's cost (docs/method.md §2.1): the twin of quantwm.core.qsac.qsac_assign_ref with
candidates=None (the exact objective for every centroid; the reference's candidate pruning is a CPU
economy the GPU does not need).

    J(k, c) = Σ_i w_i (k_i - c_i)² + λ Σ_g W_g range_g(k - c)² / (12 (2^b - 1)²),   W_g = Σ_{i∈g} w_i

The range term needs the residual per (token, centroid), so J is not a matmul: a tile of BLOCK_N tokens
streams over the centroids one at a time, builds r = x - c in registers, reduces it per group of G channels
(G a power of two) and keeps a running (min, argmin), the first centroid winning ties.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _qsac_assign_kernel(x_ptr, c_ptr, w_ptr, out_ptr, N, K, D, lam, denom,
                        G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    s = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    x = tl.load(x_ptr + (s * N + n[:, None]).to(tl.int64) * D + d[None, :],
                mask=(n[:, None] < N) & dmask[None, :], other=0.0).to(tl.float32)
    w = tl.load(w_ptr + s * D + d, mask=dmask, other=0.0).to(tl.float32)
    W = tl.sum(tl.reshape(w, (BLOCK_D // G, G)), axis=1)  # (NG,) padded groups weigh 0
    best = tl.full((BLOCK_N,), float("inf"), tl.float32)
    best_id = tl.zeros((BLOCK_N,), tl.int32)
    for k in range(0, K):
        c = tl.load(c_ptr + (s * K + k).to(tl.int64) * D + d, mask=dmask, other=0.0).to(tl.float32)
        r = x - c[None, :]  # (BN, BD)
        dist = tl.sum(w[None, :] * r * r, axis=1)
        rg = tl.reshape(r, (BLOCK_N, BLOCK_D // G, G))
        rng = tl.max(rg, axis=2) - tl.min(rg, axis=2)  # (BN, NG)
        cost = dist + lam * tl.math.div_rn(tl.sum(W[None, :] * rng * rng, axis=1), denom)
        better = cost < best
        best_id = tl.where(better, k, best_id)
        best = tl.where(better, cost, best)
    tl.store(out_ptr + s * N + n, best_id.to(tl.int64), mask=n < N)


def qsac_assign(x: torch.Tensor, c: torch.Tensor, w: torch.Tensor, group_size: int, bits: int,
                lam: float) -> torch.Tensor:
    """argmin_c J(k, c): x (S, N, D), c (S, K, D), channel sensitivity w (S, D) -> ids (S, N) int64."""
    if x.dim() != 3 or c.dim() != 3 or x.shape[0] != c.shape[0] or x.shape[2] != c.shape[2]:
        raise ValueError(f"expected x (S, N, D) and c (S, K, D), got {tuple(x.shape)} and {tuple(c.shape)}")
    S, N, D = x.shape
    if tuple(w.shape) != (S, D):
        raise ValueError(f"channel sensitivity must be (S, D) = {(S, D)}, got {tuple(w.shape)}")
    if D % group_size or group_size & (group_size - 1):
        raise ValueError(f"group_size must be a power of two dividing the head dim {D}, got {group_size}")
    if c.shape[1] == 0:
        raise ValueError("no centroids to assign to")
    out = torch.empty(S, N, dtype=torch.int64, device=x.device)
    if S and N:
        BLOCK_N = 32
        grid = (S, triton.cdiv(N, BLOCK_N))
        _qsac_assign_kernel[grid](x.contiguous(), c.contiguous(), w.contiguous().float(), out, N, c.shape[1], D,
                                  float(lam), float(12 * (2 ** bits - 1) ** 2), G=group_size, BLOCK_N=BLOCK_N,
                                  BLOCK_D=max(16, triton.next_power_of_2(D), group_size))
    return out
