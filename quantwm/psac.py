"""PSAC: Principal Subspace Attention Compensation for Keys (SPEC.md §2.2).

History-Query energy sits in a few directions of S = E[q qᵀ]; only key error along them moves logits
much (E[(q·e)^2] = eᵀ S e). PSAC stores, per span and stream, the top-R eigenvectors U of S (fp16) and
for every token the coefficients a = Uᵀ e of the residual error e = k - k̂, quantized; the read is
k̂ + U â. In a fused kernel the correction is (Uᵀ q)·â: R extra MACs per key.

Coefficients are quantized per (stream, direction) over the span (one scale and zero per direction,
`bits` levels), not per token: per-token scales would cost 16 bits a token, more than the budget of a
2-bit cache allows (see README, "Where the bits go").
"""
from __future__ import annotations

import torch

from .quant import GroupQuant, dequantize_groups, quantize_groups


def principal_basis(stats: torch.Tensor, rank: int) -> torch.Tensor:
    """Top-`rank` eigenvectors of S: (S, D, D) -> (S, D, R), columns by decreasing eigenvalue."""
    evals, evecs = torch.linalg.eigh(stats.double())
    return evecs[..., -rank:].flip(-1).float()


def psac_encode(err: torch.Tensor, stats: torch.Tensor, rank: int, bits: int) -> dict[str, torch.Tensor]:
    """Residual key error err (S, N, D) -> stored tensors {psac_basis, psac_codes, psac_scales, psac_zeros}."""
    U = principal_basis(stats, min(rank, err.shape[-1])).to(torch.float16)
    a = torch.bmm(err.float(), U.float())  # (S, N, D) @ (S, D, R) -> (S, N, R)
    q = quantize_groups(a, bits, group_size=a.shape[1], axis="token")
    return {"psac_basis": U, "psac_codes": q.codes, "psac_scales": q.scale, "psac_zeros": q.zero}


def psac_correction(t: dict[str, torch.Tensor], n_tokens: int, bits: int) -> torch.Tensor:
    """U â for every token: the stored PSAC tensors -> (S, N, D)."""
    U = t["psac_basis"].float()
    R = U.shape[-1]
    q = GroupQuant(t["psac_codes"], t["psac_scales"], t["psac_zeros"], (U.shape[0], n_tokens, R), bits,
                   n_tokens, "token", False)
    return torch.bmm(dequantize_groups(q), U.transpose(1, 2))
