"""QSAC: Quantization Sensitivity-Aware Clustering of Keys (docs/method.md §2.1).

QVG clusters a span's tokens with plain Euclidean k-means. QSAC assigns key k to the centroid c that
minimises what the residual will do to the attention logits:

    J(k, c) = Σ_i w_i (k_i - c_i)^2 + λ Σ_g W_g range_g(k - c)^2 / (12 (2^b - 1)^2)

with channel sensitivity w_i = S_ii / mean(diag S) from the history-Query second moment S = E[q qᵀ]
and W_g = Σ_{i in g} w_i. The first term is the weighted distance; the second the expected logit error of
the residual's quantization step. Lloyd iterations assign by J and update centroids as member means.

`qsac_cost_ref` evaluates J exactly for every (token, centroid) pair: O(N K D) with no matmul shortcut.
`qsac_assign_ref` uses it when `candidates` is None; otherwise it prunes to the `candidates` centroids
closest in the weighted distance (one matmul) and evaluates the range term on those only, which is what
keeps QuantWM within a small factor of QVG's cost. The pruning is exact whenever the best centroid under J
is among those candidates; the tests measure how often it is not. `qsac_assign` dispatches without changing
the rule: the kernel (J on every centroid) serves the exact rule on the CUDA fast path, and the pruned rule
runs the same torch code on every device, so CPU and GPU assign alike.
"""
from __future__ import annotations

import torch

from .backend import use_kernels
from .kmeans import weighted_sqdist
from .selfcheck import checked_exact


def channel_sensitivity(stats: torch.Tensor) -> torch.Tensor:
    """w_i = S_ii / mean(diag S): stats (S, D, D) -> (S, D)."""
    diag = torch.diagonal(stats, dim1=-2, dim2=-1).float().clamp_min(0)
    mean = diag.mean(-1, keepdim=True)
    return torch.where(mean > 0, diag / mean.clamp_min(1e-30), torch.ones_like(diag))


def range_term(r: torch.Tensor, w: torch.Tensor, group_size: int, bits: int) -> torch.Tensor:
    """Σ_g W_g range_g(r)^2 / (12 (2^b-1)^2): r (..., D) residuals, w broadcastable to (..., D)."""
    D = r.shape[-1]
    g = r.reshape(*r.shape[:-1], D // group_size, group_size)
    rng = g.amax(-1) - g.amin(-1)
    W = w.reshape(*w.shape[:-1], D // group_size, group_size).sum(-1)
    return (W * rng.square()).sum(-1) / (12 * (2 ** bits - 1) ** 2)


def qsac_cost_ref(x: torch.Tensor, c: torch.Tensor, w: torch.Tensor, group_size: int, bits: int,
                  lam: float, block: int = 256, distance: float = 1.0) -> torch.Tensor:
    """Exact J for all pairs: x (S, N, D), c (S, K, D), w (S, D) -> (S, N, K), computed in token blocks;
    `distance` weighs the weighted-distance term (0: the range term alone, the QuantWM paper's rule)."""
    S, N, D = x.shape
    out = torch.empty(S, N, c.shape[1], dtype=torch.float32, device=x.device)
    wb = w[:, None, None, :]
    for s in range(0, N, block):
        r = x[:, s:s + block, None, :] - c[:, None, :, :]  # (S, n, K, D)
        out[:, s:s + block] = distance * (wb * r.square()).sum(-1) + lam * range_term(r, wb, group_size, bits)
    return out


def qsac_assign_ref(x: torch.Tensor, c: torch.Tensor, w: torch.Tensor, group_size: int, bits: int,
                    lam: float, candidates: int | None = 4, distance: float = 1.0) -> torch.Tensor:
    """argmin_c J(k, c): (S, N, D), (S, K, D), (S, D) -> ids (S, N). The shortlist is always by weighted
    distance; `distance` weighs that term inside J (see `qsac_cost_ref`)."""
    K = c.shape[1]
    if candidates is None or candidates >= K:
        return qsac_cost_ref(x, c, w, group_size, bits, lam, distance=distance).argmin(-1)
    d = weighted_sqdist(x, c, w)  # (S, N, K)
    cand = d.topk(candidates, dim=-1, largest=False).indices  # (S, N, m)
    S, N, D = x.shape
    cc = torch.gather(c, 1, cand.reshape(S, -1, 1).expand(S, N * candidates, D)).reshape(S, N, candidates, D)
    r = x[:, :, None, :] - cc
    J = distance * torch.gather(d, 2, cand) + lam * range_term(r, w[:, None, None, :], group_size, bits)
    return torch.gather(cand, 2, J.argmin(-1, keepdim=True)).squeeze(-1)


def qsac_assign(x: torch.Tensor, c: torch.Tensor, w: torch.Tensor, group_size: int, bits: int, lam: float,
                candidates: int | None = 4, distance: float = 1.0) -> torch.Tensor:
    """argmin_c J(k, c), the same assignment on every backend: the exact rule (`candidates` None or at
    least K) runs kernels/qsac_assign.py on the fast path (J on every centroid) and `qsac_assign_ref`
    elsewhere; the pruned rule (a shortlist of `candidates` by weighted distance, then J) is part of the
    method's definition, so it runs `qsac_assign_ref` (torch, on the tensors' device) everywhere."""
    exact = candidates is None or candidates >= c.shape[1]
    if exact and distance == 1.0 and use_kernels(x) and not group_size & (group_size - 1):
        exact_ref = lambda *a: qsac_assign_ref(*a, candidates=None)  # noqa: E731  (the kernel's rule: J on all)
        return checked_exact("qsac_assign", f"groups of {group_size}, {bits}-bit", exact_ref, x, c, w, group_size, bits,
                             lam)
    return qsac_assign_ref(x, c, w, group_size, bits, lam, candidates, distance)
