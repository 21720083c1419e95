"""quantwm/core/methods/kvquant.py: KVQuant's non-uniform per-channel (Keys, pre-RoPE) / per-token (Values) codes with
dense-and-sparse outliers, its budget rule and bytes, and a pre-RoPE cache running it."""
from __future__ import annotations

import pytest
import torch

import quantwm.core.methods.kvquant  # noqa: F401  (registers kvquant before and after the package imports every file)
from quantwm.core import budget
from quantwm.core.cache import CacheConfig, KVCache
from quantwm.core.methods import SpanContext, get_method
from quantwm.core.methods.kvquant import KVQuant, outlier_count
from quantwm.core.rope import Rope3D

N, D = 1728, 128  # the held-out traces' spans


def _span(s=2, n=97, d=64, seed=0) -> torch.Tensor:
    """A span with per-channel offsets and scales (Keys' channel structure), bf16-exact values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(s, n, d, generator=g) * (0.5 + 2 * torch.rand(d, generator=g)) + torch.randn(d, generator=g)
    return x.bfloat16().float()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize("outliers", [0.01, 0.0])
def test_kvquant_roundtrip_error_falls_with_bits(kind, outliers):
    x = _span()
    errors = [_rel(KVQuant(bits=b, outliers=outliers).encode(x, kind, SpanContext()).decode(), x) for b in (2, 3, 4)]
    assert errors[0] > errors[1] > errors[2] and errors[0] < 0.4 and errors[2] < 0.1, errors


@pytest.mark.parametrize("kind", ["k", "v"])
def test_kvquant_keeps_each_rows_outliers_exactly(kind):
    x = _span(n=300, d=64)
    x[0, 17, 5] = 300.0  # a planted outlier, bf16-exact like every value here
    x[1, 3, 40] = -250.0
    enc = KVQuant(bits=2, outliers=0.01).encode(x, kind, SpanContext())
    out = enc.decode()
    rows, out_rows = (x.transpose(1, 2), out.transpose(1, 2)) if kind == "k" else (x, out)
    k = outlier_count(rows.shape[2], 0.01)
    assert k == (2 if kind == "k" else 1)  # ⌊(L − 1) · 0.005⌋ + 1 of a 300-token channel / a 64-channel token
    exact = out_rows == rows  # exact, not near
    for largest in (True, False):  # the k largest and k smallest of every row (of tied values, k of them)
        edge = rows.topk(k, dim=2, largest=largest).values[..., -1:]
        beyond = rows >= edge if largest else rows <= edge
        assert ((exact & beyond).sum(2) >= k).all()
    assert out[0, 17, 5] == 300.0 and out[1, 3, 40] == -250.0
    coded = _rel(KVQuant(bits=2, outliers=0.0).encode(x, kind, SpanContext()).decode(), x)
    assert _rel(out, x) < coded  # the planted outliers no longer stretch their rows' grids


def test_kvquant_outlier_count_follows_the_release_quantile_rule():
    """torch.quantile at 1 − f/2 with `>=` keeps ⌊(L − 1) f / 2⌋ + 1 elements of a row of distinct values."""
    for L in (2, 64, 128, 200, 1728, 4096):
        row = torch.randn(L, generator=torch.Generator().manual_seed(L))
        for f in (0.01, 0.005, 0.1):
            kept = int((row >= torch.quantile(row, 1 - f / 2)).sum())
            assert outlier_count(L, f) == min(kept, (L - 1) // 2), (L, f)
    assert outlier_count(1728, 0.0) == 0 and outlier_count(1, 0.01) == 0


@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_kvquant_bytes_are_the_stored_tensors_bytes(kind, bits):
    x = torch.randn(3, N, D, generator=torch.Generator().manual_seed(1))
    enc = KVQuant(bits=bits, outliers=0.01).encode(x, kind, SpanContext())
    parts = {**enc.components(), **enc.shared()}
    assert enc.nbytes() == sum(t.numel() * t.element_size() for t in parts.values())
    rows, length = (D, N) if kind == "k" else (N, D)
    k = outlier_count(length, 0.01)
    per_stream = N * D * bits // 8 + 2 * 2 ** bits + 2 * 2 * rows + rows * 2 * k * (2 + 2)  # codes, codebook,
    assert enc.nbytes() == 3 * per_stream  # centres and ranges, outliers' fp16 values and int16 positions
    assert enc.shape == x.shape and enc.decode().dtype == torch.float32


def test_kvquant_worked_example_bits():
    """The module's worked example: 2 bits, 1%, a 1728-token span of head dim 128."""
    x = torch.randn(1, N, D, generator=torch.Generator().manual_seed(2))
    k_bits = 8 * KVQuant().encode(x, "k", SpanContext()).nbytes() / x.numel()
    v_bits = 8 * KVQuant().encode(x, "v", SpanContext()).nbytes() / x.numel()
    assert k_bits == pytest.approx(2.352, abs=5e-4) and v_bits == pytest.approx(2.750, abs=5e-4)


def _promised(options: dict, kind: str) -> float:
    """Bits per element a (N, D) span stores under a candidate: codes, then every side tensor (see the module)."""
    b, f = options["bits"], options["outliers"]
    rows, length = (D, N) if kind == "k" else (N, D)
    return b + (16 * 2 ** b + 32 * rows + 32 * rows * 2 * outlier_count(length, f)) / (N * D)


@pytest.mark.parametrize("kind", ["k", "v"])
def test_kvquant_budget_candidates_measure_what_they_promise(kind):
    rule = KVQuant.budget_candidates(D, kind)
    assert [c["bits"] for c in rule] == [4, 4, 3, 3, 2, 2] and rule[0]["outliers"] == 0.01
    measured = [budget.measured_bits("kvquant", tuple(sorted(c.items())), D, N, kind) for c in rule]
    assert measured == sorted(measured, reverse=True)  # richest first
    for c, bits in zip(rule, measured):
        assert bits == pytest.approx(_promised(c, kind), abs=1e-9), c


def test_kvquant_configure_at_2_5_bits():
    """The budget's dispatch reads the class's rule (issue 44 part 5): 2 bits with 1% outliers for Keys (2.352);
    Values' per-token outliers (two of 128 channels, 0.5 bits) do not fit, so their dense 2 bits (2.25)."""
    assert budget.candidates("kvquant", D, "k") == KVQuant.budget_candidates(D, "k")
    opts, bits = budget.configure("kvquant", 2.5, D, N, "k")
    assert opts == {"bits": 2, "outliers": 0.01} and bits == pytest.approx(2.352, abs=5e-4)
    opts, bits = budget.configure("kvquant", 2.5, D, N, "v")
    assert opts == {"bits": 2, "outliers": 0.0} and bits == pytest.approx(2.25, abs=5e-4)


def test_kvquant_sensitivity_weights_the_keys_codebook_by_s_diagonal():
    """With S loud on a few channels, the S_jj-weighted codebook lowers Σ_j S_jj Σ_t (u_tj − û_tj)², the error of
    the normalised values u = (x − centre_j) / range_j: the objective the release's Fisher-weighted k-means takes."""
    g = torch.Generator().manual_seed(3)
    u = torch.rand(2, 256, 32, generator=g) - 0.5
    x = -u.sign() * torch.log1p(-2 * u.abs())  # Laplace, heavy-tailed channels ...
    x[..., :4] = torch.rand(2, 256, 4, generator=g) * 2 - 1  # ... and four uniform ones, the loud ones in S
    diag = torch.ones(32)
    diag[:4] = 100.0
    ctx = SpanContext(stats=torch.diag(diag).expand(2, 32, 32), history=10)
    half_range = (x.amax(1, keepdim=True) - x.amin(1, keepdim=True)) / 2  # per stream and channel, no outliers

    def weighted_error(sensitivity):
        e = KVQuant(bits=2, outliers=0.0, qnorm=False, sensitivity=sensitivity).encode(x, "k", ctx).decode() - x
        return float(((e / half_range).square() * diag).sum())

    assert weighted_error(True) < 0.9 * weighted_error(False)
    assert KVQuant().uses_queries and not KVQuant(sensitivity=False).uses_queries


def test_kvquant_q_norm_defaults_to_2_bits_and_keeps_the_spread():
    assert KVQuant(bits=2).q_norm and not KVQuant(bits=3).q_norm and KVQuant(bits=3, qnorm=True).q_norm
    x = _span(s=1, n=512, d=16, seed=4)
    on, off = (KVQuant(bits=2, outliers=0.0, qnorm=q).encode(x, "v", SpanContext()).decode() for q in (True, False))
    rows = x - x.mean(-1, keepdim=True)
    spread = [float((t - t.mean(-1, keepdim=True)).square().mean() / rows.square().mean()) for t in (on, off)]
    assert abs(spread[0] - 1) < abs(spread[1] - 1)  # Q-Norm restores the variance k-means levels shrink


def test_kvquant_is_pre_rope_and_runs_in_a_pre_rope_cache():
    B, H, n, d = 1, 2, 64, 24
    g = torch.Generator().manual_seed(5)
    rope = Rope3D(d, (8, 8))
    outs = {}
    for method in ("bf16", "kvquant"):
        cache = KVCache(CacheConfig(method, rope="pre", sink_chunks=1, recent_chunks=1), 1, rope=rope)
        g.manual_seed(5)
        for i in range(4):
            q, k, v = (torch.randn(B, H, n, d, generator=g) for _ in range(3))
            out = cache.attend(0, q, k, v, chunk=i, commit=True)
        outs[method] = out
        if method == "kvquant":
            assert any(c.quantized for c in cache.inspect(0)) and cache.uses_queries
    assert torch.isfinite(outs["kvquant"]).all() and _rel(outs["kvquant"], outs["bf16"]) < 0.3
    assert get_method("kvquant").pre_rope
    with pytest.raises(ValueError, match="rope='pre'"):
        KVCache(CacheConfig("kvquant"), 1)


@pytest.mark.parametrize("options, match", [({"bits": 8}, "allowed: 2, 3, 4"), ({"bits": 1}, "allowed"),
                                            ({"outliers": 0.6}, r"\[0, 0.5\)"), ({"outliers": -0.1}, "outliers"),
                                            ({"qnorm": "yes"}, "qnorm"), ({"iters": 0}, "iters"),
                                            ({"sensitivity": 1}, "sensitivity")])
def test_kvquant_rejects_bad_options(options, match):
    with pytest.raises(ValueError, match=match):
        KVQuant(**options)


def test_kvquant_rejects_bad_spans():
    m = KVQuant()
    x = _span()
    bad = x.clone()
    bad[0, 3, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        m.encode(bad, "k", SpanContext())
    with pytest.raises(ValueError, match=r"\(S, N, D\)"):
        m.encode(x[0], "k", SpanContext())
    with pytest.raises(ValueError, match="kind"):
        m.encode(x, "q", SpanContext())
    with pytest.raises(ValueError, match="query statistics"):
        m.encode(x, "k", SpanContext(stats=torch.eye(8).expand(2, 8, 8), history=1))


def test_kvquant_codes_tiny_and_constant_spans():
    """One token, two tokens, a constant span: every row keeps one coded element; nothing is NaN."""
    for x in (torch.randn(2, 1, 8), torch.randn(2, 2, 8), torch.full((1, 5, 8), 3.0)):
        for kind in "kv":
            out = KVQuant(bits=3).encode(x, kind, SpanContext()).decode()
            assert out.shape == x.shape and torch.isfinite(out).all()
    assert torch.equal(KVQuant().encode(torch.full((1, 5, 8), 3.0), "k", SpanContext()).decode(),
                       torch.full((1, 5, 8), 3.0))
