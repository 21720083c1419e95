"""Batched, seeded, deterministic k-means (Lloyd) for KV-cache smoothing.

One independent clustering per stream (a stream is one (batch, head) of one layer's span): x is
(S, N, D). Used plainly by QVG (Euclidean, "semantic-aware smoothing") and, with an assignment function
that implements QSAC's cost, by QuantWM. Initialisation: the previous span's centroids when given (warm
start, as QVG does) or K distinct tokens drawn with a seeded generator. Empty clusters keep their
previous centroid. Ties in the assignment go to the lowest centroid index (torch.argmin), so results are
reproducible for a given seed on a given device.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from .backend import use_kernels
from .selfcheck import checked_exact

AssignFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def weighted_sqdist(x: torch.Tensor, c: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_i w_i (x_i - c_i)^2 for every (token, centroid): x (S, N, D), c (S, K, D), w (S, D) -> (S, N, K)."""
    if w is None:
        xw, cw = x, c
    else:
        xw, cw = x * w[:, None, :], c * w[:, None, :]
    d = (x * xw).sum(-1, keepdim=True) - 2 * torch.bmm(xw, c.transpose(1, 2)) + (c * cw).sum(-1)[:, None, :]
    return d.clamp_min_(0)


def kmeans_assign_ref(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Euclidean nearest centroid: x (S, N, D), c (S, K, D) -> ids (S, N) int64."""
    return weighted_sqdist(x, c).argmin(-1)


def kmeans_assign(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Euclidean nearest centroid: kernels/kmeans_assign.py on the fast path, else `kmeans_assign_ref`."""
    return checked_exact("kmeans_assign", "euclidean", kmeans_assign_ref, x, c) if use_kernels(x) else \
        kmeans_assign_ref(x, c)


def init_centroids(x: torch.Tensor, n_clusters: int, seed: int) -> torch.Tensor:
    """K distinct tokens per stream, drawn with a seeded generator on the host (the same draw on every device):
    (S, N, D) -> (S, K, D)."""
    S, N, D = x.shape
    g = torch.Generator().manual_seed(seed)
    idx = torch.rand(S, N, generator=g, device="cpu").argsort(-1)[:, :n_clusters].to(x.device)  # one host copy
    return torch.gather(x, 1, idx[..., None].expand(S, n_clusters, D)).clone()


def update_centroids(x: torch.Tensor, ids: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """Member means; an empty cluster keeps `prev`. x (S, N, D), ids (S, N), prev (S, K, D)."""
    S, N, D = x.shape
    K = prev.shape[1]
    sums = torch.zeros(S, K, D, dtype=x.dtype, device=x.device).scatter_add_(1, ids[..., None].expand(S, N, D), x)
    counts = torch.zeros(S, K, dtype=x.dtype, device=x.device).scatter_add_(1, ids, torch.ones_like(ids, dtype=x.dtype))
    return torch.where(counts[..., None] > 0, sums / counts.clamp_min(1)[..., None], prev)


def kmeans(x: torch.Tensor, n_clusters: int, iters: int = 6, seed: int = 0, init: torch.Tensor | None = None,
           assign: AssignFn = kmeans_assign, tol: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd iterations: x (S, N, D) -> centroids (S, K, D) float32, ids (S, N) int64.

    `init` (S, K, D) warm-starts from earlier centroids; `assign(x, c) -> ids` sets the objective.
    Runs `iters` updates as tensor ops with no host read; from the first update after which at most a fraction
    `tol` of the ids changed (QVG's released code: 1e-4) the result stays frozen, as if stopped there (0: when
    none changes, where the updates are the identity anyway). K is clipped to N so that small spans still work.
    """
    if x.dim() != 3 or x.shape[1] == 0:
        raise ValueError(f"kmeans expects a non-empty (S, N, D) tensor, got shape {tuple(x.shape)}")
    if n_clusters < 1:
        raise ValueError(f"n_clusters must be >= 1, got {n_clusters}")
    x = x.float()
    K = min(n_clusters, x.shape[1])
    if init is not None and init.shape == (x.shape[0], K, x.shape[2]):
        c = init.float().clone()
    else:
        c = init_centroids(x, K, seed)
    ids = assign(x, c)
    done = torch.zeros((), dtype=torch.bool, device=x.device)
    for _ in range(iters):  # a fixed number of updates, nothing read back: a converged run stops changing
        new_c = update_centroids(x, ids, c)
        new_ids = assign(x, new_c)
        if tol > 0:  # QVG's early stop, kept on the device: once at most `tol` of the ids change, freeze
            c, ids, done = (torch.where(done, c, new_c), torch.where(done, ids, new_ids),
                            done | ((new_ids != ids).float().mean() <= tol))
        else:  # at tol 0 the stop is where nothing changes: the later updates are the identity
            c, ids = new_c, new_ids
    return c, ids
