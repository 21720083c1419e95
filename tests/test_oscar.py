"""OSCAR (quantwm/core/methods/oscar.py) and its `OscarSpan` layout (core/layouts/oscar.py): the rotation (orthogonal,
U·H·P of the covariance, fitted once per layer and shared), the per-token clip, bytes as stored, the Value weights
from the span's keys, and its budget rule."""
import pytest
import torch

from quantwm.core.budget import candidates, configure
from quantwm.core.cache import CacheConfig, KVCache
from quantwm.core.layouts.oscar import OscarSpan, data_free_rotation
from quantwm.core.methods import SpanContext, get_method
from quantwm.core.methods.oscar import bit_reversed, clip_rows, key_weights, oscar_rotation


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _rel_err(x_hat, x):
    return ((x_hat - x).square().sum() / x.square().sum()).item()


def _history(S=2, D=64, seed=1):
    """A history-query second moment (S, D, D) with a few strong directions."""
    q = _randn(S, 400, D, seed=seed) * torch.linspace(4, 0.1, D)
    return q.transpose(1, 2) @ q / 400


@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize("history", [0, 10])
def test_oscar_round_trip_rebuilds_the_span_without_the_method(kind, history):
    x = _randn(2, 300, 64, seed=2) * 2 + 0.5
    enc = get_method("oscar").encode(x, kind, SpanContext(stats=_history(), history=history))
    assert isinstance(enc, OscarSpan) and enc.shape == (2, 300, 64)
    x_hat = enc.decode()  # no method asked
    assert x_hat.shape == x.shape and x_hat.dtype == torch.float32
    assert _rel_err(x_hat, x) < 0.2  # 2 bits per token over the whole rotated row: measured 0.12-0.16
    assert (enc.rotation is None) == (history == 0)  # before any history: the data-free Hadamard rotation, unstored


@pytest.mark.parametrize("bits, most", [(2, 0.2), (3, 0.05), (4, 0.02)])
def test_oscar_error_falls_with_its_width(bits, most):
    x = _randn(2, 300, 128, seed=3)
    enc = get_method("oscar", bits=bits).encode(x, "k", SpanContext(stats=_history(D=128), history=5))
    assert _rel_err(enc.decode(), x) < most  # measured 0.158, 0.036, 0.016 (at 4 bits the clip's error dominates)


@pytest.mark.parametrize("D", [64, 128, 96])
def test_oscar_rotation_is_orthogonal(D):
    R = oscar_rotation(_history(1, D)[0])
    assert R.shape == (D, D) and R.dtype == torch.float32
    assert torch.allclose(R @ R.T, torch.eye(D), atol=1e-5)
    H = data_free_rotation(D)
    assert torch.allclose(H @ H.T, torch.eye(D), atol=1e-5)
    stored = get_method("oscar").rotation(_randn(2, 50, D), "k", ctx := SpanContext(stats=_history(2, D), history=3))
    assert stored.dtype == torch.float16 and stored.shape == (1, D, D) and ctx.state["oscar.k.rotation"] is stored
    assert torch.allclose(stored[0].float() @ stored[0].float().T, torch.eye(D), atol=2e-3)  # fp16 entries


def test_oscar_rotation_is_u_h_p_of_the_covariance():
    """Column bitreverse(i) of R is the i-th largest eigenvector of Σ mixed by the normalized Hadamard matrix."""
    cov = _history(1, 16)[0]
    vals, U = torch.linalg.eigh(cov.double())
    mixed = (U @ data_free_rotation(16).double()).float()
    R = oscar_rotation(cov)
    for i, col in enumerate(bit_reversed(16).tolist()):
        assert torch.allclose(R[:, col], mixed[:, vals.argsort(descending=True)[i]], atol=1e-5)
    assert bit_reversed(8).tolist() == [0, 4, 2, 6, 1, 5, 3, 7]
    assert sorted(bit_reversed(12).tolist()) == list(range(12))  # not a power of two: still a permutation


def test_oscar_clip_is_the_rows_quantile_as_the_release_picks_it():
    y = _randn(3, 10, 128, seed=4)
    c = clip_rows(y, 0.96)
    tau = y.abs().sort(-1).values[..., int(0.96 * 128)]  # the release's index: int(clip * head_dim)
    assert torch.equal(c.abs().amax(-1), tau)
    assert ((y.abs() > tau[..., None]).sum(-1) == 128 - int(0.96 * 128) - 1).all()  # the 5 largest of each row
    assert torch.equal(clip_rows(y, 0.0), y)


def test_oscar_bytes_are_codes_and_fp16_scale_and_zero_plus_one_rotation_per_layer():
    x = _randn(2, 300, 128, seed=5)
    enc = get_method("oscar").encode(x, "k", SpanContext(stats=_history(D=128), history=5))
    own = sum(t.numel() * t.element_size() for t in enc.components().values())
    assert own == 2 * 300 * (32 + 2 + 2)  # 2.25 bits per element: 32 bytes of codes, fp16 scale and zero a token
    assert enc.nbytes() == own + 128 * 128 * 2  # the layer's fp16 rotation, which enc.shared() holds


def test_oscar_fits_its_rotation_once_per_layer_and_the_cache_counts_it_once():
    cache = KVCache(CacheConfig("oscar", target="kv", sink_chunks=1, recent_chunks=1), 1)
    g = torch.Generator().manual_seed(6)
    for i in range(5):
        k, v, q = (torch.randn(1, 2, 96, 64, generator=g) for _ in range(3))
        cache.attend(0, q, k, v, chunk=i, commit=True)
    spans = [s for s in cache.inspect(0) if s.quantized]
    assert len(spans) == 3
    elems = 2 * 3 * 2 * 96 * 64  # K and V, 3 spans of 2 heads x 96 tokens x 64
    rotations = 2 * 64 * 64 * 2  # one fp16 rotation for the Keys, one for the Values
    assert cache.quantized_bytes() == elems * 2.5 / 8 + rotations  # 2 + 32/64 bits per element at head dim 64
    assert "OSCAR: 2-bit asymmetric" in cache.configuration["k"]


def test_oscar_values_covariance_weighs_tokens_by_the_spans_keys():
    x, stats = _randn(2, 200, 32, seed=7), _history(2, 32)
    keys = _randn(2, 200, 32, seed=8) * torch.linspace(3, 0.1, 32)
    w = key_weights(keys, stats)
    assert w.shape == (2, 200) and torch.allclose(w.mean(1), torch.ones(2))
    m = get_method("oscar")
    ctx = SpanContext(stats=stats, history=5)
    m.encode(keys, "k", ctx)  # the cache encodes a span's Keys first, with the same context
    weighted = m.encode(x, "v", ctx).rotation
    plain = m.encode(x, "v", SpanContext(stats=stats, history=5)).rotation  # no Keys: w = 1 (the release's `vtv`)
    expected = oscar_rotation(((x * w[..., None]).transpose(1, 2) @ x / 200).mean(0)).half()
    assert torch.equal(weighted[0], expected) and not torch.equal(weighted, plain)


def test_oscar_rejects_bad_options():
    for bad, match in (({"bits": 5}, "bits"), ({"k_clip": 1.5}, "k_clip"), ({"v_clip": -0.1}, "v_clip"),
                       ({"group_size": 0}, "group_size"), ({"scale_dtype": "fp64"}, "scale_dtype"),
                       ({"values": "tokens"}, "own, channels")):
        with pytest.raises(ValueError, match=match):
            get_method("oscar", **bad)
    with pytest.raises(ValueError, match="does not divide"):
        get_method("oscar", group_size=48).encode(_randn(1, 8, 64), "k", SpanContext())


def test_oscar_budget_rule_counts_its_rotation_over_the_layer():
    assert candidates("oscar", 128) == [{"bits": 4}, {"bits": 3}, {"bits": 2}, {"bits": 2, "scale_dtype": "fp8"}]
    rotation = 8 * 2 * 128 * 128  # bits of the layer's D x D fp16 rotation
    held = 2 * 4 * 1728 * 128  # two spans of 4 heads x 1728 tokens: 0.148 bits per element
    assert configure("oscar", 2.5, 128, 1728, "k", layer_elements=held) == ({"bits": 2}, 2.25 + rotation / held)
    assert configure("oscar", 3.5, 128, 1728, "k", layer_elements=held) == ({"bits": 3}, 3.25 + rotation / held)
    # unknown: over the first span (here one stream of 1728 tokens, 1.19 bits), all a cache can be sure of
    opts, bits = configure("oscar", 3.5, 128, 1728, "v")
    assert opts == {"bits": 2} and bits == pytest.approx(2.25 + rotation / (1728 * 128))
    with pytest.raises(ValueError, match="cannot fit"):  # fp8 scales and zeros: 2.125 + 1.19
        configure("oscar", 3.0, 128, 1728, "k")


@pytest.mark.parametrize("held_chunks,own", [(None, 2.25), (2, 3.25)])
def test_an_oscar_cache_at_a_budget_stores_at_most_its_budget_rotation_included(held_chunks, own):
    cache = KVCache(CacheConfig("oscar", budget=3.8, sink_chunks=1, recent_chunks=1, held_chunks=held_chunks), 1)
    g = torch.Generator().manual_seed(9)
    for i in range(4):
        k, v, q = (torch.randn(1, 4, 512, 128, generator=g) for _ in range(3))
        cache.attend(0, q, k, v, chunk=i, commit=True)
    # the rotation over the 2 spans held: 0.5 bits, so INT3 (3.25) fits 3.8; unknown, over the first span: 1.0 bit
    assert f"oscar at 3.8 bits: bits={int(own)} " in cache.configuration["k"]
    elems = 2 * 2 * 4 * 512 * 128  # K and V, 2 spans
    assert cache.bits_per_element() == pytest.approx(own + 8 * 2 * 128 * 128 * 2 / elems)  # 2.75 or 3.75
    assert cache.bits_per_element() <= 3.8
