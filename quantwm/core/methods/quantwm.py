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

With `budget=B` (bits per element; `CacheConfig(budget=B)` sets it) QuantWM runs its allocator instead, for Keys
and Values: centroids, then each residual channel on its own grid with 0-8 bits chosen to minimise the predicted
logit (Keys, weights S_ii) or output (Values) error within B (quantwm.core.allocate, docs/method.md §2.6).

`quantwm-paper` is the method as the QuantWM paper describes it (docs/method.md §2.5): QVG's storage (`qvg`:
256 BF16 centroids per span, fp8 scales, groups of 64, the symmetric grid); S updated strictly causally (a
chunk's queries enter S only once that chunk is quantized; `causal_stats`); QSAC with diag(S) channel
weights, a shortlist of 4 centroids by weighted distance, then the one minimising Σ_g W_g range_g² (no λ,
no distance term); PSAC with the top 8 eigenvectors stored BF16 and INT8 coefficients with a per-token
scale (symmetric, the scale in fp8-e4m3: the source leaves both open, chosen as QVG stores its scales);
spans quantized before any history (the first one) use uniform weights and no PSAC.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..allocate import allocate, channel_bytes, decode_channels, encode_channels, error_tables, fused_side, side_bytes
from ..kmeans import weighted_sqdist
from ..psac import psac_basis, psac_correction, psac_correction_ranked, psac_encode, psac_encode_ranked, spectrum_ranks
from ..qsac import channel_sensitivity, qsac_assign
from ..quant import SCALE_DTYPES, BudgetError, check_bits, check_budget, dequantize_groups, to_storage
from .base import Encoded, Method, SpanContext, register
from .qvg import QVGBudget, gather_rows


@register("quantwm")
@dataclass(frozen=True)
class QuantWM(QVGBudget):
    name = "quantwm"
    uses_queries = True
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
    budget: float | None = None  # bits per element: the allocator codes the residual (core/allocate.py)

    def __post_init__(self):
        super().__post_init__()
        if self.budget is not None:
            check_budget(self.budget)
        check_bits(self.psac_bits)
        if self.psac_basis_dtype not in ("fp16", "bf16"):
            raise ValueError(f"psac_basis_dtype must be 'fp16' or 'bf16', got {self.psac_basis_dtype!r}")
        if self.qsac_distance < 0:
            raise ValueError(f"qsac_distance must be >= 0, got {self.qsac_distance}")
        if self.psac_energy is not None and not (0 < self.psac_energy <= 1 and not self.psac_per_token):
            raise ValueError(f"psac_energy must lie in (0, 1] (with per-direction scales), got {self.psac_energy}")
        if self.psac_rank < 1 or self.lam < 0 or (self.candidates is not None and self.candidates < 1):
            raise ValueError("psac_rank must be >= 1, lam >= 0 and candidates >= 1 or None")

    def grid(self) -> str:
        if self.budget is not None:
            return (f"allocator at {self.budget:g} bits per element: 0-8 bits per channel by the predicted "
                    f"{'logit' if self.qsac else 'Euclidean'} error, k-means (≤ {self.n_centroids} {self.codebook_dtype} "
                    f"centroids, one per {self.min_tokens_per_centroid} tokens) or one mean per span")
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

    def encode(self, x: torch.Tensor, kind: str, ctx: SpanContext) -> Encoded:
        if self.budget is not None:
            return self.encode_budget(x, kind, ctx)
        if kind != "k":
            return super().encode(x, kind, ctx)
        S, N, D = x.shape
        stats = ctx.stats_or_identity(S, D, x.device)
        no_history = self.history_only and not ctx.history
        if self.qsac:
            w = torch.ones(S, D, device=x.device) if no_history else channel_sensitivity(stats)
            r, stored = self.smooth(x, kind, ctx, assign=lambda xs, c: qsac_assign(
                xs, c, w, self.group_size, self.bits, self.lam, self.candidates, self.qsac_distance))
        else:
            r, stored = self.smooth(x, kind, ctx)
        q = self.quantize_residual(r, kind)
        stored.update(q.tensors())
        shared = {}
        if self.psac and not no_history:
            U = psac_basis(stats, self.psac_rank, ctx.state.get("k.psac_basis"), self.basis_reuse,
                           SCALE_DTYPES[self.psac_basis_dtype])
            ctx.state["k.psac_basis"] = shared["psac_basis"] = U
            err = r - dequantize_groups(q)
            if self.psac_energy is not None:
                ranks = spectrum_ranks(stats, self.psac_energy, U.shape[-1])
                stored.update(psac_encode_ranked(err, U, ranks, self.psac_bits))
            else:
                stored.update(psac_encode(err, U, self.psac_bits, self.psac_per_token, self.psac_symmetric,
                                          self.psac_scale_dtype))
        return Encoded(stored, tuple(x.shape), {"axis": q.axis}, shared)

    def encode_budget(self, x: torch.Tensor, kind: str, ctx: SpanContext) -> Encoded:
        """The allocator's span (core/allocate.py): centroids, then each channel of the residual on its own grid
        with the bits that minimise the predicted error within `budget` bits per element. Two smoothings are
        priced, k-means centroids and one mean per span (a grouped RTN in effect), and the one with the lower
        predicted error is kept."""
        Method.validate(self, x, kind)  # any head dim: the allocator's grids are per channel, not groups of them
        S, N, D = x.shape
        if kind == "k" and self.qsac and ctx.history:
            w = channel_sensitivity(ctx.stats_or_identity(S, D, x.device))  # λ_i = S_ii (normalised)
        else:
            w = torch.ones(S, D, device=x.device)
        cost = torch.tensor([8.0 * channel_bytes(N, b) for b in range(9)])
        smoother = self if D % self.group_size == 0 else replace(self, group_size=D)  # its groups go unused here
        best = None
        for K in dict.fromkeys((self.n_clusters(N), 1)):
            if K > 1:
                r, stored = smoother.smooth(x, kind, ctx, assign=lambda xs, c: weighted_sqdist(xs, c, w).argmin(-1))
            else:
                stored = {"codebook0": to_storage(x.float().mean(1, keepdim=True), SCALE_DTYPES[self.codebook_dtype])}
                r = x.float() - stored["codebook0"].float()
            fixed = sum(t.numel() * t.element_size() for t in stored.values()) + side_bytes(S, D)
            available = torch.full((S,), self.budget * N * D - 8 * fixed / S)
            if bool((available < 0).any()):
                continue
            E, alpha = error_tables(r)
            weighted = w.cpu()[:, :, None] * E
            levels = allocate(weighted, cost, available)
            predicted = float(torch.gather(weighted, 2, levels[..., None]).sum())
            if best is None or predicted < best[0]:
                best = (predicted, r, stored, levels, torch.gather(alpha, 2, levels[..., None])[..., 0])
        if best is None:
            raise BudgetError(f"quantwm cannot fit {self.budget:g} bits per element on spans of {N} tokens at head "
                             f"dim {D}: its centroids and per-channel tables alone take more")
        _, r, stored, levels, alpha = best
        stored.update(encode_channels(r, levels, alpha))
        return Encoded(stored, tuple(x.shape), {"axis": "allocated"})

    def fused_format(self, enc: Encoded, head_dim: int) -> dict | None:
        """QVG's side; Key spans with PSAC add "psac": q -> (Uᵀq) scaled per direction, the zero term, codes.
        Per-token coefficient scales (quantwm-paper) are not fused: the reference path reads them."""
        if "alloc_bits" in enc.tensors:  # the allocator's mixed-width channels (no PSAC)
            return fused_side(enc.tensors, enc.shape)
        side = super().fused_format(enc, head_dim)
        U = enc.shared.get("psac_basis")
        if side is None or U is None:
            return side
        if self.psac_per_token or self.psac_symmetric or self.psac_energy is not None:
            return None  # the kernel reads per-direction asymmetric coefficients of one rank for every stream
        t = enc.tensors
        scales, zeros = t["psac_scales"].float()[:, 0], t["psac_zeros"].float()[:, 0]  # (S, R): one per direction

        def psac(q: torch.Tensor) -> dict:
            pq = torch.bmm(q.float(), U.float())  # (S, Nq, D) @ (S, D, R) -> (S, Nq, R)
            return {"qs": pq * scales[:, None], "c0": (pq * zeros[:, None]).sum(-1), "codes": t["psac_codes"],
                    "bits": self.psac_bits}
        return {**side, "psac": psac}

    def step(self, enc: Encoded) -> torch.Tensor | None:
        """The allocator's spans: each coded channel's grid step for every token; 0-bit channels, which have no
        grid, count as exact (+jensen adds no bias for them)."""
        t = enc.tensors
        if "alloc_bits" not in t:
            return super().step(enc)
        step = torch.where(t["alloc_bits"] > 0, t["alloc_step"].float(), 0.0)
        return step[:, None, :].expand(enc.shape).contiguous()

    def decode(self, enc: Encoded) -> torch.Tensor:
        t = enc.tensors
        if "alloc_bits" in t:
            c = t["codebook0"].float()
            c = gather_rows(c, t["centroid_ids0"].long()) if "centroid_ids0" in t else c.expand(enc.shape)
            return decode_channels(t, enc.shape) + c
        x = super().decode(enc)
        if "psac_basis" in enc.shared and "psac_ranks" in enc.tensors:
            x = x + psac_correction_ranked(enc.tensors, enc.shared["psac_basis"], enc.shape[1], self.psac_bits)
        elif "psac_basis" in enc.shared:
            x = x + psac_correction(enc.tensors, enc.shared["psac_basis"], enc.shape[1], self.psac_bits,
                                    self.psac_per_token, self.psac_symmetric)
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


@register("quantwm-paper")
@dataclass(frozen=True)
class QuantWMPaper(QuantWM):
    """QuantWM as its paper describes it (module docstring; docs/method.md §2.5)."""

    name = "quantwm-paper"
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
