"""Tests for quantwm.evaluation.rate_distortion: the bound against independent computations, the meter on
coders of known distance from it (2-bit scalar grid, the Gaussian test channel), and its input checks."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from quantwm.evaluation.rate_distortion import distortion_at, rate_at, rate_distortion, summarise, water_filling, weighted_spectrum

SPECTRUM = torch.tensor([4.0, 2.0, 1.0, 0.5, 0.25, 0.1, 0.02, 0.0], dtype=torch.float64)


def _rate_brentq(sigma2: np.ndarray, distortion: float) -> float:
    """R(D) by another route: scipy's root finder on D(θ) = D over θ, then R(θ) summed in numpy."""
    optimize = pytest.importorskip("scipy.optimize")
    theta = optimize.brentq(lambda t: np.minimum(sigma2, t).sum() - distortion, 1e-12, sigma2.max(), xtol=1e-15)
    return float(sum(0.5 * math.log2(s / theta) for s in sigma2 if s > theta))


def test_rate_at_matches_the_closed_form_when_every_component_is_active():
    sigma2 = torch.tensor([3.0, 1.5, 0.8, 0.6], dtype=torch.float64)
    distortion = 4 * 0.5  # θ = D/n = 0.5 lies below every σ²
    closed = 0.5 * sum(math.log2(s / 0.5) for s in sigma2.tolist())
    assert float(rate_at(sigma2, distortion)) == pytest.approx(closed, rel=1e-9)


@pytest.mark.parametrize("distortion", [0.01, 0.3, 1.0, 2.5, 7.0])
def test_rate_at_matches_a_root_finder_with_inactive_components(distortion):
    expected = _rate_brentq(SPECTRUM.numpy(), distortion)
    assert float(rate_at(SPECTRUM, distortion)) == pytest.approx(expected, rel=1e-9, abs=1e-9)


def test_rate_at_ends_and_distortion_at_inverts_it():
    total = float(SPECTRUM.sum())
    assert float(rate_at(SPECTRUM, total)) == 0 and float(rate_at(SPECTRUM, 2 * total)) == 0
    assert math.isinf(float(rate_at(SPECTRUM, 0.0)))
    assert float(distortion_at(SPECTRUM, 0.0)) == pytest.approx(total)
    for rate in (0.5, 3.0, 12.0, 40.0):
        d = distortion_at(SPECTRUM, rate)
        assert float(rate_at(SPECTRUM, d)) == pytest.approx(rate, rel=1e-9)
    # a batch of streams is solved stream by stream
    batch = torch.stack([SPECTRUM, 3 * SPECTRUM])
    rates = rate_at(batch, torch.tensor([0.3, 0.9], dtype=torch.float64))
    assert rates[0] == pytest.approx(rates[1], rel=1e-12)  # the same source, scaled: the same rate
    d, r = water_filling(SPECTRUM, torch.tensor(0.5, dtype=torch.float64))
    assert float(d) == pytest.approx(0.5 * 4 + 0.25 + 0.1 + 0.02) and float(r) == pytest.approx(0.5 * math.log2(8 * 4 * 2))


def test_weighted_spectrum_matches_a_cholesky_route():
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(500, 6, generator=g, dtype=torch.float64) @ torch.randn(6, 6, generator=g, dtype=torch.float64)
    a = torch.randn(6, 6, generator=g, dtype=torch.float64)
    S = a @ a.T + 0.1 * torch.eye(6, dtype=torch.float64)
    cov = torch.from_numpy(np.cov(keys.numpy().T, bias=True))
    L = torch.linalg.cholesky(S)  # S = L Lᵀ: Lᵀ C L has the eigenvalues of S^½ C S^½
    expected = torch.linalg.eigvalsh(L.T @ cov @ L)
    assert torch.allclose(weighted_spectrum(keys, S), expected, rtol=1e-9, atol=1e-12)


def _scalar_2bit(x: torch.Tensor) -> torch.Tensor:
    """The 4-level uniform quantizer with the MSE-optimal step for a unit Gaussian (step 0.9957, MSE 0.1188)."""
    step = 0.9957
    return (torch.floor(x / step).clamp(-2, 1) + 0.5) * step


def test_a_scalar_2bit_grid_on_gaussian_keys_sits_about_half_a_bit_above_the_bound():
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(3, 20000, 16, generator=g)
    S = torch.eye(16).expand(3, 16, 16) * 7.0  # S's scale cancels
    r = rate_distortion(keys, _scalar_2bit(keys), S, bits=2.0)
    assert r.distortion.shape == (3,)
    assert (r.distortion / r.variance).mean() == pytest.approx(0.1188, rel=0.03)
    assert 0.3 < float(r.bits_above.mean()) < 0.7  # 2 − ½ log2(1/0.1188) ≈ 0.46
    assert float(r.bits_above.mean()) == pytest.approx(2 - 0.5 * math.log2(1 / 0.1188), abs=0.03)
    assert (r.bound_distortion / r.variance).mean() == pytest.approx(2 ** -4, rel=0.03)  # D(2 bits) = σ²/16
    s = summarise([r])
    assert s["bits_above_bound"] == pytest.approx(float(r.bits_above.mean()))
    assert s["bound_bits"] == pytest.approx(2 - s["bits_above_bound"])


def test_the_gaussian_test_channel_meets_the_bound():
    # keys whose weighted covariance S^½ C S^½ has the spectrum SPECTRUM·5 (two components below the water
    # level), coded by the test channel of reverse water-filling at θ: the rate it needs is R(θ) exactly
    g = torch.Generator().manual_seed(2)
    n, N, theta = len(SPECTRUM), 40000, 0.3
    sigma2 = SPECTRUM * 5
    a = torch.randn(n, n, generator=g, dtype=torch.float64)
    S = a @ a.T + torch.eye(n, dtype=torch.float64)
    lam, vec = torch.linalg.eigh(S)
    inv_half = vec @ torch.diag(lam.rsqrt()) @ vec.T
    U = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))[0]
    z = torch.randn(N, n, generator=g, dtype=torch.float64) * sigma2.sqrt()  # weighted coordinates
    gain = (1 - theta / sigma2).clamp_min(0)
    z_hat = gain * z + (theta * gain).sqrt() * torch.randn(N, n, generator=g, dtype=torch.float64)
    mean = torch.randn(n, generator=g, dtype=torch.float64)
    keys, decoded = mean + z @ U.T @ inv_half, mean + z_hat @ U.T @ inv_half  # the mean is free
    rate = float(water_filling(sigma2, torch.tensor(theta, dtype=torch.float64))[1])
    r = rate_distortion(keys, decoded, S, bits=rate / n)
    assert abs(float(r.bits_above)) < 0.02
    assert float(r.bound_distortion) == pytest.approx(float(r.distortion), rel=0.03)


def test_perfect_keys_need_infinite_rate_and_summarise_skips_empty_streams():
    keys = torch.randn(2, 50, 4)
    r = rate_distortion(keys, keys.clone(), torch.eye(4), bits=3.0)
    assert torch.isinf(r.rate).all() and (r.bits_above == -math.inf).all()
    flat = rate_distortion(torch.ones(2, 50, 4), torch.zeros(2, 50, 4), torch.eye(4), bits=3.0)
    assert (flat.variance == 0).all() and math.isnan(summarise([flat])["bits_above_bound"])
    no_bits = summarise([rate_distortion(keys, keys + 0.1, torch.eye(4))])
    assert math.isnan(no_bits["bits_above_bound"]) and no_bits["bound_bits"] > 0


@pytest.mark.parametrize("args, match", [
    ((torch.zeros(2, 10, 4), torch.zeros(2, 10, 5), torch.eye(4)), "share a"),
    ((torch.zeros(2, 10, 4), torch.zeros(2, 10, 4), torch.eye(5)), r"S must be \(..., D, D\)"),
    ((torch.zeros(2, 10, 4), torch.zeros(2, 10, 4), torch.eye(4).expand(3, 4, 4)), "do not broadcast"),
    ((torch.zeros(2, 1, 4), torch.zeros(2, 1, 4), torch.eye(4)), "at least 2 tokens"),
    ((torch.zeros(10, 4), torch.full((10, 4), math.nan), torch.eye(4)), r"40 NaN/Inf value\(s\) in decoded keys"),
    ((torch.zeros(10, 4), torch.zeros(10, 4), torch.eye(4) * math.inf), r"16 NaN/Inf value\(s\) in S"),
    ((torch.zeros(10, 4, dtype=torch.int32), torch.zeros(10, 4), torch.eye(4)), "floating point"),
])
def test_bad_input_raises_a_clear_value_error(args, match):
    with pytest.raises(ValueError, match=match):
        rate_distortion(*args)


@pytest.mark.parametrize("bits", [0.0, -1.0, math.nan])
def test_bad_bits_raise(bits):
    with pytest.raises(ValueError, match="bits per element must be"):
        rate_distortion(torch.randn(10, 4), torch.randn(10, 4), torch.eye(4), bits=bits)
