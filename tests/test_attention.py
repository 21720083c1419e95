"""The fused attention driver (quantwm/attention.py) inside the cache: same output as the reference path."""
from __future__ import annotations

import pytest
import torch

from quantwm.core import backend
from quantwm.core.attention import chunk_spans, fused_attention
from quantwm.core.cache import CacheConfig, KVCache
from quantwm.core.rope import Rope3D

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: kernels under the interpreter


def _filled(method: str, target: str = "kv", n: int = 97, chunks: int = 4, rope=None, device="cpu"):
    """A one-layer cache after `chunks` committed chunks, and the next chunk's q, k, v."""
    g = torch.Generator().manual_seed(1)
    cache = KVCache(CacheConfig(method, target=target, rope="pre" if rope else "post"), 1, rope=rope)
    for i in range(chunks):
        q, k, v = (torch.randn(1, 2, n, 64, generator=g).to(device) for _ in range(3))
        cache.attend(0, q, k, v, chunk=i, commit=True)
    return cache, [torch.randn(1, 2, n, 64, generator=g).to(device) for _ in range(3)]


@pytest.mark.parametrize("method", ["bf16", "rtn", "kivi", "qvg", "quantwm", "quantwm-qsac", "quantwm+jensen"])
@pytest.mark.parametrize("target", ["k", "v", "kv"])
def test_fused_attention_twin_equals_cache_reference_path(method, target, monkeypatch):
    monkeypatch.setenv("QUANTWM_KERNELS", "ref")
    cache, (q, k, v) = _filled(method, target)
    cache.write(0, k, v, 4)
    fused = fused_attention(cache, 0, q, 0.125, use_kernel=False)
    ref = cache.attend(0, q, k, v, chunk=4, scale=0.125)
    torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["rtn", "quantwm+jensen"])
def test_cache_attend_uses_the_kernel_when_forced_and_agrees(method, monkeypatch):
    outs = {}
    for mode in ("ref", "triton"):
        monkeypatch.setenv("QUANTWM_KERNELS", mode)
        cache, (q, k, v) = _filled(method, chunks=3, device=DEVICE)
        outs[mode] = cache.attend(0, q, k, v, chunk=3, scale=0.125).cpu()
    tol = 1e-5 if DEVICE.type == "cpu" else 2e-3  # fp32 inputs; on CUDA the same kernel may use TF32-free IEEE dots
    torch.testing.assert_close(outs["triton"], outs["ref"], rtol=tol, atol=tol)


@pytest.mark.parametrize("lowp", [None, "int8"])
def test_causal_chunk_shapes_sink_recent_and_current_spans_in_both_paths(lowp, monkeypatch):
    """A chunk's queries over cache + chunk at unequal lengths: chunks of 70, 97 and 33 tokens (sink, quantized,
    recent), then a current chunk of 50; the kernel against its twin, each with and without the 8-bit path."""
    outs = {}
    for mode in ("ref", "triton"):
        monkeypatch.setenv("QUANTWM_KERNELS", mode)
        g = torch.Generator().manual_seed(4)
        cache = KVCache(CacheConfig("quantwm", lowp=lowp), 1)
        for i, n in enumerate((70, 97, 33, 50)):
            q, k, v = (torch.randn(1, 2, n, 64, generator=g).to(DEVICE) for _ in range(3))
            outs[mode] = cache.attend(0, q, k, v, chunk=i, scale=0.125, commit=i < 3).cpu()
        spans = [(s.n_tokens, s.quantized) for s in cache.inspect(0)]  # BF16 sink, 2-bit chunk, BF16 recent, current
        assert spans == [(70, False), (97, True), (33, False), (50, False)]
    if lowp is None:
        torch.testing.assert_close(outs["triton"], outs["ref"], rtol=1e-5, atol=1e-5)
    else:  # the kernel splits spans (its running maxima round P apart); the twin folds each span in one split
        assert ((outs["triton"] - outs["ref"]).norm() / outs["ref"].norm()) < 0.03  # e4m3 P: 3 mantissa bits
        monkeypatch.setenv("QUANTWM_KERNELS", "ref")
        exact = KVCache(CacheConfig("quantwm"), 1)
        g = torch.Generator().manual_seed(4)
        for i, n in enumerate((70, 97, 33, 50)):
            q, k, v = (torch.randn(1, 2, n, 64, generator=g) for _ in range(3))
            out = exact.attend(0, q, k, v, chunk=i, scale=0.125, commit=i < 3)
        assert 0 < ((outs["ref"] - out).norm() / out.norm()) < 0.05


def test_lowp_config_is_checked():
    with pytest.raises(ValueError, match="lowp must be one of"):
        CacheConfig("quantwm", lowp="fp8")
    with pytest.raises(ValueError, match="post-RoPE"):
        CacheConfig("quantwm", lowp="int8", rope="pre")


def test_unsupported_spans_fall_back_to_the_reference_path(monkeypatch):
    monkeypatch.setenv("QUANTWM_KERNELS", "ref")
    cache, _ = _filled("qvg-pro", chunks=3)
    assert chunk_spans(cache, 0) is None  # 4 codebook stages: no fused kernel
    rope = Rope3D(64, (8, 8))
    pre, (q, k, v) = _filled("rtn", chunks=3, n=64, rope=rope)
    monkeypatch.setenv("QUANTWM_KERNELS", "triton")
    out = pre.attend(0, q, k, v, chunk=3)  # pre-RoPE: reference path even when kernels are forced
    monkeypatch.setenv("QUANTWM_KERNELS", "ref")
    pre2, (q2, k2, v2) = _filled("rtn", chunks=3, n=64, rope=rope)
    torch.testing.assert_close(out, pre2.attend(0, q2, k2, v2, chunk=3))


def test_backend_mode_rejects_unknown_values(monkeypatch):
    monkeypatch.setenv("QUANTWM_KERNELS", "fast")
    with pytest.raises(ValueError, match="QUANTWM_KERNELS must be one of auto, ref, triton"):
        backend.mode()
    monkeypatch.setenv("QUANTWM_KERNELS", "auto")
    assert backend.use_kernels(torch.zeros(1)) is False  # CPU tensors take the references


@pytest.mark.parametrize("method, options, D, N, fused", [
    ("rtn", (("group_size", 24),), 48, 33, False),  # per-token groups of 24: not a power of two
    ("rtn", (("group_size", 16),), 48, 33, True),
    ("quantwm-paper", (), 64, 33, False),  # per-token PSAC coefficient scales
    ("qvg-pro", (("n_centroids", 16),), 64, 97, False),  # 4 codebook stages (16 centroids each: a quick k-means)
])
def test_dispatch_asks_the_method_and_falls_back_instead_of_raising(method, options, D, N, fused, monkeypatch):
    """A format the kernel cannot take takes the reference path, even with the kernels forced (it used to
    raise in the launcher); the dispatcher asks `Method.fused_format` and nothing else."""
    def run(mode):
        monkeypatch.setenv("QUANTWM_KERNELS", mode)
        cache = KVCache(CacheConfig(method, method_options=options), 1)
        g = torch.Generator().manual_seed(2)
        for i in range(4):  # chunks of N tokens (33: a tile of 32 and one more)
            cache.attend(0, *(torch.randn(1, 2, N, D, generator=g) for _ in range(3)), chunk=i, commit=True)
        q, k, v = (torch.randn(1, 2, N, D, generator=g) for _ in range(3))
        return cache, cache.attend(0, q, k, v, chunk=4)
    cache, out = run("triton")
    _, ref = run("ref")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert (chunk_spans(cache, 0) is not None) == fused
