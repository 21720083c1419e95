"""QuantWM: QSAC-clustered, PSAC-compensated 2-bit Keys; QVG-style Values (docs/method.md §2).

Keys: k-means whose assignment cost is QSAC's logit-aware J (quantwm.core.qsac), residual quantized in
per-token groups, then PSAC stores the residual error's coordinates along the top-R eigen-directions of
the history-Query second moment (quantwm.core.psac). Values: plain k-means smoothing and a 2-bit residual.
Ablations: quantwm-qsac (QSAC only), quantwm-psac (Euclidean k-means + PSAC).

`quantwm` (this project's tuned method) is `qvg-budget`'s storage plus QSAC and PSAC: fewer centroids than
QVG (one per 64 tokens, at most 64) stored in fp8-e4m3 (the residual is taken against the stored centroids,
so their rounding only widens the residual a little), fp8-e4m3 scales and zeros on the asymmetric grid,
4-bit PSAC coefficients with one scale per direction and span. `python -m quantwm memory` prints where the
bits go. λ = 16 and 8 pruning candidates were chosen on synthetic trace seed 1 (docs/results.md: the λ ablation);
reports use other seeds.

With a budget (`CacheConfig(budget=B)`, `--set budget=B`) QuantWM runs its allocator instead, for Keys and Values:
the `quantwm-alloc` method (quantwm/core/methods/allocator.py), which the family names as its `at_budget`.

`quantwm-paper` is the method as the QuantWM paper describes it (docs/method.md §2.5): QVG's storage (`qvg`:
256 BF16 centroids per span, fp8 scales, groups of 64, the symmetric grid); S updated strictly causally (a
chunk's queries enter S only once that chunk is quantized; `causal_stats`); QSAC with diag(S) channel
weights, a shortlist of 4 centroids by weighted distance, then the one minimising Σ_g W_g range_g² (no λ,
no distance term); PSAC with the top 8 eigenvectors stored BF16 and INT8 coefficients with a per-token
scale (symmetric, the scale in fp8-e4m3: the source leaves both open, chosen as QVG stores its scales);
spans quantized before any history (the first one) use uniform weights and no PSAC.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layouts import Codebook, Compensated, Grouped, Layout, RankCompensated
from ..psac import psac_basis, psac_encode, psac_encode_ranked, spectrum_ranks
from ..qsac import channel_sensitivity, qsac_assign
from ..quant import SCALE_DTYPES, check_bits, dequantize_groups
from .base import BUDGETS, SpanContext, register
from .qvg import QVGBudget

PSAC_STEPS = ((16, 8), (16, 4), (8, 8), (8, 4), (4, 8), (4, 4), (2, 4))  # (rank, coefficient bits), richest first


def fixed_candidates(head_dim: int, kind: str, psac: bool, off: list[dict]) -> list[dict]:
    """QuantWM's fixed configurations, richest first: residual bits 4, 3, 2; within each, groups of 64 then 128
    channels where the head allows; within each, PSAC rank 16, 8, 4, 2 with 8- then 4-bit coefficients (`psac`),
    then `off` (PSAC off: QSAC alone). Values have no PSAC: the residual's knobs only."""
    wide = [g for g in (64, 128) if head_dim % g == 0]
    if kind == "v":
        return [{"bits": b, "group_size": g} for b in (4, 3, 2) for g in wide]
    steps = [{"psac_rank": r, "psac_bits": pb} for r, pb in PSAC_STEPS if r <= head_dim] if psac else []
    return [{"bits": b, "group_size": g, **p} for b in (4, 3, 2) for g in wide for p in steps + off]


@register("quantwm")
@dataclass(frozen=True)
class QuantWM(QVGBudget):
    name = "quantwm"
    source = "this project (docs/method.md §2)"
    uses_queries = True
    at_budget = "quantwm-alloc"
    sweep = tuple({"budget": b} for b in BUDGETS)  # the allocator at each envelope budget, whatever --bits says
    quick_sweep = ({"budget": 2.5},)
    qsac: bool = True
    psac: bool = True
    lam: float = 16.0
    candidates: int | None = 8
    psac_rank: int = 8
    psac_bits: int = 4
    basis_reuse: float = 0.95
    qsac_distance: float = 1.0  # weight of J's weighted-distance term (0: the paper's range-only rule)
    psac_per_token: bool = False  # coefficient scales per token (paper) instead of per direction
    psac_basis_dtype: str = "fp16"
    psac_symmetric: bool = False
    psac_scale_dtype: str = "fp16"
    history_only: bool = False  # spans quantized before any history query: uniform weights, no PSAC (paper)
    causal_stats: bool = False  # a chunk's queries enter S only once that chunk is quantized (the cache does it)
    psac_energy: float | None = None  # adaptive rank: per stream the fewest directions holding this share of S

    def __post_init__(self):
        super().__post_init__()
        check_bits(self.psac_bits)
        if self.psac_basis_dtype not in ("fp16", "bf16"):
            raise ValueError(f"psac_basis_dtype must be 'fp16' or 'bf16', got {self.psac_basis_dtype!r}")
        if self.qsac_distance < 0:
            raise ValueError(f"qsac_distance must be >= 0, got {self.qsac_distance}")
        if self.psac_energy is not None and not (0 < self.psac_energy <= 1 and not self.psac_per_token):
            raise ValueError(f"psac_energy must lie in (0, 1] (with per-direction scales), got {self.psac_energy}")
        if self.psac_rank < 1 or self.lam < 0 or (self.candidates is not None and self.candidates < 1):
            raise ValueError("psac_rank must be >= 1, lam >= 0 and candidates >= 1 or None")

    @classmethod
    def budget_candidates(cls, head_dim: int, kind: str) -> list[dict]:
        """After its allocator at the budget itself (`at_budget`, which `configure` tries first: per channel 0-8
        bits by the predicted logit error), where its tables cannot fit (tiny spans at tiny budgets): its fixed
        configurations (`fixed_candidates`), PSAC then QSAC alone."""
        return fixed_candidates(head_dim, kind, psac=True, off=[{"psac": False}])

    def grid(self) -> str:
        parts = [super().grid()]
        if self.qsac:
            parts.append(f"QSAC lambda={self.lam}")
        if self.psac and self.psac_energy is not None:
            parts.append(f"PSAC adaptive rank (≤ {self.psac_rank}, {self.psac_energy:.0%} of each head's query energy), "
                         f"{self.psac_bits}-bit coefficients")
        elif self.psac:
            scales = "per-token" if self.psac_per_token else "per-direction"
            parts.append(f"PSAC R={self.psac_rank} ({self.psac_basis_dtype} basis), {self.psac_bits}-bit coefficients, "
                         f"{scales} scales")
        return "; ".join(parts)

    def encode(self, x: torch.Tensor, kind: str, ctx: SpanContext) -> Layout:
        if kind != "k":
            return super().encode(x, kind, ctx)
        S, N, D = x.shape
        stats = ctx.stats_or_identity(S, D, x.device)
        no_history = self.history_only and not ctx.history
        if self.qsac:
            w = torch.ones(S, D, device=x.device) if no_history else channel_sensitivity(stats)
            r, stages = self.smooth(x, kind, ctx, assign=lambda xs, c: qsac_assign(
                xs, c, w, self.group_size, self.bits, self.lam, self.candidates, self.qsac_distance))
        else:
            r, stages = self.smooth(x, kind, ctx)
        q = self.quantize_residual(r, kind)
        span = Codebook(stages, Grouped(q))
        if not self.psac or no_history:
            return span
        U = psac_basis(stats, self.psac_rank, ctx.state.get("k.basis"), self.basis_reuse,
                       SCALE_DTYPES[self.psac_basis_dtype])
        ctx.state["k.basis"] = U  # the next span reuses it while the query subspace holds
        err = r - dequantize_groups(q)
        if self.psac_energy is not None:
            ranks = spectrum_ranks(stats, self.psac_energy, U.shape[-1])
            return RankCompensated(span, U, ranks.to(torch.uint8), psac_encode_ranked(err, U, ranks, self.psac_bits))
        return Compensated(span, U, psac_encode(err, U, self.psac_bits, self.psac_per_token, self.psac_symmetric,
                                                self.psac_scale_dtype))


@register("quantwm-qsac")
@dataclass(frozen=True)
class QuantWMQSAC(QuantWM):
    name = "quantwm-qsac"
    source = "this project: an ablation of quantwm"
    at_budget = None
    psac: bool = False

    @classmethod
    def budget_candidates(cls, head_dim: int, kind: str) -> list[dict]:
        """QuantWM's fixed configurations without PSAC (`fixed_candidates`)."""
        return fixed_candidates(head_dim, kind, psac=False, off=[{}])


@register("quantwm-psac")
@dataclass(frozen=True)
class QuantWMPSAC(QuantWM):
    name = "quantwm-psac"
    source = "this project: an ablation of quantwm"
    at_budget = None
    qsac: bool = False

    @classmethod
    def budget_candidates(cls, head_dim: int, kind: str) -> list[dict]:
        """QuantWM's fixed configurations, PSAC always on (`fixed_candidates`)."""
        return fixed_candidates(head_dim, kind, psac=True, off=[])


@register("quantwm-paper")
@dataclass(frozen=True)
class QuantWMPaper(QuantWM):
    """QuantWM as its paper describes it (module docstring; docs/method.md §2.5)."""

    name = "quantwm-paper"
    source = "arXiv 2609.26425, read through third-party notes (docs/method.md §2.5)"
    at_budget = None
    # QVG's storage (the `qvg` preset)
    n_centroids: int = 256
    min_tokens_per_centroid: int = 1
    iters: int = 2
    tol: float = 1e-4
    warm_start: bool = False
    symmetric: bool = True
    scale_rounding: str = "nearest"
    codebook_dtype: str = "bf16"
    # QSAC: diag(S) weights, 4 candidates by weighted distance, then the range term alone
    candidates: int | None = 4
    qsac_distance: float = 0.0
    lam: float = 1.0
    # PSAC: top 8 eigenvectors in BF16, INT8 coefficients with a per-token scale. Left open by the source and
    # chosen as QVG stores its scales: symmetric INT8 (no zero) with an fp8-e4m3 scale.
    psac_rank: int = 8
    psac_bits: int = 8
    psac_per_token: bool = True
    psac_symmetric: bool = True
    psac_scale_dtype: str = "fp8"
    psac_basis_dtype: str = "bf16"
    basis_reuse: float = 1.0 + 1e-6  # a basis per span: the paper shares none
    history_only: bool = True
    causal_stats: bool = True
    sweep = tuple({"n_centroids": k} for k in (4, 16, 256))

    @classmethod
    def budget_candidates(cls, head_dim: int, kind: str) -> list[dict]:
        """Bits 4, 3, 2, each with 256, 16, 4 centroids."""
        return [{"bits": b, "n_centroids": k} for b in (4, 3, 2) for k in (256, 16, 4)]
