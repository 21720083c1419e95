"""Nearest centroid under Euclidean distance: the twin of quantwm.core.kmeans.kmeans_assign_ref (QVG's
"semantic-aware smoothing" step, and QuantWM's Values).

Per stream, a tile of BLOCK_N tokens is streamed against tiles of BLOCK_K centroids; the distance
|x|² - 2 x·c + |c|² (clamped at 0, as the reference) comes from one tl.dot per tile in IEEE fp32, and a
running (min, argmin) keeps the first centroid on ties, as torch.argmin does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kmeans_assign_kernel(x_ptr, c_ptr, out_ptr, N, K, D,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    s = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    x = tl.load(x_ptr + (s * N + n[:, None]).to(tl.int64) * D + d[None, :],
                mask=(n[:, None] < N) & (d[None, :] < D), other=0.0).to(tl.float32)
    xx = tl.sum(x * x, axis=1)
    best = tl.full((BLOCK_N,), float("inf"), tl.float32)
    best_id = tl.zeros((BLOCK_N,), tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        c = tl.load(c_ptr + (s * K + k[:, None]).to(tl.int64) * D + d[None, :],
                    mask=(k[:, None] < K) & (d[None, :] < D), other=0.0).to(tl.float32)
        cc = tl.sum(c * c, axis=1)
        dist = xx[:, None] - 2.0 * tl.dot(x, tl.trans(c), input_precision="ieee") + cc[None, :]
        dist = tl.where(k[None, :] < K, tl.maximum(dist, 0.0), float("inf"))
        tile_min = tl.min(dist, axis=1)
        tile_id = tl.argmin(dist, axis=1, tie_break_left=True) + k0
        better = tile_min < best
        best_id = tl.where(better, tile_id, best_id)
        best = tl.where(better, tile_min, best)
    tl.store(out_ptr + s * N + n, best_id.to(tl.int64), mask=n < N)


def kmeans_assign(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """x (S, N, D), centroids c (S, K, D) -> ids (S, N) int64."""
    if x.dim() != 3 or c.dim() != 3 or x.shape[0] != c.shape[0] or x.shape[2] != c.shape[2]:
        raise ValueError(f"expected x (S, N, D) and c (S, K, D), got {tuple(x.shape)} and {tuple(c.shape)}")
    S, N, D = x.shape
    K = c.shape[1]
    if K == 0:
        raise ValueError("no centroids to assign to")
    out = torch.empty(S, N, dtype=torch.int64, device=x.device)
    if S and N:
        BLOCK_N, BLOCK_K = 32, 16
        grid = (S, triton.cdiv(N, BLOCK_N))
        _kmeans_assign_kernel[grid](x.contiguous(), c.contiguous(), out, N, K, D, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                                    BLOCK_D=max(16, triton.next_power_of_2(D)))
    return out
