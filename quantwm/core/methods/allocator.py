"""QuantWM's allocator as a method: `quantwm-alloc`, what `quantwm` runs at a budget (docs/method.md §2.6).

`budget.configure` (and `CacheConfig(method="quantwm", budget=B)`, or `--set budget=B`) choose it: QuantWM's
family declares it as its `at_budget` method. Per span: centroids, then each channel of the residual on its own
grid with 0-8 bits chosen to minimise the predicted logit (Keys: weights S_ii, when `qsac` and a history exists)
or output (Values) error within `budget` bits per element (quantwm.core.allocate). Two smoothings are priced,
k-means centroids and one mean row per span (a grouped RTN in effect), and the one with the lower predicted error
is kept. No PSAC: the allocator spends those bits on the channels the queries read.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..allocate import allocate, encode_channels, error_tables
from ..kmeans import weighted_sqdist
from ..layouts import Codebook, Layout
from ..layouts.channels import channel_bytes, table_bytes
from ..qsac import channel_sensitivity
from ..quant import SCALE_DTYPES, BudgetError, check_budget, to_storage
from .base import Method, SpanContext, register
from .qvg import QVGBudget


@register("quantwm-alloc")
@dataclass(frozen=True)
class QuantWMAlloc(QVGBudget):
    name = "quantwm-alloc"
    uses_queries = True
    takes_bits = False  # the budget sets every channel's width
    at_budget = "quantwm-alloc"
    budget: float = 2.5
    qsac: bool = True  # False: every channel weighted alike (the ablation)

    def __post_init__(self):
        super().__post_init__()
        check_budget(self.budget)

    def grid(self) -> str:
        return (f"allocator at {self.budget:g} bits per element: 0-8 bits per channel by the predicted "
                f"{'logit' if self.qsac else 'Euclidean'} error, k-means (≤ {self.n_centroids} {self.codebook_dtype} "
                f"centroids, one per {self.min_tokens_per_centroid} tokens) or one mean per span")

    def weights(self, x: torch.Tensor, kind: str, ctx: SpanContext) -> torch.Tensor:
        """λ_i per (stream, channel): S_ii (normalised) for Keys with a history, else 1."""
        S, _, D = x.shape
        if kind == "k" and self.qsac and ctx.history:
            return channel_sensitivity(ctx.stats_or_identity(S, D, x.device))
        return torch.ones(S, D, device=x.device)

    def smoothings(self, x: torch.Tensor, kind: str, ctx: SpanContext, w: torch.Tensor):
        """Yield (residual, stages) for k-means centroids and for one mean row per span."""
        smoother = self if x.shape[-1] % self.group_size == 0 else replace(self, group_size=x.shape[-1])
        for K in dict.fromkeys((self.n_clusters(x.shape[1]), 1)):
            if K > 1:
                yield smoother.smooth(x, kind, ctx, assign=lambda xs, c: weighted_sqdist(xs, c, w).argmin(-1))
            else:
                row = to_storage(x.float().mean(1, keepdim=True), SCALE_DTYPES[self.codebook_dtype])
                yield x.float() - row.float(), ((row, None),)

    def encode(self, x: torch.Tensor, kind: str, ctx: SpanContext) -> Layout:
        Method.validate(self, x, kind)  # any head dim: the allocator's grids are per channel, not groups of them
        S, N, D = x.shape
        w = self.weights(x, kind, ctx)
        cost = torch.tensor([8.0 * channel_bytes(N, b) for b in range(9)])
        best = None
        for r, stages in self.smoothings(x, kind, ctx, w):
            fixed = sum(t.numel() * t.element_size() for stage in stages for t in stage if t is not None)
            available = torch.full((S,), self.budget * N * D - 8 * (fixed + table_bytes(S, D)) / S)
            if bool((available < 0).any()):
                continue
            E, alpha = error_tables(r)
            weighted = w.cpu()[:, :, None] * E
            levels = allocate(weighted, cost, available)
            predicted = float(torch.gather(weighted, 2, levels[..., None]).sum())
            if best is None or predicted < best[0]:
                best = (predicted, r, stages, levels, torch.gather(alpha, 2, levels[..., None])[..., 0])
        if best is None:
            raise BudgetError(f"quantwm cannot fit {self.budget:g} bits per element on spans of {N} tokens at head "
                              f"dim {D}: its centroids and per-channel tables alone take more")
        _, r, stages, levels, alpha = best
        return Codebook(stages, encode_channels(r, levels, alpha))
