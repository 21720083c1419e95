"""The Queries' basis (quantwm/core/query_basis.py) and the allocator's Keys coded in it (InBasis)."""
import torch

from quantwm.core.cache import CacheConfig, KVCache
from quantwm.core.layouts import InBasis
from quantwm.core.methods import get_method
from quantwm.core.methods.base import SpanContext
from quantwm.core.psac import principal_basis
from quantwm.core.query_basis import basis_bytes, basis_matrix, captured, coordinate_weights, gaussian_price, make_reflectors


def _stats(streams=3, D=64, rank=8, seed=0):
    """A second moment whose energy lies in a random (not channel-aligned) rank-`rank` subspace, plus a floor."""
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(streams, D, rank, generator=g) * 4
    return A @ A.transpose(1, 2) + 0.05 * torch.eye(D)


def test_stored_basis_is_orthogonal_and_spans_the_top_directions():
    S = _stats()
    refl, scales = make_reflectors(S, 8)
    assert refl.dtype == torch.int8 and scales.dtype == torch.float16 and refl.shape == (3, 8, 64)
    U = basis_matrix(refl, scales)
    assert torch.allclose(U.transpose(1, 2) @ U, torch.eye(64).expand(3, 64, 64), atol=1e-5)
    V = principal_basis(S, 8)
    overlap = (U[..., :8].transpose(1, 2) @ V).square().sum((1, 2)) / 8
    assert bool((overlap > 0.999).all())
    assert bool((captured(U, S, 8) > 0.999).all())
    lam = coordinate_weights(U, S)
    assert float(lam[:, :8].sum() / lam.sum()) > 0.98  # the energy sits on the first coordinates
    assert basis_matrix(refl, scales) is U  # one fp32 copy per stored basis
    assert refl.numel() + 2 * scales.numel() == 3 * basis_bytes(8, 64)


def test_a_stale_basis_captures_less():
    U = basis_matrix(*make_reflectors(_stats(seed=0), 8))
    assert bool((captured(U, _stats(seed=1), 8) < 0.5).all())


def _span(streams=4, N=256, D=64, seed=0):
    return torch.randn(streams, N, D, generator=torch.Generator().manual_seed(seed))


def test_allocator_codes_keys_in_the_basis_within_budget_and_beats_channels_on_rotated_queries():
    S = _stats(streams=4, D=64, rank=8)
    # keys whose content lies along the queries' (rotated) directions, plus detail
    g = torch.Generator().manual_seed(1)
    V = principal_basis(S, 8)
    x = torch.randn(4, 512, 8, generator=g) @ V.transpose(1, 2) * 3 + 0.5 * torch.randn(4, 512, 64, generator=g)
    q = torch.randn(4, 64, 8, generator=g) @ V.transpose(1, 2)  # test queries in the same subspace

    def logit_err(method, state):
        enc = method.encode(x, "k", SpanContext(stats=S, history=100, state=state))
        return enc, float(((q @ (enc.decode() - x).transpose(1, 2)).square()).mean())

    state = {}
    rotated, e_rot = logit_err(get_method("quantwm-alloc", budget=2.5), state)
    plain, e_plain = logit_err(get_method("quantwm-alloc", budget=2.5, query_basis=False), {})
    assert isinstance(rotated, InBasis) and not isinstance(plain, InBasis)
    assert e_rot < 0.5 * e_plain
    stored = 8 * sum(t.numel() * t.element_size() for t in {**rotated.components(), **rotated.shared()}.values())
    assert stored <= 2.5 * x.numel()  # the span that stores the basis pays for it within its budget
    assert rotated.reflectors.shape[0::2] == (4, 64) and rotated.reflectors.shape[1] in (16, 38)  # 38: 25% of 2.5 bits
    # a second span reuses the stored basis (the same objects: counted once) and spends all its bits on codes
    again = get_method("quantwm-alloc", budget=2.5).encode(x, "k", SpanContext(stats=S, history=100, state=state))
    assert again.reflectors is rotated.reflectors
    assert float((again.decode() - x).square().mean()) < float((rotated.decode() - x).square().mean())


def test_a_short_span_affords_fewer_directions():
    S = _stats(streams=2, D=64)
    enc = get_method("quantwm-alloc", budget=2.5).encode(_span(2, 128, 64), "k", SpanContext(stats=S, history=10))
    assert isinstance(enc, InBasis) and enc.reflectors.shape[1] == int(0.25 * 2.5 * 128 * 64 // (8 * 66))


def test_no_history_and_values_stay_in_the_channels():
    x = _span()
    m = get_method("quantwm-alloc", budget=2.5)
    assert not isinstance(m.encode(x, "k", SpanContext()), InBasis)
    assert not isinstance(m.encode(x, "v", SpanContext(stats=_stats(4), history=10)), InBasis)


def test_fused_attention_reads_the_coded_coordinates_as_the_reference_does(monkeypatch):
    torch.manual_seed(0)
    B, H, D, N = 1, 2, 64, 64
    cfg = CacheConfig(method="quantwm", budget=2.5, sink_chunks=0, recent_chunks=0, track_queries=True)
    cache = KVCache(cfg, 1)
    A = torch.randn(H, D, 8)
    for chunk in range(4):
        q = (torch.randn(B, H, N, 8) @ A.transpose(1, 2)) * 0.3
        k = torch.randn(B, H, N, 8) @ A.transpose(1, 2) * 0.3 + 0.2 * torch.randn(B, H, N, D)
        v = torch.randn(B, H, N, D)
        cache.attend(0, q, k, v, chunk=chunk, commit=True)
    assert any(isinstance(c.k_enc, InBasis) for c in cache.spans(0) if c.k_enc is not None)
    memory = cache.memory()  # the stored basis is counted once, with the spans; its fp32 copy as a kernel view
    assert memory.runtime_bytes["method_state"] >= 0 and memory.runtime_bytes["kernel_views"] >= 4 * H * D * D
    from quantwm.core.attention import fused_attention
    q = torch.randn(B, H, N, D)
    K, V = cache.keys(0), cache.values(0)
    ref = torch.softmax(q @ K.transpose(-1, -2) * D ** -0.5, -1) @ V
    assert torch.allclose(fused_attention(cache, 0, q, D ** -0.5, use_kernel=False), ref, atol=1e-4)
    monkeypatch.setenv("QUANTWM_KERNELS", "triton")  # the Triton kernel (interpreted here) reads the inner side
    assert torch.allclose(fused_attention(cache, 0, q, D ** -0.5, use_kernel=True), ref, atol=1e-4)


def test_a_rolling_window_keeps_the_cache_within_its_budget():
    """Under a window the span that paid for a basis is evicted while later spans still use it: each of them pays
    1/window of it, so the stored bits stay within the budget however long the rollout."""
    torch.manual_seed(1)
    B, H, D, N = 1, 2, 64, 128
    cfg = CacheConfig(method="quantwm", budget=2.5, sink_chunks=1, recent_chunks=1, max_chunks=6, track_queries=True)
    cache = KVCache(cfg, 1)
    A = torch.randn(H, D, 8)
    worst, rotated = 0.0, 0
    for chunk in range(14):
        q = (torch.randn(B, H, N, 8) @ A.transpose(1, 2)) * 0.3
        k = torch.randn(B, H, N, 8) @ A.transpose(1, 2) * 0.3 + 0.2 * torch.randn(B, H, N, D)
        cache.attend(0, q, k, torch.randn(B, H, N, D), chunk=chunk, commit=True)
        rotated += sum(isinstance(c.k_enc, InBasis) for c in cache.spans(0))
        bits = cache.memory().bits_per_element
        worst = max(worst, 0.0 if bits != bits else bits)
    assert rotated > 0 and worst <= 2.5 + 1e-9


def test_the_gaussian_price_is_reverse_water_filling():
    """Equal variances: D = N n σ² 2^(-2R/n) (R bits a token over n coordinates); a coordinate of no weight gets no bits."""
    y = torch.randn(1, 4096, 8, generator=torch.Generator().manual_seed(0))
    var = float(y.var(1).mean())
    got = gaussian_price(torch.ones(1, 8), y.var(1), 4096, bits=2.0 * 4096 * 8)
    assert abs(got / (4096 * 8 * var * 2 ** -4) - 1) < 0.05
    w = torch.tensor([[1.0] * 4 + [0.0] * 4])
    assert gaussian_price(w, y.var(1), 4096, bits=2.0 * 4096 * 8) < got  # the bits go where the weight is


def test_bf16_keys_commit_through_the_tensor_core_kernels_as_through_the_reference(monkeypatch):
    """BF16 keys in the Queries' basis take kernels/key_rotate.py and kernels/key_covariance_sums.py when the kernels run
    (their stored tables kernels/storage_check.py where checks are deferred): the same basis decisions and the same
    decoded keys as the reference path, to FP32 rounding (then BF16's)."""
    from quantwm.core import query_basis
    from quantwm.core.backend import kernel

    torch.manual_seed(3)
    B, H, D, N = 1, 2, 64, 96
    A = torch.randn(H, D, 8)
    chunks = [(torch.randn(B, H, N, 8) @ A.transpose(1, 2), (torch.randn(B, H, N, D) * 2 + 1).bfloat16(),
               torch.randn(B, H, N, D).bfloat16()) for _ in range(4)]
    called = []
    decoded = {}
    for mode in ("ref", "triton"):
        monkeypatch.setenv("QUANTWM_KERNELS", mode)
        if mode == "triton":  # the kernels are reached through the cache
            for name in ("key_rotate", "key_covariance_sums"):
                real = kernel(name)
                monkeypatch.setattr(f"quantwm.kernels.{name}.{name}",
                                    lambda *a, _f=real, _n=name, **k: called.append(_n) or _f(*a, **k))
        cache = KVCache(CacheConfig("quantwm", budget=2.5, target="k", sink_chunks=0, recent_chunks=0), 1)
        for i, (q, k, v) in enumerate(chunks):
            cache.attend(0, q.bfloat16(), k, v, chunk=i, commit=True)
        decoded[mode] = (cache.keys(0).float(), [s.k_enc.describe() for s in cache.inspect(0)
                                                 if s.k_enc is not None and s.k_enc.quantized])
    assert {"key_rotate", "key_covariance_sums"} <= set(called) and query_basis.rotated.__name__ == "rotated"
    (ref, kinds), (fast, kinds_fast) = decoded["ref"], decoded["triton"]
    assert kinds == kinds_fast and any("basis" in k for k in kinds), kinds
    torch.testing.assert_close(fast, ref, rtol=0, atol=2e-3)  # FP32 rounding apart, then rounded to BF16 (0.0009 here)
    exact = torch.cat([k for _, k, _ in chunks], 2).float()
    err = [(x - exact).square().mean() for x in (ref, fast)]
    assert abs(err[0] - err[1]) < 1e-3 * err[0]
