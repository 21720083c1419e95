"""Loud tokens held apart in BF16 (quantwm/core/layouts/split.py TokenSplit, the allocator's `loud` option)."""
import pytest
import torch

from quantwm.core.attention import fused_attention
from quantwm.core.cache import CacheConfig, KVCache
from quantwm.core.layouts import TokenSplit
from quantwm.core.methods import get_method
from quantwm.core.methods.base import SpanContext


def _loud_span(streams=4, N=512, D=64, n_loud=5, gain=12.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(streams, N, D, generator=g)
    where = torch.randperm(N, generator=g)[:n_loud]
    x[:, where] *= gain
    return x, where.sort().values


def _bits(layout, x):
    return 8 * layout.nbytes() / x.numel()


def test_loud_keys_are_held_in_bf16_within_the_budget_and_the_others_gain():
    x, where = _loud_span()
    split = get_method("quantwm-alloc", budget=2.5).encode(x, "k", SpanContext())
    plain = get_method("quantwm-alloc", budget=2.5, loud=0).encode(x, "k", SpanContext())
    assert isinstance(split, TokenSplit) and not isinstance(plain, TokenSplit)
    assert torch.equal(split.index.long(), where)
    assert split.index.dtype == torch.int16 and split.loud.dtype == torch.bfloat16
    out = split.decode()
    assert torch.allclose(out[:, where], x[:, where], rtol=1e-2)  # BF16
    assert _bits(split, x) <= 2.5 + 1e-9 and _bits(plain, x) <= 2.5 + 1e-9
    others = torch.ones(x.shape[1], dtype=torch.bool)
    others[where] = False
    err = lambda enc: float((enc.decode() - x)[:, others].square().mean())  # noqa: E731
    assert err(split) < 0.5 * err(plain)  # the loud tokens no longer stretch every channel's grid
    assert split.step()[:, where].abs().max() == 0 and split.channel_bits().shape == (4, 64)


def test_a_span_without_loud_tokens_is_not_split_and_the_share_caps_them():
    x = torch.randn(4, 512, 64, generator=torch.Generator().manual_seed(1))
    assert not isinstance(get_method("quantwm-alloc", budget=2.5).encode(x, "k", SpanContext()), TokenSplit)
    y, _ = _loud_span(n_loud=40)  # 8% of the tokens: only the loudest 2% are held
    enc = get_method("quantwm-alloc", budget=2.5).encode(y, "k", SpanContext())
    assert isinstance(enc, TokenSplit) and len(enc.index) == int(0.02 * 512)


def test_bad_loud_options_are_refused():
    with pytest.raises(ValueError, match="loud"):
        get_method("quantwm-alloc", budget=2.5, loud=0.5)
    with pytest.raises(ValueError, match="loud_share"):
        get_method("quantwm-alloc", budget=2.5, loud_share=1.5)


def _cache_with_loud_tokens(target):
    torch.manual_seed(0)
    B, H, D, N = 1, 2, 64, 128
    cfg = CacheConfig(method="quantwm", budget=2.5, target=target, sink_chunks=0, recent_chunks=0,
                      track_queries=True)
    cache = KVCache(cfg, 1)
    for chunk in range(3):
        k = torch.randn(B, H, N, D)
        k[:, :, [3, 77]] *= 10
        cache.attend(0, 0.3 * torch.randn(B, H, N, D), k, torch.randn(B, H, N, D), chunk=chunk, commit=True)
    return cache, (B, H, D, N)


@pytest.mark.parametrize("target", ["kv", "k"])
def test_attention_reads_the_loud_tokens_as_a_bf16_span_like_the_reference(monkeypatch, target):
    cache, (B, H, D, N) = _cache_with_loud_tokens(target)
    spans = [c for c in cache.spans(0) if c.k_enc is not None]
    assert spans and all(isinstance(c.k_enc, TokenSplit) for c in spans)
    if target == "kv":  # the Values are split at the Keys' tokens, and the cache stays within its budget
        assert all(torch.equal(c.v_enc.index, c.k_enc.index) for c in spans)
        assert cache.memory().span_bits_per_element <= 2.5 + 1e-9
    q = torch.randn(B, H, N, D)
    K, V = cache.keys(0), cache.values(0)
    ref = torch.softmax(q @ K.transpose(-1, -2) * D ** -0.5, -1) @ V
    assert torch.allclose(fused_attention(cache, 0, q, D ** -0.5, use_kernel=False), ref, atol=1e-4)
    monkeypatch.setenv("QUANTWM_KERNELS", "triton")  # the Triton kernel (interpreted here) reads both parts
    assert torch.allclose(fused_attention(cache, 0, q, D ** -0.5, use_kernel=True), ref, atol=1e-4)
