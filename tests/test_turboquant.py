"""TurboQuant-MSE (quantwm/core/methods/turboquant.py), its Lloyd-Max tables (core/lloyd_max.py), its rotations
(core/random_rotation.py) and its `Rotated` layout (core/layouts/rotated.py): the paper's per-coordinate error
on Gaussian data, bytes as stored, determinism given the seed, and its budget rule."""
import pytest
import torch

from quantwm.core.attention import chunk_spans
from quantwm.core.budget import candidates, configure
from quantwm.core.cache import CacheConfig, KVCache
from quantwm.core.layouts import Rotated
from quantwm.core.lloyd_max import lloyd_max, lloyd_max_codes, lloyd_max_values
from quantwm.core.methods import SpanContext, get_method
from quantwm.core.random_rotation import random_rotation

# Per-coordinate MSE of the b-bit Lloyd-Max quantizer of N(0, 1) (Max 1960; TurboQuant's Table: 0.36, 0.117,
# 0.03, 0.009), the figures.
GAUSSIAN_MSE = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497}


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _rel_err(x_hat, x):
    return ((x_hat - x).square().sum() / x.square().sum()).item()


def _encode(x, kind="k", **options):
    return get_method("turboquant", **options).encode(x, kind, SpanContext())


# --- the scalar quantizer -------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_lloyd_max_mse_on_gaussian_samples_matches_the_table(bits):
    z = _randn(1_000_000, seed=bits)
    err = (lloyd_max_values(lloyd_max_codes(z, bits), bits) - z).square().mean().item()
    assert err == pytest.approx(GAUSSIAN_MSE[bits], rel=0.03)
    assert lloyd_max(bits).mse == pytest.approx(GAUSSIAN_MSE[bits], rel=0.003)  # the closed form


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_lloyd_max_tables_meet_lloyds_conditions(bits):
    levels, thresholds, _ = lloyd_max(bits)
    assert levels.shape == (2 ** bits,) and thresholds.shape == (2 ** bits - 1,)
    torch.testing.assert_close(levels, -levels.flip(0))  # symmetric about 0
    torch.testing.assert_close(thresholds, (levels[1:] + levels[:-1]) / 2)  # nearest level
    z = _randn(2_000_000, seed=10 + bits)
    codes = lloyd_max_codes(z, bits)
    means = torch.stack([z[codes == i].mean() for i in range(2 ** bits)])
    assert (means - levels).abs().max() < 0.02  # each level the mean of its cell
    assert int(codes.min()) == 0 and int(codes.max()) == 2 ** bits - 1


def test_lloyd_max_rejects_widths_it_has_no_table_for():
    for bits in (0, 5, 8):
        with pytest.raises(ValueError, match="1, 2, 3 or 4 bits"):
            lloyd_max(bits)


# --- rotations ------------------------------------------------------------------------------------

@pytest.mark.parametrize("d", [32, 96, 128, 80])
def test_random_rotations_are_orthogonal_and_seeded(d):
    r = random_rotation(d, 5)
    torch.testing.assert_close(r @ r.T, torch.eye(d), atol=1e-5, rtol=0)
    assert torch.equal(r, random_rotation.__wrapped__(d, 5))  # rebuilt from the seed: the same matrix
    assert not torch.allclose(r, random_rotation(d, 6))
    if d & (d - 1) == 0:  # randomized Hadamard: every entry ±1/√d
        torch.testing.assert_close(r.abs(), torch.full((d, d), d ** -0.5))


# --- the whole coder on Gaussian vectors ----------------------------------------------------------

@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_turboquant_relative_mse_on_gaussian_vectors_is_the_lloyd_max_mse(bits):
    # D = 256: a random unit vector's coordinate is a scaled Beta, lighter-tailed than N(0, 1/D) by O(1/D)
    # (measured: 0.987-0.997 of the Gaussian figure at D = 256, 0.977-0.991 at D = 128)
    x = _randn(2, 2048, 256, seed=20 + bits)
    enc = _encode(x, bits=bits)
    assert _rel_err(enc.decode(), x) == pytest.approx(GAUSSIAN_MSE[bits], rel=0.03)


@pytest.mark.parametrize("kind", ["k", "v"])
def test_turboquant_round_trip_shapes_and_rebuilds_without_the_method(kind):
    x = _randn(3, 97, 64, seed=1) * 3 + 1
    enc = _encode(x, kind, bits=3)
    assert isinstance(enc, Rotated) and enc.shape == (3, 97, 64)
    y = enc.decode()
    assert y.shape == x.shape and y.dtype == torch.float32
    assert _rel_err(y, x) < 0.05  # 3 bits: ~0.034
    norms = torch.stack([x.norm(dim=-1)], -1).half()
    assert torch.equal(enc.norms, norms)  # one fp16 norm per token
    x[1, 5] = 0  # a zero vector decodes to zeros
    assert torch.equal(_encode(x, kind).decode()[1, 5], torch.zeros(64))


def test_turboquant_is_deterministic_given_its_seed():
    x = _randn(2, 128, 64, seed=2)
    a, b, c = _encode(x, seed=3), _encode(x, seed=3), _encode(x, seed=4)
    for key, t in a.components().items():
        assert torch.equal(t, b.components()[key]), key
    assert torch.equal(a.decode(), b.decode())
    assert not torch.equal(a.components()["rot_codes0"], c.components()["rot_codes0"])  # another rotation
    assert _rel_err(c.decode(), x) == pytest.approx(_rel_err(a.decode(), x), rel=0.1)


def test_turboquant_bytes_are_its_stored_tensors_2_bits_plus_the_norm():
    S, N, D = 2, 100, 128
    enc = _encode(_randn(S, N, D, seed=3), bits=2)
    parts = enc.components()
    assert enc.nbytes() == sum(t.numel() * t.element_size() for t in parts.values())
    assert enc.shared() == {}  # the rotation is regenerated from the seed: no bytes per span
    assert 8 * enc.nbytes() / (S * N * D) == 2 + 16 / D  # 2-bit codes and an fp16 norm per token
    assert 8 * _encode(_randn(S, N, 96, seed=3), bits=3).nbytes() / (S * N * 96) == 3 + 16 / 96


def test_turboquant_split_stores_two_instances_and_the_outlier_list():
    S, N, D = 2, 1728, 128
    enc = _encode(_randn(S, N, D, seed=4), bits=2, outlier_channels=32, outlier_bits=3)
    assert (enc.bits, enc.dims) == ((3, 2), (32, 96))
    assert enc.norms.shape == (S, N, 2) and enc.channels.shape == (S, 32) and enc.channels.dtype == torch.uint8
    # per token: 32 x 3 + 96 x 2 code bits and two fp16 norms = 320 bits; per stream: 32 one-byte channel ids
    assert enc.nbytes() == S * (N * 320 // 8 + 32)
    assert 8 * enc.nbytes() / (S * N * D) == pytest.approx(2.5 + 256 / (N * D))


def test_turboquant_outliers_are_the_channels_of_largest_mean_square():
    x = _randn(2, 256, 128, seed=5)
    x[..., [3, 41]] *= 20
    plain, split = _encode(x, bits=2), _encode(x, bits=2, outlier_channels=2, outlier_bits=3)
    assert split.channels.tolist() == [[3, 41], [3, 41]]
    assert _rel_err(split.decode(), x) < 0.5 * _rel_err(plain.decode(), x)  # measured 0.034 vs 0.093
    assert "2 channels at 3 bits + 126 channels at 2 bits" in split.describe()


def test_turboquant_step_has_the_error_variance_of_a_uniform_grid():
    x = _randn(2, 512, 64, seed=6) * torch.linspace(0.5, 3, 64)
    for options in ({"bits": 2}, {"bits": 2, "outlier_channels": 16}):
        enc = _encode(x, **options)
        step = enc.step()
        assert step.shape == x.shape and (step > 0).all()
        assert ((enc.decode() - x).square().mean() / (step.square().mean() / 12)).item() == pytest.approx(1, abs=0.1)


@pytest.mark.parametrize("D", [96, 80, 24])
def test_turboquant_takes_a_head_dim_that_is_not_a_power_of_two(D):
    x = _randn(2, 300, D, seed=7)
    for options in ({"bits": 2}, {"bits": 2, "outlier_channels": D // 4}):
        enc = _encode(x, **options)
        assert enc.decode().shape == x.shape
        assert _rel_err(enc.decode(), x) < 0.13  # 2 bits: ~0.11, ~0.09 with the split


def test_turboquant_rejects_nonfinite_input_and_bad_options():
    x = _randn(2, 64, 64, seed=8)
    x[0, 3, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN/Inf"):
        _encode(x)
    for bad, match in (({"bits": 5}, "1, 2, 3, 4"), ({"bits": 0}, "1, 2, 3, 4"), ({"outlier_bits": 8}, "outlier_bits"),
                       ({"bits": 4, "outlier_channels": 8}, "outlier_bits"), ({"outlier_channels": -1}, "outlier_channels"),
                       ({"seed": -1}, "seed"), ({"group_size": 64}, "group_size")):
        with pytest.raises(ValueError, match=match):
            get_method("turboquant", **bad)
    with pytest.raises(ValueError, match="below the head dim"):
        _encode(_randn(1, 8, 16), outlier_channels=16)


def test_turboquant_grid_names_its_form():
    g = get_method("turboquant", bits=3, outlier_channels=32, outlier_bits=4).grid()
    assert "TurboQuant-MSE: 3-bit Lloyd-Max codes (8 levels)" in g and "32 channels of largest mean square at 4 bits" in g


# --- at a budget and in the cache -----------------------------------------------------------------

def test_turboquant_budget_rule_turns_its_widths_and_splits_richest_first():
    assert candidates("turboquant", 128) == [
        {"bits": 4}, {"bits": 3, "outlier_channels": 32, "outlier_bits": 4}, {"bits": 3},
        {"bits": 2, "outlier_channels": 32, "outlier_bits": 3}, {"bits": 2}, {"bits": 1}]
    opts, bits = configure("turboquant", 2.5, 128, 1728, "k")
    assert bits <= 2.5 and (opts, bits) == ({"bits": 2}, 2.125)  # the "2.5-bit" split stores 2.5012: over
    assert configure("turboquant", 2.51, 128, 1728, "k")[0] == {"bits": 2, "outlier_channels": 32, "outlier_bits": 3}
    assert configure("turboquant", 3.0, 128, 1728, "v") == (
        {"bits": 2, "outlier_channels": 32, "outlier_bits": 3}, pytest.approx(2.5 + 256 / (1728 * 128)))
    assert configure("turboquant", 1.2, 128, 1728, "k") == ({"bits": 1}, 1.125)


@pytest.mark.parametrize("method", ["turboquant", "turboquant+jensen"])
def test_a_turboquant_cache_reads_its_spans_through_the_reference_path(method):
    cache = KVCache(CacheConfig(method, k_bits=3, v_bits=3, sink_chunks=0, recent_chunks=0), 1)
    g = torch.Generator().manual_seed(9)
    for i in range(3):
        k, v, q = (torch.randn(1, 2, 64, 64, generator=g) for _ in range(3))
        out = cache.attend(0, q, k, v, chunk=i, commit=True)
        assert torch.isfinite(out).all()
    assert chunk_spans(cache, 0) is None  # kernel_side is None: no fused kernel reads this form
    assert cache.bits_per_element() == pytest.approx(3 + 16 / 64)
    assert "TurboQuant-MSE: 3-bit" in cache.configuration["k"]


def test_a_turboquant_cache_at_a_budget_stores_within_it():
    cache = KVCache(CacheConfig("turboquant", budget=2.5), 1)
    g = torch.Generator().manual_seed(10)
    for i in range(4):
        k, v, q = (torch.randn(1, 2, 128, 64, generator=g) for _ in range(3))
        cache.attend(0, q, k, v, chunk=i, commit=True)
    assert cache.bits_per_element() <= 2.5 and "turboquant at 2.5 bits: bits=2" in cache.configuration["k"]
