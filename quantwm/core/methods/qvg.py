"""QVG and QVG-Pro (Quant-VideoGen, arXiv 2602.02958): k-means smoothing, then residual quantization.

Per stream (one (batch, head) of one layer) and span: cluster the tokens with Euclidean k-means
("semantic-aware smoothing"), subtract each token's centroid, repeat for `stages` residual stages, and
quantize what is left in per-token groups. Stored: one codebook and one uint8/int16 id per token per
stage, plus the residual's codes, scales and zeros. QVG: 256 centroids (fewer for small spans: at most
one per `min_tokens_per_centroid` tokens), 1 stage, groups of 64. QVG-Pro: 4 stages, groups of 16.
Centroids warm-start from the previous span's (per layer and Key/Value), as QVG does.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kmeans import AssignFn, kmeans, kmeans_assign
from ..quant import SCALE_DTYPES, to_storage
from .base import Encoded, SpanContext, register
from .rtn import GroupMethod


def gather_rows(c: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """c (S, K, D), ids (S, N) -> (S, N, D)."""
    return torch.gather(c, 1, ids[..., None].expand(*ids.shape, c.shape[-1]))


@register("qvg")
@dataclass(frozen=True)
class QVG(GroupMethod):
    name = "qvg"
    n_centroids: int = 256
    min_tokens_per_centroid: int = 16
    stages: int = 1
    iters: int = 6
    codebook_dtype: str = "fp16"

    def __post_init__(self):
        super().__post_init__()
        if self.n_centroids < 1 or self.min_tokens_per_centroid < 1 or self.stages < 1 or self.iters < 0:
            raise ValueError("n_centroids, min_tokens_per_centroid and stages must be >= 1, iters >= 0")
        if self.codebook_dtype not in SCALE_DTYPES:
            raise ValueError(f"codebook_dtype must be one of {', '.join(SCALE_DTYPES)}, got {self.codebook_dtype!r}")

    def grid(self) -> str:
        return f"{super().grid()}; k-means {self.n_centroids} centroids x {self.stages} stage(s)"

    def n_clusters(self, n_tokens: int) -> int:
        return max(1, min(self.n_centroids, n_tokens // self.min_tokens_per_centroid))

    def smooth(self, x: torch.Tensor, kind: str, ctx: SpanContext,
               assign: AssignFn = kmeans_assign) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Subtract `stages` rounds of centroids: (S, N, D) -> residual (S, N, D) and the stored tensors."""
        self.validate(x, kind)
        r = x.float()
        K = self.n_clusters(x.shape[1])
        stored = {}
        for s in range(self.stages):
            key = f"{kind}.centroids{s}"
            c, ids = kmeans(r, K, self.iters, seed=ctx.seed + s, init=ctx.state.get(key), assign=assign)
            ctx.state[key] = c
            codebook = to_storage(c, SCALE_DTYPES[self.codebook_dtype])  # widened if fp8 cannot hold it
            stored[f"codebook{s}"] = codebook
            stored[f"centroid_ids{s}"] = ids.to(torch.uint8 if K <= 256 else torch.int16)
            r = r - gather_rows(codebook.float(), ids)  # the residual is taken against the stored centroids
        return r, stored

    def encode(self, x: torch.Tensor, kind: str, ctx: SpanContext) -> Encoded:
        r, stored = self.smooth(x, kind, ctx)
        q = self.quantize_residual(r, kind)
        return Encoded({**stored, **q.tensors()}, tuple(x.shape), {"axis": q.axis})

    def decode(self, enc: Encoded) -> torch.Tensor:
        x = super().decode(enc)
        for s in range(self.stages):
            x = x + gather_rows(enc.tensors[f"codebook{s}"].float(), enc.tensors[f"centroid_ids{s}"].long())
        return x


@register("qvg-pro")
@dataclass(frozen=True)
class QVGPro(QVG):
    name = "qvg-pro"
    stages: int = 4
    group_size: int = 16
