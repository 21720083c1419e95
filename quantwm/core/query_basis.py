"""The Queries' basis: an orthogonal transform per stream in which QuantWM's allocator codes Keys (docs/method.md §2.7).

The logit error of a key error e is E[(q·e)²] = eᵀ S e, S = E[q qᵀ] the history Queries' second moment. In S's
eigenbasis U (S = U Λ Uᵀ) the coordinates y = Uᵀ k of a key weigh λ_i each, and Λ is far more concentrated than
diag(S) when the Queries look along directions that are not the model's channels (a trained W_q, W_k mixes them
freely). Coding y instead of k and giving coordinate i bits by λ_i (reverse water-filling) is what a transform
coder does; any orthogonal U is exact for attention, q·k = (Uᵀq)·(Uᵀk), so the fused kernel reads the coded
coordinates with the query rotated once per chunk. The allocator takes U from W = S^½ C S^½ rather than S alone
(`weighted_source`; C the keys' covariance): its eigenvectors also decorrelate the coordinates that carry the
logits, which independent coding per coordinate needs (docs/method.md §2.7).

Storing a D x D basis per stream would cost 2 D² bytes (32 KiB at D = 128, 8 KiB at D = 64): more than a 128-token
span's whole budget. Only the top R eigen-directions need to be exact; the rest of the space may be any orthonormal
complement. So the basis is stored as the R Householder reflectors of the QR factorisation of the top-R
eigenvectors V (V = H_1 ⋯ H_R [I_R; 0] up to column signs): U = H_1 ⋯ H_R, whose first R columns are V and whose
last D − R columns complete it. Each reflector v_i is stored in INT8 with one fp16 scale; H_i = I − 2 v̂ v̂ᵀ / (v̂ᵀ v̂)
from the stored v̂ is exactly orthogonal whatever the rounding, and encoder and decoder build U from the same
stored bytes. Bytes per stream: R (D + 2): 1056 at D = 64, R = 16; 2080 at D = 128.

A stored basis is shared with later spans while it still holds: its first R columns capture at least `reuse` of
the energy the new S's top R eigen-directions hold (`captured`). Its bytes are counted once, where stored, and
paid by the span that stores it (under a rolling window, a share by every span that reuses it; `quantwm-alloc`,
quantwm/core/methods/allocator.py).
"""
from __future__ import annotations

import math
import weakref

import torch

from .psac import principal_basis

_MATRICES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def basis_bytes(rank: int, head_dim: int) -> int:
    """Stored bytes of one stream's basis: R INT8 reflectors of D values and R fp16 scales."""
    return rank * (head_dim + 2)


def make_reflectors(stats: torch.Tensor, rank: int, top: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored form of the basis for S (streams, D, D): reflectors (streams, R, D) int8 and scales (streams, R)
    fp16, from the Householder QR of S's top-R eigenvectors (`top`: S's top eigenvectors (streams, D, ≥ R) if
    already computed)."""
    V = (principal_basis(stats, rank) if top is None else top[..., :rank]).double()  # (S, D, R)
    a, _ = torch.geqrf(V)
    D, R = V.shape[-2:]
    v = (a.tril(-1) + torch.eye(D, R, dtype=a.dtype, device=a.device)).transpose(1, 2)  # (S, R, D), v_i[i] = 1
    scales = (v.abs().amax(-1) / 127).half()  # ≥ 1/127: every reflector holds a 1
    codes = torch.round(v / scales.double()[..., None]).clamp(-127, 127).to(torch.int8)
    return codes, scales


def basis_matrix(reflectors: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """U = H_1 ⋯ H_R (streams, D, D) float32 from the stored reflectors; one copy per stored basis, however many
    spans share it (kept while a span holds the reflectors)."""
    key = (id(reflectors), reflectors.data_ptr())
    U = _MATRICES.get(key)
    if U is None:
        U = _MATRICES[key] = _product(reflectors, scales)
    return U


def _product(reflectors: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """U = H_1 ⋯ H_R (S, D, D) float32 in one LAPACK/cuSOLVER call (householder_product): each stored v̂_i,
    scaled so that its i-th entry is 1 (H_i does not change), is a column of the factor with τ_i = 2 / v̂ᵀv̂; the
    columns past R have τ = 0 (H = I)."""
    v = reflectors.double() * scales.double()[..., None]  # (S, R, D), zero above entry i
    S, R, D = v.shape
    v = v / v.diagonal(dim1=-2, dim2=-1)[..., None]  # entry i of v_i is 1 (it was, before rounding, ±1/127 apart)
    tau = 2 / v.square().sum(-1)  # (S, R)
    A = torch.zeros(S, D, D, dtype=torch.float64, device=v.device)
    A[:, :, :R] = v.transpose(1, 2)
    tau = torch.cat([tau, tau.new_zeros(S, D - R)], -1)
    return torch.linalg.householder_product(A, tau).float()


SQRT_ITERS = 13  # Newton–Schulz steps of `psd_sqrt` (Frobenius-scaled): the held-out traces' choices as with eigh
TOP_ITERS = 2  # subspace iterations of `captured`'s top energy, from a stored basis


def key_rotate_ref(x: torch.Tensor, U: torch.Tensor) -> torch.Tensor:
    """y = x U (streams, N, D) float32 of keys x (streams, N, D) in the basis U (streams, D, D) float32: the twin of
    kernels/key_rotate.py (which takes BF16 keys)."""
    return torch.bmm(x.float(), U)


def rotated(x: torch.Tensor, U: torch.Tensor) -> torch.Tensor:
    """`key_rotate_ref`'s y = x U, by kernels/key_rotate.py where the kernels run and the keys are BF16 of a head
    dim up to 128 (three BF16 tensor-core products to FP32's accuracy, instead of one FP32 product)."""
    from .backend import kernel

    return kernel("key_rotate")(x, U) if _on_tensor_cores(x) else key_rotate_ref(x, U)


def _on_tensor_cores(x: torch.Tensor) -> bool:
    """Whether keys x (S, N, D) take the BF16 tensor-core kernels (kernels/key_rotate.py,
    kernels/key_covariance_sums.py): the kernels run, and the keys are BF16, non-empty, of a head dim up to 128."""
    from .backend import use_kernels

    return use_kernels(x) and x.dtype == torch.bfloat16 and x.shape[-1] <= 128 and x.shape[1] > 0


def key_covariance(x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """C (streams, D, D) float64: the covariance of a span's keys x (streams, N, D) about their mean; `keep` (N,)
    bool: over those tokens only (the same as the covariance of x[:, keep], without a host read). Its sums come from
    kernels/key_covariance_sums.py where the kernels run and the keys are BF16 of a head dim up to 128 (one pass,
    BF16 tensor-core products to FP32's accuracy), else from `key_covariance_sums_ref`."""
    from .backend import kernel

    if _on_tensor_cores(x):
        yy, y = kernel("key_covariance_sums")(x, keep)
        total, n = y.sum(1), float(x.shape[1]) if keep is None else keep.sum()  # (S, D); the kept tokens
        # (Σ y yᵀ − Σy Σyᵀ / n) / n: the same C in two ops fewer than the twin's form below
        return (torch.baddbmm(yy.sum(1), total[:, :, None], (total / n)[:, None, :], alpha=-1) / n).double()
    yy, y = key_covariance_sums_ref(x, keep)
    n = x.new_full((), float(x.shape[1]), dtype=torch.float32) if keep is None else keep.sum().float()
    mean = y.sum(1, keepdim=True) / n  # (S, 1, D)
    return (yy.sum(1) / n - mean.transpose(1, 2) @ mean).double()


def key_covariance_sums_ref(x: torch.Tensor, keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ y yᵀ (streams, 1, D, D), Σ y (streams, 1, D)) float32 of a span's keys x (streams, N, D), y_t = x_t − x_0
    where kept (`keep` (N,) bool, None: all), else 0: the twin of kernels/key_covariance_sums.py (one stretch).

    One pass over the span: shifted by its first token (so the keys' offset does not cancel in fp32), masked; the
    covariance `key_covariance` forms from these is C = Σ y yᵀ / n − ȳ ȳᵀ in fp32 (a third of a centred fp64 pass's
    bytes), returned in fp64."""
    y = x - x[:, :1].float()  # (S, N, D) fp32
    if keep is not None:
        y = y * keep.to(y)[None, :, None]
    return (y.transpose(1, 2) @ y)[:, None], y.sum(1)[:, None]


def psd_sqrt(A: torch.Tensor, iters: int = SQRT_ITERS) -> torch.Tensor:
    """A^½ (streams, D, D) float64 of symmetric PSD A by the coupled Newton–Schulz iteration (Y → A^½, Z → A^-½
    on A scaled by its trace, so every eigenvalue lies in [0, 1]): a fixed number of batched matmuls, no
    eigendecomposition (which on a GPU waits on the host for its error check, and takes milliseconds)."""
    A = A.double()
    c = torch.linalg.matrix_norm(A).clamp_min(1e-300)[:, None, None]  # Frobenius: at least the top eigenvalue
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device).expand_as(A)
    Y = A / c
    Z = torch.add(1.5 * eye, Y, alpha=-0.5)  # the first step from Z = I: T = (3 I − Y) / 2, Y T, and Z = T
    Y = Y @ Z
    for step in range(1, iters):  # three batched matmuls a step (two in the last: Z is not read after it)
        T = torch.baddbmm(eye, Z, Y, beta=1.5, alpha=-0.5)  # (3 I − Z Y) / 2
        Y, Z = Y @ T, (T @ Z if step < iters - 1 else Z)
    return Y * c.sqrt()


def weighted_source(stats: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
    """W = S^½ C S^½ (streams, D, D): the keys' covariance C seen in the Queries' metric S, the covariance of the
    logit error's source; its eigenvectors are the directions a transform coder of the logits codes apart."""
    half = psd_sqrt(stats)
    W = half @ cov.double() @ half
    return ((W + W.transpose(1, 2)) / 2).float()


def coordinate_weights(U: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    """λ_i = u_iᵀ S u_i per (stream, coordinate) (streams, D): the Queries' energy along each coded coordinate."""
    Ud = U.double()
    return torch.einsum("sdi,sde,sei->si", Ud, stats.double(), Ud).clamp_min(0).float()


def captured(U: torch.Tensor, stats: torch.Tensor, rank: int) -> torch.Tensor:
    """Per stream: the share of the energy S's top-`rank` eigen-directions hold that U's first `rank` columns
    capture (1 for S's own basis). The top energy comes from below, by TOP_ITERS subspace iterations from those
    columns (close to S's top space already), as tr(Qᵀ S Q): no eigendecomposition, which on a GPU waits on the
    host for its error check and takes milliseconds."""
    A, Q = stats.double(), U[..., :rank].double()
    AQ = A @ Q
    held = (AQ * Q).sum((-2, -1))  # tr(Qᵀ A Q): what U's columns capture, and the subspace iteration's start
    for _ in range(TOP_ITERS):
        Q = torch.linalg.qr(AQ).Q
        AQ = A @ Q
    top = torch.maximum((AQ * Q).sum((-2, -1)), held)
    return torch.where(top > 0, held / top.clamp_min(1e-300), 1.0)


def gaussian_price(weights: torch.Tensor, variances: torch.Tensor, tokens: int, bits: float) -> torch.Tensor:
    """The error Σ_t Σ_i λ_i e_ti² a Gaussian source of `tokens` tokens with these per-coordinate variances (S, D)
    would have at `bits` bits per stream, spent by reverse water-filling, weights λ (S, D): a 0-dim float64 tensor
    on their device. How the allocator prices a basis U before coding in it, from the keys' covariance C,
    var(y_i) = u_iᵀ C u_i, without projecting the span (the ranking, not the value, is what it reads; scalar grids
    sit a fixed gap above).

    Closed form, no search: with the weighted variances σ² sorted down, the water level of the k loudest is
    log θ_k = (Σ_{i≤k} log σ_i² − 2·rate·log 2) / k, and the level is θ_k of the largest k with σ_k² > θ_k (none:
    every coordinate is dropped, θ = σ_1²)."""
    S, D = variances.shape
    sigma2 = (weights.double() * variances.double()).clamp_min(1e-300).sort(-1, descending=True).values  # (S, D)
    rate = max(bits, 0.0) / tokens  # bits per token
    k = torch.arange(1, D + 1, device=sigma2.device, dtype=torch.float64)
    log_theta = (sigma2.log().cumsum(-1) - 2 * rate * math.log(2)) / k  # (S, D): the level with the top k active
    active = sigma2.log() > log_theta
    last = (active * k).argmax(-1, keepdim=True)  # the largest active k (index 0 when none is: θ = σ_1²)
    theta = torch.where(active.any(-1, keepdim=True), log_theta.gather(-1, last).exp(), sigma2[:, :1])
    return tokens * torch.minimum(sigma2, theta).sum()
