"""QuantWM's allocator as a method: `quantwm-alloc`, what `quantwm` runs at a budget (docs/method.md §2.6).

`budget.configure` (and `CacheConfig(method="quantwm", budget=B)`, or `--set budget=B`) choose it: QuantWM's
family declares it as its `at_budget` method. Per span: centroids, then each channel of the residual on its own
grid with 0-8 bits chosen to minimise the predicted logit (Keys: weights S_ii, when `qsac` and a history exists)
or output (Values) error within `budget` bits per element (quantwm.core.allocate). Two smoothings are priced,
k-means centroids and one mean row per span (a grouped RTN in effect), and the one with the lower predicted error
is kept. No PSAC: the allocator spends those bits on the channels the queries read.

Keys in the Queries' basis (`query_basis`, on by default; quantwm/core/query_basis.py): with a history, each
stream's keys are rotated into the eigenbasis of W = S^½ C S^½ (the keys' covariance C in the Queries' metric S;
top `basis_rank` directions exact, an orthonormal complement for the rest) and the same allocation runs on the
coordinates with λ_i = u_iᵀ S u_i. The basis is shared with later
spans while its top directions still capture `basis_reuse` of S's top energy. The span that stores a new basis
pays its bytes in full, out of its own budget (so every span, and the cache, stays within B), and spends at most
`basis_share` of its bits on it: a 128-token span at head dim 64 affords fewer directions than a long one. A new
basis is kept only where its predicted error, its bytes paid, beats the stale basis (free) or, before any, the
model's own channels.

Loud tokens (`loud`, docs/method.md §2.8): a span's few tokens whose keys are `loud` times louder than the median
are kept in BF16 (a `TokenSplit`; the cache splits the Values alike), paid out of the span's budget. S re-aimed
(`aim_chunks`, §2.9): where the cache knows the model's 3-D RoPE, the Keys read S moved to the frames of the next
chunks (`SpanContext.aim`) instead of the history's frames. Codes (`codes`, §2.10): each coded channel on its
uniform grid ("grids"), or in a bitshift trellis code ("trellis", `quantwm-trellis`) in the same bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..allocate import allocate, encode_channels, error_tables, level_costs
from ..kmeans import weighted_sqdist
from ..layouts import Codebook, InBasis, Layout, TokenSplit, split_tokens
from ..layouts.channels import table_bytes
from ..layouts.trellis import TrellisChannels
from ..psac import principal_basis
from ..qsac import channel_sensitivity
from ..quant import SCALE_DTYPES, BudgetError, check_budget, to_storage
from ..query_basis import (
    basis_bytes,
    basis_matrix,
    captured,
    coordinate_weights,
    gaussian_price,
    key_covariance,
    make_reflectors,
    rotated,
    weighted_source,
)
from ..tables import on_device
from ..trellis import ERROR_RATIO, UNIT_MSE
from .base import BUDGETS, Method, SpanContext, register
from .qvg import QVGBudget

_TRELLIS_RATIO = torch.tensor(ERROR_RATIO, device="cpu").clamp(max=1.0)  # per width 0-8 (quantwm/core/trellis.py)
_TRELLIS_UNIT = torch.tensor((float("inf"),) + UNIT_MSE[1:], device="cpu")  # per unit variance, widths 0-8 (0: none)
REUSE_RANK = 16  # a stored basis holds while its first (at most) 16 columns capture S's top-16 energy


def trellis_errors(E: torch.Tensor, r: torch.Tensor, price: str) -> torch.Tensor:
    """The allocator's predicted error (S, D, widths 0-8) of each channel of r (S, N, D) coded by the trellis or
    its grid, whichever is better (the commit keeps that one), from E, its grids' measured errors: "ratio", E times
    the trellis's error ratio to the grid on Gaussian samples (at most 1); "variance", the lesser of E and the
    trellis's error on a Gaussian of the channel's variance over the span (N var UNIT_MSE[b]; 0 bits: E)."""
    if price == "ratio":
        return E * on_device(_TRELLIS_RATIO, E.device)
    spread = r.float().var(1, correction=0)[..., None] * r.shape[1] * on_device(_TRELLIS_UNIT, E.device)
    return torch.minimum(E, spread)


@register("quantwm-alloc")
@dataclass(frozen=True)
class QuantWMAlloc(QVGBudget):
    name = "quantwm-alloc"
    source = "this project (docs/method.md §2.6, §2.7)"
    uses_queries = True
    takes_bits = False  # the budget sets every channel's width
    at_budget = "quantwm-alloc"
    budget: float = 2.5
    qsac: bool = True  # False: every channel weighted alike (the ablation)
    query_basis: bool = True  # Keys in the history Queries' basis (False: the model's channels, the ablation)
    basis_rank: int = 64  # at most this many eigen-directions in a stored basis (16 is priced too)
    basis_reuse: float = 0.95  # a stored basis serves while it captures this share of S's top-rank energy
    basis_share: float = 0.25  # a span storing a new basis spends at most this share of its bits on it
    basis_source: str = "weighted"  # the basis: eigenvectors of S^½ C S^½ ("weighted") or of S alone ("queries")
    aim_chunks: int = 4  # Keys: S re-aimed at the frames of the next this many chunks, where the cache can (0: off)
    loud: float = 3.0  # Keys: tokens whose key norm exceeds this many times the span's median go to BF16 (0: never)
    loud_share: float = 0.02  # at most this share of a span's tokens, the loudest
    codes: str = "grids"  # each channel on a uniform grid ("grids") or a bitshift trellis ("trellis", §2.10)
    unbias: bool = True  # Values: each coded channel's grid stretched to a slope of 1 (Channels.code, §2.6 step 5),
    # from sums the packing kernel gathers: one launch more a commit (False: the grids as the clip set them)
    trellis_kinds: str = "kv"  # codes="trellis": the halves it codes ("k", "v" or "kv"; the other keeps its grids)
    trellis_price: str = "ratio"  # codes="trellis": a channel priced at its grid's error times the Gaussian ratio
    # ("ratio"), or at the lesser of its grid's error and a Gaussian of its variance's trellis error ("variance")
    key_extra_bits: float = 0.0  # a cache budget B for Keys and Values: the Keys configured at B + this, the Values
    # at B − this (quantwm.core.budget.kind_budgets; 0: both at B)

    def __post_init__(self):
        super().__post_init__()
        check_budget(self.budget)
        if self.codes not in ("grids", "trellis"):
            raise ValueError(f"codes must be 'grids' or 'trellis', got {self.codes!r}")
        if self.trellis_kinds not in ("k", "v", "kv"):
            raise ValueError(f"trellis_kinds must be 'k', 'v' or 'kv', got {self.trellis_kinds!r}")
        if self.trellis_price not in ("ratio", "variance"):
            raise ValueError(f"trellis_price must be 'ratio' or 'variance', got {self.trellis_price!r}")
        if isinstance(self.key_extra_bits, bool) or not (isinstance(self.key_extra_bits, int | float)
                                                          and 0 <= self.key_extra_bits < 8):
            raise ValueError(f"key_extra_bits must be a number of bits in [0, 8), got {self.key_extra_bits!r}")
        if not isinstance(self.unbias, bool):
            raise ValueError(f"unbias must be true or false, got {self.unbias!r}")
        if self.basis_source not in ("weighted", "queries"):
            raise ValueError(f"basis_source must be 'weighted' or 'queries', got {self.basis_source!r}")
        if self.aim_chunks < 0:
            raise ValueError(f"aim_chunks must be >= 0 (0: S as observed), got {self.aim_chunks}")
        if self.loud < 0 or (0 < self.loud <= 1) or not 0 <= self.loud_share < 1:
            raise ValueError(f"need loud = 0 (off) or > 1 and loud_share in [0, 1), got {self.loud}, {self.loud_share}")
        if self.basis_rank < 1 or not 0 < self.basis_reuse <= 1 or not 0 <= self.basis_share < 1:
            raise ValueError(f"need basis_rank >= 1, basis_reuse in (0, 1] and basis_share in [0, 1), got "
                             f"{self.basis_rank}, {self.basis_reuse}, {self.basis_share}")

    @classmethod
    def budget_candidates(cls, head_dim: int, kind: str) -> list[dict]:
        """None: the budget itself is its one configuration (`at_budget`, which `configure` tries first)."""
        return []

    def grid(self) -> str:
        basis = (f", Keys in the history Queries' basis (top {self.basis_rank} directions, shared while it captures "
                 f"{self.basis_reuse:.0%})" if self.query_basis and self.qsac else "")
        halves = {"k": " on the Keys, the Values on grids", "v": " on the Values, the Keys on grids", "kv": ""}[
            self.trellis_kinds]
        codes = f" (bitshift trellis codes{halves})" if self.codes == "trellis" else ""
        return (f"allocator at {self.budget:g} bits per element: 0-8 bits per channel{codes} by the predicted "
                f"{'logit' if self.qsac else 'Euclidean'} error, k-means (≤ {self.n_centroids} {self.codebook_dtype} "
                f"centroids, one per {self.min_tokens_per_centroid} tokens) or one mean per span{basis}")

    def trellis_codes(self, kind: str) -> bool:
        """Whether the `kind` ("k" or "v") half is coded by the trellis (else on its grids)."""
        return self.codes == "trellis" and kind in self.trellis_kinds

    def weights(self, x: torch.Tensor, kind: str, ctx: SpanContext) -> torch.Tensor:
        """λ_i per (stream, channel): S_ii (normalised) for Keys with a history, else 1."""
        S, _, D = x.shape
        if kind == "k" and self.qsac and ctx.history:
            return channel_sensitivity(self.query_metric(x, ctx))
        return torch.ones(S, D, device=x.device)

    def query_metric(self, x: torch.Tensor, ctx: SpanContext) -> torch.Tensor:
        """The S the Keys' error is weighed by: the history Queries' S re-aimed at the frames of the next
        `aim_chunks` chunks where the cache can (`SpanContext.aim`), else S as observed."""
        S, _, D = x.shape
        if self.aim_chunks and ctx.aim is not None and ctx.history:
            aimed = ctx.aim(self.aim_chunks)
            if aimed is not None:
                return aimed.float()
        return ctx.stats_or_identity(S, D, x.device)

    def smoothings(self, x: torch.Tensor, kind: str, ctx: SpanContext, w: torch.Tensor):
        """Yield (residual, stages) for k-means centroids and for one mean row per span: both on the first span
        of `kind`, then only the one that won there (kept in ctx.state: the choice is made once, not read back on
        every span)."""
        smoother = self if x.shape[-1] % self.group_size == 0 else replace(self, group_size=x.shape[-1])
        kept = ctx.state.get(f"{kind}.smoothing")
        for K in dict.fromkeys((self.n_clusters(x.shape[1]), 1)):
            if kept is not None and (K > 1) != bool(kept):
                continue
            if K > 1:
                yield smoother.smooth(x, kind, ctx, assign=lambda xs, c: weighted_sqdist(xs, c, w).argmin(-1))
            else:  # no fp32 copy of the span: the mean accumulates in fp32, the difference promotes
                row = to_storage(x.mean(1, keepdim=True, dtype=torch.float32), SCALE_DTYPES[self.codebook_dtype])
                diff = torch.sub(x, row.float())
                yield diff if diff.dtype == torch.float32 else diff.float(), ((row, None),)  # fp64 spans: fp32 too

    def allocated(self, x: torch.Tensor, kind: str, ctx: SpanContext, w: torch.Tensor, charge: float = 0.0):
        """(predicted error (a 0-dim tensor), build) of the best smoothing of x (S, N, D) with weights w within the
        budget less `charge` bits per stream, `build()` coding the span (only the chosen candidate is coded); None
        when nothing fits. Every step runs on x's device; the one host read is the first span's choice between
        the two smoothings (`smoothings`)."""
        S, N, D = x.shape
        cost = on_device(level_costs(N), x.device)
        candidates = []
        for r, stages in self.smoothings(x, kind, ctx, w):
            fixed = sum(t.numel() * t.element_size() for stage in stages for t in stage if t is not None)
            available = self.budget * N * D - 8 * (fixed + table_bytes(S, D)) / S - charge  # bits per stream
            if available < 0:
                continue
            E, alpha = error_tables(r)
            if self.trellis_codes(kind):
                E = trellis_errors(E, r, self.trellis_price)
            weighted = w.float()[:, :, None] * E
            levels = allocate(weighted, cost, torch.full((S,), available, device=x.device))
            predicted = torch.gather(weighted, 2, levels[..., None]).sum()
            capacity = S * int(available // 8)  # the allocation keeps each stream's codes within its bits
            candidates.append((predicted, r, stages, levels, torch.gather(alpha, 2, levels[..., None])[..., 0], capacity))
        if not candidates:
            return None
        if len(candidates) > 1:  # the first span of this kind: the smoothing with the lower predicted error, kept
            at = int(torch.stack([c[0] for c in candidates]).argmin())  # host read: once per cache and kind
            k_means = candidates[at][2][0][1] is not None  # the k-means stage stores ids; the mean row does not
            ctx.state[f"{kind}.smoothing"] = k_means  # a host-side flag (not a tensor: no bytes on the device)
            candidates = [candidates[at]]
        predicted, r, stages, levels, alpha, capacity = candidates[0]

        def build():
            unbias = self.unbias and kind == "v"
            if self.trellis_codes(kind):  # it unbiases from the decodes its grid-or-trellis choice made
                return Codebook(stages, TrellisChannels.code(r, levels, alpha, capacity, unbias=unbias))
            return Codebook(stages, encode_channels(r, levels, alpha, capacity, unbias))
        return predicted, build

    def in_query_basis(self, x: torch.Tensor, ctx: SpanContext, plain, plan: tuple):
        """(predicted error, build) of the Keys in the Queries' basis (the eigenvectors of `basis_source_of`). A
        stored basis that still holds is used as it is. Otherwise new ones of 16 and of `basis_rank` directions
        (as many as `basis_share` of the span's bits buy), each paid in full by this span, are priced against the
        stale basis or, with none, the model's channels (`plain()`) by the Gaussian model of their error, from the
        span's covariance (`gaussian_price`), and the winner is coded. Keeps the basis in use in ctx.state; where the channels won,
        the basis they beat, so that while it holds later spans skip the pricing. `plan`: what `basis_plan` computed
        before the span's one host read (S, the span's covariance, the source, the stored basis and whether it, or
        with none stored the basis the channels beat, still holds)."""
        S, N, D = x.shape
        stats, cov, source, stored, holds = plan
        if stored is None and holds:
            return plain()  # the channels beat a basis of this S before
        # a reused basis is paid for; under a rolling window its payer may be evicted, so each user pays 1/window
        share = 0.0 if stored is None or ctx.window is None else 8.0 * basis_bytes(stored[0].shape[1], D) / ctx.window
        if stored is not None and holds:
            got = self.coded_in(stored, ctx, *self.coordinates(x, stats, stored), share)  # shared, already paid for
            if got is not None:
                return got
        rank = min(self.basis_rank, D, int(self.basis_share * self.budget * N * D // (8 * basis_bytes(1, D))))
        # (basis, its coordinates, the bits it costs this span) of each candidate basis: new ones, then the stale one
        ranks = sorted({min(REUSE_RANK, rank), rank} - {0})
        top = principal_basis(source, ranks[-1]) if ranks else None  # one eigendecomposition for every rank
        candidates = [(b, 8.0 * basis_bytes(b[0].shape[1], D)) for b in (make_reflectors(source, r, top) for r in ranks)]
        if stored is not None:
            candidates.append((stored, share))
        # price each by the Gaussian model from the span's covariance (no projection, no allocation), code the winner
        total, unbiased = self.budget * N * D, N / max(N - 1, 1)

        def price(U: torch.Tensor, charge: float) -> torch.Tensor:
            lam = coordinate_weights(U, stats)
            variances = torch.einsum("sdi,sde,sei->si", U.double(), cov, U.double()) * unbiased
            return gaussian_price(lam, variances, N, total - charge)

        prices = [price(basis_matrix(*b), charge) for b, charge in candidates]
        if stored is None:  # the model's channels compete too, and win ties
            prices.insert(0, gaussian_price(torch.diagonal(stats, dim1=-2, dim2=-1),
                                            torch.diagonal(cov, dim1=-2, dim2=-1) * unbiased, N, total))
        best = int(torch.stack(prices).argmin())  # host read: only on a span that prices a new basis
        if stored is None and best == 0:
            if candidates:
                declined = candidates[0][0]  # its matrix kept beside it: checked on every later span
                ctx.state.update({"k.declined_reflectors": declined[0], "k.declined_scales": declined[1],
                                  "k.declined_matrix": basis_matrix(*declined)})
            return plain()
        best -= stored is None
        basis, charge = candidates[best]
        got = self.coded_in(basis, ctx, *self.coordinates(x, stats, basis), charge)
        if got is None:
            return plain()
        ctx.state.update({"k.basis_reflectors": basis[0], "k.basis_scales": basis[1]})
        return got

    def basis_source_of(self, ctx: SpanContext, stats: torch.Tensor, cov: torch.Tensor, n: torch.Tensor | int) -> torch.Tensor:
        """The matrix whose top eigenvectors a new basis takes: S, or W = S^½ C S^½ with C the keys' covariance
        over every span coded so far, this one's (`cov`, of `n` tokens) included (a running mean kept in ctx.state,
        so that a stored basis keeps holding while the keys' statistics do)."""
        if self.basis_source == "queries":
            return stats
        total, count = ctx.state.get("k.cov_sum"), ctx.state.get("k.cov_count")  # tensors: counted as method state
        n = torch.full((), float(n), dtype=cov.dtype, device=cov.device) if isinstance(n, int) else n.to(cov)
        total = cov * n + (0 if total is None else total)
        count = n + (0 if count is None else count)
        ctx.state.update({"k.cov_sum": total, "k.cov_count": count})
        return weighted_source(stats, total / count)

    def basis_plan(self, x: torch.Tensor, ctx: SpanContext, keep: torch.Tensor | None) -> tuple[tuple, list[torch.Tensor]]:
        """What the Keys in the Queries' basis need of span x (S, N, D), over the tokens `keep` (N,) bool (None:
        all): (S, the span's covariance, the source W (the running covariance updated), the stored basis), and the
        0-dim flags to read: whether the stored basis, or with none the basis the channels beat, still holds."""
        stats = self.query_metric(x, ctx)
        cov = key_covariance(x, keep)  # the span's: prices every candidate basis, and feeds W
        source = self.basis_source_of(ctx, stats, cov, x.shape[1] if keep is None else keep.sum())

        def kept(key: str) -> tuple | None:
            return (ctx.state[f"{key}_reflectors"], ctx.state[f"{key}_scales"]) if f"{key}_scales" in ctx.state else None

        def holds(basis: tuple) -> torch.Tensor:  # read on its first (at most) REUSE_RANK columns
            rank = min(REUSE_RANK, basis[0].shape[1])
            return (captured(basis_matrix(*basis), source, rank) >= self.basis_reuse).all()  # U held by a span or state

        stored, declined = kept("k.basis"), kept("k.declined")
        flags = [holds(stored)] if stored is not None else [holds(declined)] if declined is not None else []
        return (stats, cov, source, stored), flags

    @staticmethod
    def coordinates(x: torch.Tensor, stats: torch.Tensor, basis: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """(λ_i = u_iᵀ S u_i (S, D), the coordinates y = x U (S, N, D)) of x in the stored `basis` (reflectors,
        scales)."""
        U = basis_matrix(*basis)
        return coordinate_weights(U, stats), rotated(x, U)

    def coded_in(self, basis: tuple, ctx: SpanContext, lam: torch.Tensor, y: torch.Tensor, charge: float = 0.0):
        """(predicted error, build) of the coordinates y in `basis` with weights λ (normalised to mean 1) within the
        budget less `charge` bits per stream, `build()` giving the InBasis layout; None when it does not fit."""
        mean = lam.mean(-1, keepdim=True)
        w = torch.where(mean > 0, lam / mean, 1.0)  # (a zero mean's quotient is never taken)
        got = self.allocated(y, "k", ctx, w, charge)

        def build() -> InBasis:
            out = InBasis(got[1](), *basis)
            out.__dict__["basis"] = basis_matrix(*basis)  # the U the span was coded with: kept with it
            return out
        return None if got is None else (got[0], build)

    def loud_candidates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the `loud_share` · N loudest tokens (cap,), by their key norm over the stream's median in any stream,
        loudest first; whether each is loud: over `loud` times) on x's device, or None where none can be. The
        loud ones lead the candidates: the span's loud tokens are the first n, n read on the host."""
        cap = int(self.loud_share * x.shape[1])
        if not self.loud or not cap:
            return None
        norms = torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32)  # (S, N), no fp32 copy of the span
        ratio = (norms / norms.median(-1, keepdim=True).values.clamp_min(1e-30)).amax(0)  # (N,)
        top, order = ratio.topk(cap)
        return order, top > self.loud

    def key_plan(self, x: torch.Tensor, ctx: SpanContext) -> tuple[torch.Tensor | None, tuple | None]:
        """The Keys' decisions on span x (S, N, D), with one host read for all of them: the loud tokens held in
        BF16 ((n,) int16 ascending, or None) and, where Keys go to the Queries' basis, `basis_plan` over the other
        tokens with its flag read (None where the Keys stay in the channels)."""
        N = x.shape[1]
        loud = self.loud_candidates(x)
        keep = None
        if loud is not None:  # (N,) False at the loud tokens
            keep = torch.ones(N, dtype=torch.bool, device=x.device).scatter(0, loud[0], ~loud[1])
        rotate = self.qsac and self.query_basis and ctx.history
        saved = {k: ctx.state[k] for k in ("k.cov_sum", "k.cov_count") if k in ctx.state}
        plan, flags = self.basis_plan(x, ctx, keep) if rotate else (None, [])
        counts = [loud[1].sum()] if loud is not None else []
        read = torch.stack([t.double() for t in counts + flags]).tolist() if counts or flags else []  # the one read
        n = int(read[0]) if counts else 0
        if n and 16 * n > 0.5 * self.budget * N:
            n = 0  # a tight budget codes them with the rest: their BF16 would take half the span's bits
            if rotate:  # the plan over every token (a second read, only on this rare path)
                ctx.state.update(saved)
                plan, flags = self.basis_plan(x, ctx, None)
                read = [0.0] + (torch.stack([t.double() for t in flags]).tolist() if flags else [])
        held = loud[0][:n].sort().values.to(torch.int16) if n else None
        if plan is not None:
            plan = (*plan, bool(read[len(counts)]) if flags else False)
        return held, plan

    def encode(self, x: torch.Tensor, kind: str, ctx: SpanContext) -> Layout:
        Method.validate(self, x, kind)  # any head dim: the allocator's grids are per channel, not groups of them
        if kind == "k":  # the loud keys in BF16; the cache splits the span's Values at the same tokens ("held")
            held, plan = self.key_plan(x, ctx)
            ctx.span["held"] = held
            if held is not None:
                rest, kept = split_tokens(x, held)
                return TokenSplit(self.holding(len(held), rest.shape)._encode(rest, kind, ctx, plan), held, kept)
            return self._encode(x, kind, ctx, plan)
        if ctx.span.get("held") is not None:  # Values the cache split where the Keys did: pay for the held ones
            return self.holding(len(ctx.span["held"]), x.shape)._encode(x, kind, ctx)
        return self._encode(x, kind, ctx)

    def holding(self, n: int, shape: tuple[int, int, int]) -> QuantWMAlloc:
        """This allocator for the other tokens (S, M, D) of a span whose `n` tokens are held apart in BF16 with
        their int16 positions: the span's B · (M + n) · D bits less theirs, spread over the M tokens."""
        S, M, D = shape
        return replace(self, budget=(self.budget * (M + n) * D - 16.0 * n * D - 16.0 * n / S) / (M * D))

    def _encode(self, x: torch.Tensor, kind: str, ctx: SpanContext, plan: tuple | None = None) -> Layout:
        S, N, D = x.shape

        def plain():
            return self.allocated(x, kind, ctx, self.weights(x, kind, ctx))

        best = self.in_query_basis(x, ctx, plain, plan) if kind == "k" and plan is not None else plain()
        if best is None:
            raise BudgetError(f"quantwm cannot fit {self.budget:g} bits per element on spans of {N} tokens at head "
                              f"dim {D}: its centroids and per-channel tables alone take more")
        return best[1]()


@register("quantwm-channels")
@dataclass(frozen=True)
class QuantWMChannels(QuantWMAlloc):
    """The allocator with Keys in the model's own channels (no Queries' basis): the transform's ablation."""

    name = "quantwm-channels"
    source = "this project: an ablation of quantwm-alloc"
    at_budget = "quantwm-channels"
    sweep = tuple({"budget": b} for b in BUDGETS)  # the allocator without the Queries' basis (ablation)
    query_basis: bool = False
