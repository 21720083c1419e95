"""PSAC: Principal Subspace Attention Compensation for Keys (docs/method.md §2.2).

History-Query energy sits in a few directions of S = E[q qᵀ]; only key error along them moves logits
much (E[(q·e)^2] = eᵀ S e). PSAC stores, per stream, the top-R eigenvectors U of S (fp16) and
for every token the coefficients a = Uᵀ e of the residual error e = k - k̂, quantized; the read is
k̂ + U â. In a fused kernel the correction is (Uᵀ q)·â: R extra MACs per key.

A basis is computed when a span is committed and shared with later spans for as long as it captures at least
`reuse` of the energy of their S's top R directions (`holds`): with a settled S one stored basis serves many
spans, which is what lets bases amortise over short spans. The cache counts each shared basis once.

With `share` (adaptive rank, beyond the paper), each stream keeps only as many directions as hold that
share of its S's energy (at most the basis' rank): a head whose queries are concentrated stores a few
coefficients a token, a diffuse one more (`spectrum_ranks`, `psac_encode_ranked`). The basis is stored at the
maximum rank and shared as above; the per-stream coefficients are stored at their own rank.

Coefficients are quantized per (stream, direction) over the span (one scale and zero per direction,
`bits` levels) by default: per-token scales (`per_token=True`, the QuantWM paper's INT8 coefficients)
cost 32 bits a token more, which a 2-bit budget barely carries (docs/results.md, "Where the bits go").
"""
from __future__ import annotations

import numpy as np
import torch

from .quant import GroupQuant, dequantize_groups, quantize_groups

SUBSPACE_ITERS = 4  # subspace iterations that check whether a stored basis still spans S's top directions


def principal_basis(stats: torch.Tensor, rank: int) -> torch.Tensor:
    """Top-`rank` eigenvectors of S: (S, D, D) -> (S, D, R), columns by decreasing eigenvalue."""
    evals, evecs = torch.linalg.eigh(stats.double())
    return evecs[..., -rank:].flip(-1).float()


def subspace_overlap(U: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """||Uᵀ V||_F² / R per stream: 1 when two orthonormal (S, D, R) bases span the same subspace."""
    return torch.bmm(U.float().transpose(1, 2), V.float()).square().sum((1, 2)) / U.shape[-1]


def psac_basis(stats: torch.Tensor, rank: int, prev: torch.Tensor | None = None, reuse: float = 0.95,
               dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """The span's basis (S, D, R) in `dtype`: `prev` itself when it still captures at least `reuse` of the energy of
    every stream's top R directions (`holds`; so a stored basis serves many spans), else the new top-R
    eigenvectors of S."""
    R = min(rank, stats.shape[-1])
    if prev is not None and prev.shape[-1] == R and holds(stats, prev, reuse):
        return prev  # the same tensor: shared by the spans, stored once
    return principal_basis(stats, R).to(dtype)  # a new basis: the exact top-R eigenvectors (one eigh)


def holds(stats: torch.Tensor, prev: torch.Tensor, reuse: float) -> bool:
    """Whether every stream's stored basis prev (S, D, R) still captures at least `reuse` of the energy S's top R
    directions hold (S (S, D, D)), without an eigendecomposition of S (on a GPU eigh waits on the host for its error
    check and takes milliseconds): that energy is the sum of the top R Ritz values of SUBSPACE_ITERS subspace
    iterations on a block of 2R directions (the stored basis and the R columns of S of most energy, where the
    energy may have moved), from the block's small (2R x 2R) projection, read with the captured energy in one host
    read a span and eigendecomposed on the host. Directions of equal energy are interchangeable: a basis among
    them holds."""
    S, D, R = prev.shape
    A = stats.double()
    extra = min(R, D - R)
    cols = A.norm(dim=-2).topk(extra, dim=-1).indices  # (S, extra): the columns of S of most energy
    block = torch.cat([prev.double(), A.gather(2, cols[:, None, :].expand(S, D, extra))], -1)
    for _ in range(SUBSPACE_ITERS):
        block = torch.linalg.qr(A @ block).Q  # (S, D, R + extra), orthonormal
    P = prev.double()
    held = (P * (A @ P)).sum((1, 2))  # (S,) tr(prevᵀ S prev): the energy the stored basis captures
    small = np.array(torch.cat([(block.transpose(1, 2) @ A @ block).flatten(1), held[:, None]], 1).tolist())
    T = small[:, :-1].reshape(S, R + extra, R + extra)  # (the host read) S projected on the block
    top = np.linalg.eigvalsh(T)[:, -R:].sum(-1)  # the top R Ritz values: S's top-R energy, from below
    return bool((small[:, -1] >= reuse * top).all())


def psac_encode(err: torch.Tensor, U: torch.Tensor, bits: int, per_token: bool = False, symmetric: bool = False,
                scale_dtype: str = "fp16") -> GroupQuant:
    """Residual key error err (S, N, D), basis U (S, D, R) -> the coefficients a = Uᵀ e quantized, (S, N, R): one
    scale (and zero) per direction over the span, or per token with `per_token`."""
    a = torch.bmm(err.float(), U.float())  # (S, N, D) @ (S, D, R) -> (S, N, R)
    if per_token:
        return quantize_groups(a, bits, a.shape[2], "channel", symmetric, scale_dtype)
    return quantize_groups(a, bits, a.shape[1], "token", symmetric, scale_dtype)


def psac_correction(coeffs: GroupQuant, U: torch.Tensor) -> torch.Tensor:
    """U â for every token: the stored coefficients (S, N, R) and basis (S, D, R) -> (S, N, D)."""
    return torch.bmm(dequantize_groups(coeffs), U.float().transpose(1, 2))


def spectrum_ranks(stats: torch.Tensor, share: float, max_rank: int) -> torch.Tensor:
    """Per stream, the smallest rank whose top eigenvalues of S hold `share` of its trace: (S, D, D) -> (S,) long
    in [1, max_rank]."""
    if not 0 < share <= 1:
        raise ValueError(f"the energy share must lie in (0, 1], got {share}")
    ev = torch.linalg.eigvalsh(stats.double()).flip(-1).clamp_min(0)  # (S, D) descending
    cum = ev.cumsum(-1) / ev.sum(-1, keepdim=True).clamp_min(1e-300)
    return ((cum < share - 1e-12).sum(-1) + 1).clamp(1, max_rank)


def psac_encode_ranked(err: torch.Tensor, U: torch.Tensor, ranks: torch.Tensor, bits: int) -> tuple[GroupQuant, ...]:
    """Like `psac_encode` (per-direction scales), stream s keeping its first ranks[s] directions: one
    (1, N, r_s) GroupQuant per stream."""
    a = torch.bmm(err.float(), U.float())  # (S, N, D) @ (S, D, R) -> (S, N, R)
    return tuple(quantize_groups(a[s:s + 1, :, :r], bits, a.shape[1], "token") for s, r in enumerate(ranks.tolist()))
