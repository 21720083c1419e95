"""A rate-distortion meter for quantized Keys: how many bits per element a method spends above the Gaussian
bound at the distortion it reaches (docs/results.md, "Bits above the bound").

A stream is one cached Key span of one (layer, head): keys k_t (N, D), their decoded copies k̂_t and the
second moment S (D, D) of the queries that read them. The distortion that reaches attention is the
query-weighted error D = mean_t e_tᵀ S e_t with e_t = k̂_t − k_t: the mean squared logit error (before the
softmax scale) over the queries S was built from. The source, seen in the same weighted space, has covariance
W = S^½ C S^½, where C is the covariance of the span's keys about the span mean. The mean is taken as free:
stored once per span it costs D·16 bits, D·16/N bits per token. Reverse water-filling on W's eigenvalues σ_i²
(Cover & Thomas, Thm. 10.3.3) gives the rate a Gaussian source with that covariance needs at distortion D:

    D(θ) = Σ_i min(θ, σ_i²),   R(θ) = Σ_i max(0, ½ log2(σ_i²/θ))   bits per token,

solved for θ by bisection in log θ. A Gaussian is the hardest source of a given covariance, so R(D) is an
upper bound on the keys' true rate-distortion function. "Bits above the bound", B − R(D)/D, is therefore a
conservative measure of a method's waste: on keys far from Gaussian it can go below zero. The meter knows
nothing of the method; it reads keys, decoded keys and S.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_STEPS = 200  # bisection steps in log θ: the bracket's log-width halves each step, far below float64 precision


@dataclass(frozen=True)
class RateDistortion:
    """The meter's figures per stream, each (...,) over the leading dims of the keys (e.g. heads).

    distortion:       D, the measured query-weighted error per token, mean_t e_tᵀ S e_t
    variance:         Σ σ_i², the distortion of spending nothing (every key read as the span mean)
    rate:             R(D), the bits per token the Gaussian bound needs to reach D (inf when D = 0)
    bound_distortion: D*(B), the bound's distortion at the method's bits (None without `bits`)
    bits:             B, the method's stored bits per element (None if not given)
    tokens, head_dim: N and D of each stream
    """

    distortion: torch.Tensor
    variance: torch.Tensor
    rate: torch.Tensor
    bound_distortion: torch.Tensor | None
    bits: float | None
    tokens: int
    head_dim: int

    @property
    def bits_above(self) -> torch.Tensor:
        """B − R(D)/D per stream: bits per element spent above the bound at the distortion reached."""
        if self.bits is None:
            raise ValueError("bits above the bound needs the method's bits per element: pass bits=")
        return self.bits - self.rate / self.head_dim


def water_filling(sigma2: torch.Tensor, theta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(D(θ), R(θ) in bits) of reverse water-filling: sigma2 (..., n) eigenvalues, theta (...,) > 0."""
    t = theta[..., None]
    distortion = torch.minimum(sigma2, t).sum(-1)
    rate = (0.5 * torch.log2(sigma2.clamp_min(1e-300) / t)).clamp_min(0).sum(-1)
    return distortion, rate


def rate_at(sigma2: torch.Tensor, distortion: torch.Tensor | float) -> torch.Tensor:
    """R(D) in bits per token: sigma2 (..., n) ≥ 0, distortion (...,) or a number. 0 when D ≥ Σσ², inf when D = 0."""
    sigma2 = sigma2.double()
    distortion = torch.as_tensor(distortion, dtype=torch.float64).expand(sigma2.shape[:-1])
    total, n = sigma2.sum(-1), sigma2.shape[-1]
    # D(θ) ≤ nθ, so θ = D/n is at or below the answer; θ = max σ² gives D = Σσ², at or above it
    lo = torch.log((distortion / n).clamp_min(1e-300))
    hi = torch.log(sigma2.amax(-1).clamp_min(1e-300))
    for _ in range(_STEPS):
        mid = (lo + hi) / 2
        below = water_filling(sigma2, mid.exp())[0] < distortion
        lo, hi = torch.where(below, mid, lo), torch.where(below, hi, mid)
    rate = water_filling(sigma2, ((lo + hi) / 2).exp())[1]
    rate = torch.where(distortion >= total, torch.zeros_like(rate), rate)
    return torch.where(distortion <= 0, torch.full_like(rate, math.inf), rate)


def distortion_at(sigma2: torch.Tensor, rate: torch.Tensor | float) -> torch.Tensor:
    """D*(R), the bound's distortion at R bits per token: sigma2 (..., n) ≥ 0, rate (...,) or a number ≥ 0."""
    return water_filling(sigma2.double(), water_level(sigma2, rate))[0]


def water_level(sigma2: torch.Tensor, rate: torch.Tensor | float) -> torch.Tensor:
    """θ (...,) of reverse water-filling at R bits per token (components of σ² ≤ θ get no bits, the others
    D_i = θ): sigma2 (..., n) ≥ 0, rate (...,) or a number ≥ 0."""
    sigma2 = sigma2.double()
    rate = torch.as_tensor(rate, dtype=torch.float64).expand(sigma2.shape[:-1])
    positive = sigma2 > 0
    m = positive.sum(-1).clamp_min(1)
    smallest = torch.where(positive, sigma2, torch.full_like(sigma2, math.inf)).amin(-1)
    # below the smallest positive σ² every component is active and R = ½ Σ log2(σ²/θ); θ there, lowered by
    # 2^(-2R/m), needs at least R bits. θ = max σ² needs none.
    lo = torch.log(smallest.clamp(1e-300, 1e300)) - 2 * rate / m * math.log(2)
    hi = torch.log(sigma2.amax(-1).clamp_min(1e-300))
    for _ in range(_STEPS):
        mid = (lo + hi) / 2
        above = water_filling(sigma2, mid.exp())[1] > rate
        lo, hi = torch.where(above, mid, lo), torch.where(above, hi, mid)
    return hi.exp()


def weighted_spectrum(keys: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """Eigenvalues σ_i² (..., D) of W = S^½ C S^½, C the keys' covariance about their mean: keys (..., N, D),
    S (..., D, D) symmetric positive semi-definite."""
    k = keys.double()
    c = k - k.mean(-2, keepdim=True)
    cov = c.transpose(-1, -2) @ c / k.shape[-2]  # (..., N, D) -> (..., D, D)
    lam, vec = torch.linalg.eigh((S.double() + S.double().transpose(-1, -2)) / 2)
    half = vec @ torch.diag_embed(lam.clamp_min(0).sqrt()) @ vec.transpose(-1, -2)
    w = half @ cov @ half
    sigma2 = torch.linalg.eigvalsh((w + w.transpose(-1, -2)) / 2)
    # eigenvalues at rounding level of the largest are zero (a rank-deficient S or span)
    return torch.where(sigma2 > 1e-12 * sigma2.amax(-1, keepdim=True), sigma2, torch.zeros_like(sigma2))


def _check(keys: torch.Tensor, decoded: torch.Tensor, S: torch.Tensor, bits: float | None) -> None:
    if keys.dim() < 2 or keys.shape != decoded.shape:
        raise ValueError(f"keys and decoded keys must share a (..., N, D) shape, got {tuple(keys.shape)} and "
                         f"{tuple(decoded.shape)}")
    D = keys.shape[-1]
    if S.dim() < 2 or S.shape[-2:] != (D, D):
        raise ValueError(f"S must be (..., D, D) with D = {D} (the keys' head dim), got {tuple(S.shape)}")
    try:
        torch.broadcast_shapes(S.shape[:-2], keys.shape[:-2])
    except RuntimeError as e:
        raise ValueError(f"S's leading dims {tuple(S.shape[:-2])} do not broadcast to the keys' "
                         f"{tuple(keys.shape[:-2])}") from e
    if keys.shape[-2] < 2 or D < 1:
        raise ValueError(f"a span needs at least 2 tokens and a head dim ≥ 1, got {tuple(keys.shape[-2:])}")
    for name, t in (("keys", keys), ("decoded keys", decoded), ("S", S)):
        if not torch.is_floating_point(t):
            raise ValueError(f"{name} must be floating point, got {t.dtype}")
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            raise ValueError(f"{bad} NaN/Inf value(s) in {name}")
    if bits is not None and not (math.isfinite(bits) and bits > 0):
        raise ValueError(f"bits per element must be a finite number > 0, got {bits}")


def rate_distortion(keys: torch.Tensor, decoded: torch.Tensor, S: torch.Tensor,
                    bits: float | None = None) -> RateDistortion:
    """The meter on one span per stream: keys and decoded (..., N, D), S (..., D, D) (broadcast over the
    leading dims), `bits` the method's stored bits per element for these keys. Float64 throughout."""
    _check(keys, decoded, S, bits)
    N, D = keys.shape[-2:]
    S = S.double().expand(*keys.shape[:-2], D, D)
    e = decoded.double() - keys.double()
    distortion = torch.einsum("...ni,...ij,...nj->...", e, S, e) / N
    sigma2 = weighted_spectrum(keys, S)
    bound = None if bits is None else distortion_at(sigma2, bits * D)
    return RateDistortion(distortion=distortion, variance=sigma2.sum(-1), rate=rate_at(sigma2, distortion),
                          bound_distortion=bound, bits=bits, tokens=N, head_dim=D)


def summarise(parts: list[RateDistortion]) -> dict[str, float]:
    """Token-weighted means over every stream of every part (all spans, heads, layers) of per-stream figures
    that do not depend on the keys' scale: {"bits_above_bound": B − R(D)/D, "bound_bits": R(D)/D,
    "distortion": D/Σσ², "bound_distortion": D*(B)/Σσ²}; nan for what no part measured. Streams with zero
    weighted variance (nothing to code) are left out."""
    sums = {k: 0.0 for k in ("bits_above_bound", "bound_bits", "distortion", "bound_distortion")}
    weight = 0.0
    for p in parts:
        keep = p.variance > 0
        w = p.tokens * int(keep.sum())
        if not w:
            continue
        var = p.variance[keep]
        sums["bound_bits"] += p.tokens * float((p.rate[keep] / p.head_dim).sum())
        sums["distortion"] += p.tokens * float((p.distortion[keep] / var).sum())
        if p.bits is not None:
            sums["bits_above_bound"] += p.tokens * float(p.bits_above[keep].sum())
            sums["bound_distortion"] += p.tokens * float((p.bound_distortion[keep] / var).sum())
        weight += w
    has_bits = bool(parts) and all(p.bits is not None for p in parts)
    return {k: (v / weight if weight and (has_bits or k in ("bound_bits", "distortion")) else math.nan)
            for k, v in sums.items()}
