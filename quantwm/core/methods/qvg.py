"""QVG and QVG-Pro (Quant-VideoGen, arXiv 2602.02958): k-means smoothing, then residual quantization.

Per stream (one (batch, head) of one layer) and span: cluster the tokens with Euclidean k-means
("semantic-aware smoothing"), subtract each token's centroid, repeat for `stages` residual stages, and
quantize what is left in per-token groups. Stored: one codebook and one uint8/int16 id per token per
stage, plus the residual's codes and scales (and zeros on an asymmetric grid).

Presets, each with its source (docs/method.md §3; the released code read is svg-project/Quant-VideoGen at 0601468):

* `qvg`: as the paper and released code configure it: 256 centroids per (head, span) whatever the span's
  length (K = N when a span has fewer tokens), stored BF16; one stage; residual in groups of 64 channels on
  the released symmetric grid (absmax, q_max = 2^(b-1) - 1: ternary {-1, 0, +1} at 2 bits, no zero point)
  with fp8-e4m3 scales rounded to nearest; 2 Lloyd iterations (Self-Forcing's and HY-WorldPlay's setting;
  LingBot uses 4, LongCat 100), stopping early when at most 1e-4 of the ids change; no warm start (the
  released pipeline has none). One deviation, for reproducibility: the initial centroids are distinct
  tokens drawn with a seeded generator (the released code draws tokens with replacement, unseeded).
  Spans of several chunks (Self-Forcing: 8) are the cache's `span_chunks`.
* `qvg-asym`: the same with the asymmetric grid (min/max, 4 levels at 2 bits, fp8 zeros): the option the
  paper discusses beside the released grid.
* `qvg-pro`: QVG-Pro as the paper describes it: 4 residual k-means stages, groups of 16, otherwise `qvg`.
* `qvg-budget` (not a paper configuration): QVG's algorithm on QuantWM's storage budget (one centroid per
  64 tokens, at most 64, fp8 codebook, fp8 scales and zeros rounded up, asymmetric, warm start): the
  Euclidean k-means that QSAC is ablated against at an identical budget.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kmeans import AssignFn, kmeans, kmeans_assign
from ..layouts import Codebook, Grouped, Layout
from ..layouts.grouped import gather_rows
from ..quant import SCALE_DTYPES, to_storage
from .base import SpanContext, register
from .rtn import GroupMethod


@register("qvg")
@dataclass(frozen=True)
class QVG(GroupMethod):
    name = "qvg"
    source = "arXiv 2602.02958; code github.com/svg-project/Quant-VideoGen (read at 0601468)"
    sweep = tuple({"n_centroids": k} for k in (2, 6, 16, 64, 256))
    quick_sweep = ({"n_centroids": 6},)
    n_centroids: int = 256
    min_tokens_per_centroid: int = 1
    stages: int = 1
    iters: int = 2
    tol: float = 1e-4
    warm_start: bool = False
    symmetric: bool = True
    scale_dtype: str = "fp8"
    scale_rounding: str = "nearest"
    codebook_dtype: str = "bf16"

    def __post_init__(self):
        super().__post_init__()
        if self.n_centroids < 1 or self.min_tokens_per_centroid < 1 or self.stages < 1 or self.iters < 0:
            raise ValueError("n_centroids, min_tokens_per_centroid and stages must be >= 1, iters >= 0")
        if not 0 <= self.tol < 1:
            raise ValueError(f"tol must lie in [0, 1), got {self.tol}")
        if self.codebook_dtype not in SCALE_DTYPES:
            raise ValueError(f"codebook_dtype must be one of {', '.join(SCALE_DTYPES)}, got {self.codebook_dtype!r}")

    def grid(self) -> str:
        return (f"{super().grid()}; k-means {self.n_centroids} centroids x {self.stages} stage(s), "
                f"{self.codebook_dtype} codebook")

    def n_clusters(self, n_tokens: int) -> int:
        return max(1, min(self.n_centroids, n_tokens // self.min_tokens_per_centroid))

    def smooth(self, x: torch.Tensor, kind: str, ctx: SpanContext,
               assign: AssignFn = kmeans_assign) -> tuple[torch.Tensor, tuple]:
        """Subtract `stages` rounds of centroids: (S, N, D) -> residual (S, N, D) and the stages ((codebook
        (S, K, D), ids (S, N)), ...) as stored."""
        self.validate(x, kind)
        r = x.float()
        K = self.n_clusters(x.shape[1])
        stages = []
        for s in range(self.stages):
            key = f"{kind}.centroids{s}"
            init = ctx.state.get(key) if self.warm_start else None
            c, ids = kmeans(r, K, self.iters, seed=ctx.seed + s, init=init, assign=assign, tol=self.tol)
            if self.warm_start:
                ctx.state[key] = c
            codebook = to_storage(c, SCALE_DTYPES[self.codebook_dtype])  # widened if fp8 cannot hold it
            stages.append((codebook, ids.to(torch.uint8 if K <= 256 else torch.int16)))
            r = r - gather_rows(codebook.float(), ids)  # the residual is taken against the stored centroids
        return r, tuple(stages)

    def encode(self, x: torch.Tensor, kind: str, ctx: SpanContext) -> Layout:
        r, stages = self.smooth(x, kind, ctx)
        return Codebook(stages, Grouped(self.quantize_residual(r, kind)))

    @classmethod
    def budget_candidates(cls, head_dim: int, kind: str) -> list[dict]:
        """Residual bits 4, 3, 2 (the grid), each with 256, 64, 16, 6, 2 centroids per span."""
        return [{"bits": b, "n_centroids": k} for b in (4, 3, 2) for k in (256, 64, 16, 6, 2)]


@register("qvg-asym")
@dataclass(frozen=True)
class QVGAsym(QVG):
    name = "qvg-asym"
    source = "QVG (arXiv 2602.02958) on the asymmetric grid the paper discusses"
    sweep = QVG.sweep
    symmetric: bool = False


@register("qvg-pro")
@dataclass(frozen=True)
class QVGPro(QVG):
    name = "qvg-pro"
    source = "QVG-Pro as arXiv 2602.02958 describes it"
    stages: int = 4
    group_size: int = 16

    @classmethod
    def budget_candidates(cls, head_dim: int, kind: str) -> list[dict]:
        """Bits 4, 2, each with 256, 64, 16 centroids (4 stages, groups of 16, as QVG-Pro)."""
        return [{"bits": b, "n_centroids": k} for b in (4, 2) for k in (256, 64, 16)]


@register("qvg-budget")
@dataclass(frozen=True)
class QVGBudget(QVG):
    name = "qvg-budget"
    source = "this project: QVG's algorithm (arXiv 2602.02958) on QuantWM's storage"
    sweep = ({},)
    n_centroids: int = 64
    min_tokens_per_centroid: int = 64
    iters: int = 6
    tol: float = 0.0
    warm_start: bool = True
    symmetric: bool = False
    scale_rounding: str = "up"
    codebook_dtype: str = "fp8"

    @classmethod
    def budget_candidates(cls, head_dim: int, kind: str) -> list[dict]:
        """Bits 4, 3, 2."""
        return [{"bits": b} for b in (4, 3, 2)]
