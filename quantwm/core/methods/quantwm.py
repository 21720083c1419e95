"""QuantWM: QSAC-clustered, PSAC-compensated 2-bit Keys; QVG-style Values (SPEC.md §2).

Keys: k-means whose assignment cost is QSAC's logit-aware J (quantwm.core.qsac), residual quantized in
per-token groups, then PSAC stores the residual error's coordinates along the top-R eigen-directions of
the history-Query second moment (quantwm.core.psac). Values: plain k-means smoothing and a 2-bit residual.
Ablations: quantwm-qsac (QSAC only), quantwm-psac (Euclidean k-means + PSAC).

Defaults are sized for the bit budget (SPEC.md §4 counts every stored byte): fewer centroids than QVG
(one per 64 tokens, at most 64) stored in fp8-e4m3 (the residual is taken against the stored
centroids, so their rounding only widens the residual a little), fp8-e4m3 scales and zeros, 4-bit PSAC coefficients with one scale per
direction and span. `python -m quantwm memory` prints where the bits go. λ = 16 and 8 pruning
candidates were chosen on synthetic trace seed 1 (README: the λ ablation); reports use other seeds.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..psac import psac_basis, psac_correction, psac_encode
from ..qsac import channel_sensitivity, qsac_assign
from ..quant import check_bits, dequantize_groups
from .base import Encoded, SpanContext, register
from .qvg import QVG


@register("quantwm")
@dataclass(frozen=True)
class QuantWM(QVG):
    name = "quantwm"
    n_centroids: int = 64
    min_tokens_per_centroid: int = 64
    scale_dtype: str = "fp8"
    codebook_dtype: str = "fp8"
    qsac: bool = True
    psac: bool = True
    lam: float = 16.0
    candidates: int | None = 8
    psac_rank: int = 8
    psac_bits: int = 4
    basis_reuse: float = 0.95

    def __post_init__(self):
        super().__post_init__()
        check_bits(self.psac_bits)
        if self.psac_rank < 1 or self.lam < 0 or (self.candidates is not None and self.candidates < 1):
            raise ValueError("psac_rank must be >= 1, lam >= 0 and candidates >= 1 or None")

    def grid(self) -> str:
        parts = [super().grid()]
        if self.qsac:
            parts.append(f"QSAC lambda={self.lam}")
        if self.psac:
            parts.append(f"PSAC R={self.psac_rank} at {self.psac_bits} bits")
        return "; ".join(parts)

    def encode(self, x: torch.Tensor, kind: str, ctx: SpanContext) -> Encoded:
        if kind != "k":
            return super().encode(x, kind, ctx)
        S, N, D = x.shape
        stats = ctx.stats_or_identity(S, D, x.device)
        if self.qsac:
            w = channel_sensitivity(stats)
            r, stored = self.smooth(x, kind, ctx, assign=lambda xs, c: qsac_assign(
                xs, c, w, self.group_size, self.bits, self.lam, self.candidates))
        else:
            r, stored = self.smooth(x, kind, ctx)
        q = self.quantize_residual(r, kind)
        stored.update(q.tensors())
        shared = {}
        if self.psac:
            U = psac_basis(stats, self.psac_rank, ctx.state.get("k.psac_basis"), self.basis_reuse)
            ctx.state["k.psac_basis"] = shared["psac_basis"] = U
            stored.update(psac_encode(r - dequantize_groups(q), U, self.psac_bits))
        return Encoded(stored, tuple(x.shape), {"axis": q.axis}, shared)

    def decode(self, enc: Encoded) -> torch.Tensor:
        x = super().decode(enc)
        if "psac_basis" in enc.shared:
            x = x + psac_correction(enc.tensors, enc.shared["psac_basis"], enc.shape[1], self.psac_bits)
        return x


@register("quantwm-qsac")
@dataclass(frozen=True)
class QuantWMQSAC(QuantWM):
    name = "quantwm-qsac"
    psac: bool = False


@register("quantwm-psac")
@dataclass(frozen=True)
class QuantWMPSAC(QuantWM):
    name = "quantwm-psac"
    qsac: bool = False
