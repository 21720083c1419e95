"""Tests for quantwm.core.cache: the chunked, quantized KV cache (contract in the module docstring, docs/method.md §2.4)."""
import math

import pytest
import torch
import torch.nn.functional as F

from quantwm.core.cache import CacheConfig, KVCache
from quantwm.core.rope import Rope3D

B, H, N, D = 1, 2, 16, 64


def _t(seed: int, *shape, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _kv(chunk: int, layer: int = 0, dtype=torch.float32, b=B, h=H, n=N, salt=0):
    """Deterministic (q, k, v) of one chunk in BHLD layout."""
    s = 1000 * layer + 10 * chunk + 100000 * salt
    return _t(s + 1, b, h, n, D, dtype=dtype), _t(s + 2, b, h, n, D, dtype=dtype), _t(s + 3, b, h, n, D, dtype=dtype)


def _fill(cache: KVCache, n_chunks: int, layer: int = 0, dtype=torch.float32, n=N, b=B, h=H):
    """write + commit n_chunks chunks (no queries); returns the written (k, v) per chunk."""
    out = []
    for i in range(n_chunks):
        _, k, v = _kv(i, layer, dtype, b=b, h=h, n=n)
        cache.write(layer, k, v, chunk=i)
        cache.commit(layer, i)
        out.append((k, v))
    return out


def _chunk_slice(i: int, n=N) -> slice:
    return slice(i * n, (i + 1) * n)


def _second(q: torch.Tensor) -> torch.Tensor:
    """Mean of q qᵀ over batch and tokens per head: (B, H, N, D) -> (H, D, D) float64."""
    qd = q.double()
    return torch.einsum("bhnd,bhne->hde", qd, qd) / (q.shape[0] * q.shape[2])


class _Spy:
    """Wraps a method and records every encode call (kind, input, ctx.stats)."""

    def __init__(self, inner, log):
        self.inner, self.log = inner, log

    def encode(self, x, kind, ctx):
        self.log.append((kind, x.clone(), None if ctx.stats is None else ctx.stats.clone()))
        return self.inner.encode(x, kind, ctx)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _spy(cache: KVCache, monkeypatch) -> list:
    log = []
    monkeypatch.setattr(cache, "k_method", _Spy(cache.k_method, log))
    monkeypatch.setattr(cache, "v_method", _Spy(cache.v_method, log))
    return log


# ---- writing and committing -------------------------------------------------------------------------

def test_cache_overwrite_then_commit_keeps_only_last_write():
    cache = KVCache(CacheConfig(), n_layers=1)
    q, k1, v1 = _kv(0)
    _, k2, v2 = _kv(0, salt=1)
    cache.attend(0, q, k1, v1, chunk=0)  # denoising pass
    cache.attend(0, q, k2, v2, chunk=0, commit=True)  # clean pass
    assert cache.positions(0).tolist() == list(range(N))
    assert torch.equal(cache.keys(0), k2)
    assert torch.equal(cache.values(0), v2)


def test_cache_write_twice_replaces_current_chunk():
    cache = KVCache(CacheConfig(), n_layers=1)
    _fill(cache, 1)
    _, k1, v1 = _kv(1)
    _, k2, v2 = _kv(1, salt=1)
    cache.write(0, k1, v1, chunk=1)
    cache.write(0, k2, v2, chunk=1)
    assert cache.keys(0).shape == (B, H, 2 * N, D)
    assert torch.equal(cache.keys(0)[:, :, _chunk_slice(1)], k2)
    assert torch.equal(cache.values(0)[:, :, _chunk_slice(1)], v2)


def test_cache_attend_commit_true_commits_and_plain_attend_does_not():
    cache = KVCache(CacheConfig(), n_layers=1)
    q, k, v = _kv(0)
    cache.attend(0, q, k, v, chunk=0)
    with pytest.raises(ValueError, match="skips ahead"):  # chunk 0 was not committed
        cache.write(0, k, v, chunk=1)
    cache.attend(0, q, k, v, chunk=0, commit=True)
    with pytest.raises(ValueError, match="already committed"):
        cache.write(0, k, v, chunk=0)
    cache.attend(0, *_kv(1), chunk=1)  # the next chunk is accepted
    assert cache.positions(0).tolist() == list(range(2 * N))


def test_cache_write_already_committed_chunk_raises():
    cache = KVCache(CacheConfig(), n_layers=1)
    _fill(cache, 3)
    _, k, v = _kv(0)
    for i in (0, 1, 2):
        with pytest.raises(ValueError, match=f"chunk {i} of layer 0 is already committed"):
            cache.write(0, k, v, chunk=i)
    assert cache.positions(0).numel() == 3 * N  # nothing was changed


def test_cache_write_skipping_ahead_raises():
    cache = KVCache(CacheConfig(), n_layers=1)
    _, k, v = _kv(0)
    with pytest.raises(ValueError, match="chunk 1 skips ahead: layer 0 expects chunk 0"):
        cache.write(0, k, v, chunk=1)
    _fill(cache, 2)
    with pytest.raises(ValueError, match="expects chunk 2"):
        cache.write(0, k, v, chunk=4)


def test_cache_commit_unwritten_chunk_raises():
    cache = KVCache(CacheConfig(), n_layers=1)
    with pytest.raises(ValueError, match="no chunk 0 written"):
        cache.commit(0, 0)
    _, k, v = _kv(0)
    cache.write(0, k, v, chunk=0)
    with pytest.raises(ValueError, match="no chunk 1 written"):
        cache.commit(0, 1)
    cache.commit(0, 0)
    with pytest.raises(ValueError, match="no chunk 0 written"):  # a second commit of the same chunk
        cache.commit(0, 0)


def test_cache_layers_are_independent():
    cache = KVCache(CacheConfig(), n_layers=2)
    _fill(cache, 2, layer=0)
    assert cache.positions(1).numel() == 0
    _, k, v = _kv(0, layer=1)
    cache.write(1, k, v, chunk=0)  # layer 1 still expects chunk 0
    assert torch.equal(cache.keys(1), k)
    assert cache.positions(0).numel() == 2 * N


# ---- what stays in full precision -------------------------------------------------------------------

def test_cache_commit_keeps_sink_and_recent_bf16_rtn():
    cache = KVCache(CacheConfig(method="rtn"), n_layers=1)
    written = _fill(cache, 4, dtype=torch.bfloat16)
    _, k4, v4 = _kv(4, dtype=torch.bfloat16)
    cache.write(0, k4, v4, chunk=4)  # the chunk being generated
    written.append((k4, v4))
    K, V = cache.keys(0), cache.values(0)
    assert K.dtype == torch.float32 and K.shape == (B, H, 5 * N, D)
    for i, (k, v) in enumerate(written):
        exact = torch.equal(K[:, :, _chunk_slice(i)], k.float()) and torch.equal(V[:, :, _chunk_slice(i)], v.float())
        assert exact == (i in (0, 3, 4)), f"chunk {i}: exact={exact}"
    for i in (1, 2):  # quantized, but close: 2-bit per-token groups of 64
        err = (K[:, :, _chunk_slice(i)] - written[i][0].float()).abs()
        rng = written[i][0].float().amax(-1, keepdim=True) - written[i][0].float().amin(-1, keepdim=True)
        assert (err <= rng / 6 * 1.01 + 1e-3).all()
    # full-precision chunks stay in the dtype they were written in
    st = cache.layers[0]
    for c in st.chunks + [st.current]:
        if c.index in (0, 3, 4):
            assert c.k.dtype == torch.bfloat16 and c.v.dtype == torch.bfloat16 and not c.quantized
        else:
            assert c.k is None and c.v is None and c.quantized
    assert cache.bytes_by_component()["k.full"] == 3 * B * H * N * D * 2


@pytest.mark.parametrize("sink,recent", [(0, 0), (0, 2), (2, 0), (2, 1), (1, 3)])
def test_cache_sink_and_recent_chunks_configurable(sink, recent):
    cache = KVCache(CacheConfig(method="rtn", sink_chunks=sink, recent_chunks=recent), n_layers=1)
    n_chunks = 5
    written = _fill(cache, n_chunks)
    _, kc, vc = _kv(n_chunks)
    cache.write(0, kc, vc, chunk=n_chunks)
    written.append((kc, vc))
    K = cache.keys(0)
    expected_exact = set(range(sink)) | set(range(n_chunks - recent, n_chunks)) | {n_chunks}
    got_exact = {i for i, (k, _) in enumerate(written) if torch.equal(K[:, :, _chunk_slice(i)], k)}
    assert got_exact == expected_exact


def test_cache_bf16_method_never_quantizes():
    cache = KVCache(CacheConfig(method="bf16", recent_chunks=0, sink_chunks=0), n_layers=1)
    written = _fill(cache, 4)
    assert torch.equal(cache.keys(0), torch.cat([k for k, _ in written], 2))
    assert math.isnan(cache.bits_per_element())


# ---- quantized exactly once -------------------------------------------------------------------------

def test_cache_quantizes_each_chunk_exactly_once(monkeypatch):
    n_layers, n_chunks = 2, 7
    cache = KVCache(CacheConfig(method="rtn"), n_layers=n_layers)
    log = _spy(cache, monkeypatch)
    committed = {}
    decoded_after_commit = {}
    for i in range(n_chunks):
        for layer in range(n_layers):
            for p in range(3):  # two denoising passes, then the clean pass that commits
                q, k, v = _kv(i, layer, salt=p)
                cache.attend(layer, q, k, v, chunk=i, commit=(p == 2))
            committed[(layer, i)] = (k, v)
            if i >= 2:  # chunk i-1 just left the recent window: it is quantized now, not later
                decoded_after_commit[(layer, i - 1)] = cache.keys(layer)[:, :, _chunk_slice(i - 1)].clone()
                assert sum(1 for kind, x, _ in log if kind == "k" and
                           torch.equal(x, committed[(layer, i - 1)][0].reshape(B * H, N, D))) == 1

    def count(kind, layer, i):
        ref = committed[(layer, i)][0 if kind == "k" else 1].reshape(B * H, N, D)
        return sum(1 for kd, x, _ in log if kd == kind and torch.equal(x, ref))

    for layer in range(n_layers):
        for i in range(n_chunks):
            want = 1 if 1 <= i <= n_chunks - 2 else 0  # sink 0 and the most recent chunk never
            assert count("k", layer, i) == want, (layer, i)
            assert count("v", layer, i) == want, (layer, i)
    assert len(log) == 2 * n_layers * (n_chunks - 2)  # nothing else was encoded (no denoising pass)
    for (layer, i), kq in decoded_after_commit.items():  # never re-quantized: decoded keys are stable
        if i < n_chunks - 1:
            assert torch.equal(cache.keys(layer)[:, :, _chunk_slice(i)], kq)


# ---- eviction ---------------------------------------------------------------------------------------

def test_cache_eviction_drops_oldest_non_sink_chunks():
    cache = KVCache(CacheConfig(method="rtn", max_chunks=3), n_layers=1)
    written = []
    for i in range(6):
        written += _fill_one(cache, i)
        assert len(cache.layers[0].chunks) <= 3
    expected = torch.cat([torch.arange(0, N), torch.arange(4 * N, 6 * N)])
    assert torch.equal(cache.positions(0), expected)
    K = cache.keys(0)
    assert K.shape[2] == 3 * N
    assert torch.equal(K[:, :, :N], written[0][0])  # the sink survives, exact
    assert not torch.equal(K[:, :, N:2 * N], written[4][0])  # chunk 4 is quantized
    assert torch.allclose(K[:, :, N:2 * N], written[4][0], atol=2.0)
    assert torch.equal(K[:, :, 2 * N:], written[5][0])
    assert [c.index for c in cache.layers[0].chunks] == [0, 4, 5]
    # the next chunk is written at its absolute position
    _, k6, v6 = _kv(6)
    cache.write(0, k6, v6, chunk=6)
    assert torch.equal(cache.positions(0)[-N:], torch.arange(6 * N, 7 * N))
    # accounting follows what is left
    comp = cache.bytes_by_component()
    assert comp["k.full"] == 3 * B * H * N * D * 4  # chunks 0, 5 and the current 6 (float32)
    assert comp["k.codes"] == B * H * N * D * 2 // 8  # chunk 4 only


def _fill_one(cache, i, layer=0):
    _, k, v = _kv(i, layer)
    cache.write(layer, k, v, chunk=i)
    cache.commit(layer, i)
    return [(k, v)]


def test_cache_eviction_without_sink_drops_oldest():
    cache = KVCache(CacheConfig(method="bf16", sink_chunks=0, max_chunks=2), n_layers=1)
    written = _fill(cache, 5)
    assert torch.equal(cache.positions(0), torch.arange(3 * N, 5 * N))
    assert torch.equal(cache.keys(0), torch.cat([written[3][0], written[4][0]], 2))
    assert torch.equal(cache.values(0), torch.cat([written[3][1], written[4][1]], 2))


def test_cache_eviction_pre_rope_rotates_at_original_positions():
    rope = Rope3D(D, (2, 8))
    cache = KVCache(CacheConfig(method="bf16", rope="pre", max_chunks=2), n_layers=1, rope=rope)
    written = _fill(cache, 4)
    pos = torch.cat([torch.arange(0, N), torch.arange(3 * N, 4 * N)])
    assert torch.equal(cache.positions(0), pos)
    k_raw = torch.cat([written[0][0], written[3][0]], 2)
    torch.testing.assert_close(cache.keys(0), rope(k_raw, pos), rtol=1e-6, atol=1e-6)


# ---- layouts ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["bf16", "rtn", "kivi+jensen"])
def test_cache_layouts_bhld_and_blhd_agree(method):
    a = KVCache(CacheConfig(track_queries=True, method=method, layout="BHLD"), n_layers=1)
    b = KVCache(CacheConfig(track_queries=True, method=method, layout="BLHD"), n_layers=1)
    for i in range(4):
        q, k, v = _kv(i, b=2)
        out_a = a.attend(0, q, k, v, chunk=i, commit=True)
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        out_b = b.attend(0, qt, kt, vt, chunk=i, commit=True)
        assert out_a.shape == (2, H, N, D)
        assert out_b.shape == (2, N, H, D)  # the caller's layout
        torch.testing.assert_close(out_b.transpose(1, 2), out_a, rtol=1e-6, atol=1e-6)
    assert b.keys(0).shape == (2, 4 * N, H, D) and b.values(0).shape == (2, 4 * N, H, D)
    torch.testing.assert_close(b.keys(0).transpose(1, 2), a.keys(0), rtol=0, atol=0)
    torch.testing.assert_close(b.query_stats(0), a.query_stats(0), rtol=1e-6, atol=1e-6)
    assert a.nbytes() == b.nbytes()


# ---- reference attention ----------------------------------------------------------------------------

def test_cache_attend_bf16_matches_sdpa_over_written_chunks():
    n_chunks = 4
    cache = KVCache(CacheConfig(method="bf16"), n_layers=1)
    qs, ks, vs, outs = [], [], [], []
    for i in range(n_chunks):
        _, kn, vn = _kv(i, salt=7)
        cache.attend(0, _kv(i, salt=8)[0], kn, vn, chunk=i)  # a denoising pass with other K/V
        q, k, v = _kv(i)
        out = cache.attend(0, q, k, v, chunk=i, commit=True)
        qs.append(q), ks.append(k), vs.append(v), outs.append(out)
        K, V = torch.cat(ks, 2), torch.cat(vs, 2)
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, K, V), rtol=1e-5, atol=1e-5)
    # block-causal chunk-by-chunk generation == a single pass with a block-causal mask
    L = n_chunks * N
    blk = torch.arange(L) // N
    mask = blk[:, None] >= blk[None, :]
    single = F.scaled_dot_product_attention(torch.cat(qs, 2), torch.cat(ks, 2), torch.cat(vs, 2), attn_mask=mask)
    torch.testing.assert_close(torch.cat(outs, 2), single, rtol=1e-5, atol=1e-5)


def test_cache_attend_uses_given_scale_and_returns_q_dtype():
    cache = KVCache(CacheConfig(method="bf16"), n_layers=1)
    _fill(cache, 2)
    q, k, v = _kv(2)
    out = cache.attend(0, q, k, v, chunk=2, scale=0.3)
    ref = F.scaled_dot_product_attention(q, cache.keys(0), cache.values(0), scale=0.3)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, F.scaled_dot_product_attention(q, cache.keys(0), cache.values(0)), atol=1e-4)
    out16 = cache.attend(0, q.to(torch.bfloat16), k, v, chunk=2)
    assert out16.dtype == torch.bfloat16


def test_cache_pre_rope_matches_post_rope_with_caller_rotation():
    rope = Rope3D(D, (2, 8))  # 16 tokens per frame: one chunk is one frame
    pre = KVCache(CacheConfig(track_queries=True, method="bf16", rope="pre"), n_layers=1, rope=rope)
    post = KVCache(CacheConfig(track_queries=True, method="bf16", rope="post"), n_layers=1)
    for i in range(4):
        q, k, v = _kv(i)
        pos = torch.arange(i * N, (i + 1) * N)
        q_rot = rope(q, pos)
        out_pre = pre.attend(0, q_rot, k, v, chunk=i, commit=True)
        out_post = post.attend(0, q_rot, rope(k, pos), v, chunk=i, commit=True)
        torch.testing.assert_close(out_pre, out_post, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pre.keys(0), post.keys(0), rtol=1e-5, atol=1e-5)
    # statistics: S is kept post-RoPE in both modes (where queries meet keys)
    torch.testing.assert_close(pre.query_stats(0), post.query_stats(0), rtol=1e-5, atol=1e-5)


def test_cache_pre_rope_span_is_quantized_with_s_rotated_into_its_keys_space(monkeypatch):
    """A pre-RoPE key at position p meets q as (R_pᵀ q)·k: its span must be quantized with mean_p R_pᵀ S R_p,
    not with S of queries un-rotated by their own positions."""
    from quantwm.core.methods.rtn import RTN
    from quantwm.core.stats import rope_conjugate

    seen = []
    encode = RTN.encode
    monkeypatch.setattr(RTN, "encode", lambda self, x, kind, ctx: seen.append(ctx.stats) or encode(self, x, kind, ctx))
    rope = Rope3D(D, (2, 8))
    cache = KVCache(CacheConfig(track_queries=True, method="rtn", rope="pre", target="k"), n_layers=1, rope=rope)
    g = torch.Generator().manual_seed(3)
    direction = torch.randn(D, generator=g)
    for i in range(3):
        _, k, v = _kv(i)
        q_rot = direction.expand(B, H, N, D) + 0.1 * torch.randn(B, H, N, D, generator=g)  # post-RoPE queries
        cache.attend(0, q_rot, k, v, chunk=i, commit=True)
        if i == 2:  # committing chunk 2 quantizes chunk 1 (sink 0 and recent 2 stay full precision)
            S = cache.query_stats(0)
            want = rope_conjugate(S, rope, torch.arange(N, 2 * N))
            torch.testing.assert_close(seen[-1], want.repeat(B, 1, 1), rtol=1e-4, atol=1e-5)
            assert not torch.allclose(seen[-1][0], S[0], atol=1e-2)  # the rotation matters here


def test_cache_pre_rope_requires_rope_function():
    with pytest.raises(ValueError, match="rope"):
        KVCache(CacheConfig(rope="pre"), n_layers=1)


# ---- query statistics -------------------------------------------------------------------------------

def test_cache_query_stats_cumulative_mean_over_all_queries():
    cache = KVCache(CacheConfig(track_queries=True, method="bf16"), n_layers=2)
    seen = []
    for i in range(3):
        for p in range(2):
            q, k, v = _kv(i, salt=p, b=2)
            q = q * (i + 1)
            cache.attend(0, q, k, v, chunk=i, commit=(p == 1))
            seen.append(q)
    torch.testing.assert_close(cache.query_stats(0).double(), _second(torch.cat(seen, 2)), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):  # layer 1 has seen nothing at all
        cache.query_stats(1)


def test_cache_query_stats_observe_false_is_not_counted():
    cache = KVCache(CacheConfig(track_queries=True, method="bf16"), n_layers=1)
    q0, k0, v0 = _kv(0)
    cache.attend(0, q0, k0, v0, chunk=0)
    q1 = _kv(0, salt=1)[0] * 5
    cache.attend(0, q1, k0, v0, chunk=0, commit=True, observe=False)
    torch.testing.assert_close(cache.query_stats(0).double(), _second(q0), rtol=1e-5, atol=1e-5)


def test_cache_query_stats_ema_with_stats_decay():
    d = 0.6
    cache = KVCache(CacheConfig(track_queries=True, method="bf16", stats_decay=d), n_layers=1)
    qs = []
    for i in range(3):
        q, k, v = _kv(i)
        q = q * (i + 1)
        cache.attend(0, q, k, v, chunk=i, commit=True)
        qs.append(q)
    b0, b1, b2 = (_second(q) for q in qs)
    expected = d * (d * b0 + (1 - d) * b1) + (1 - d) * b2
    torch.testing.assert_close(cache.query_stats(0).double(), expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(cache.query_stats(0).double(), _second(torch.cat(qs, 2)), atol=1e-2)


def test_cache_query_stats_identity_before_any_query():
    # contract (query_stats docstring, docs/method.md §2): S is the identity before any query
    cache = KVCache(CacheConfig(track_queries=True, method="bf16"), n_layers=1)
    _, k, v = _kv(0)
    cache.write(0, k, v, chunk=0)
    torch.testing.assert_close(cache.query_stats(0), torch.eye(D).expand(H, D, D))


def test_cache_load_query_stats_seeds_s():
    S = torch.diag(torch.linspace(0.1, 5.0, D)).expand(H, D, D).clone()
    S[1] *= 2
    cache = KVCache(CacheConfig(track_queries=True, method="bf16"), n_layers=2)
    cache.load_query_stats(1, S, count=100)
    torch.testing.assert_close(cache.query_stats(1), S)
    q, k, v = _kv(0, layer=1)
    cache.attend(1, q, k, v, chunk=0)
    expected = (S.double() * 100 + _second(q) * N) / (100 + N)  # the seed counts as 100 queries
    torch.testing.assert_close(cache.query_stats(1).double(), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        cache.query_stats(0)


def test_cache_load_query_stats_does_not_alias_callers_tensor():
    S = torch.eye(D, dtype=torch.float64).expand(H, D, D).clone()
    before = S.clone()
    cache = KVCache(CacheConfig(method="bf16"), n_layers=1)
    cache.load_query_stats(0, S)
    cache.attend(0, *_kv(0), chunk=0)
    assert torch.equal(S, before), "attend() modified the tensor given to load_query_stats()"


def test_cache_quantization_receives_current_s(monkeypatch):
    S = torch.diag(torch.linspace(0.5, 3.0, D)).expand(H, D, D).clone()
    S[1] = S[1].flip(0, 1)  # heads differ, so stream order matters
    cache = KVCache(CacheConfig(method="rtn", track_queries=True), n_layers=1)
    log = _spy(cache, monkeypatch)
    cache.load_query_stats(0, S, count=10)
    _fill(cache, 3, b=2)  # no queries: S stays the seed; chunk 1 is quantized at the third commit
    assert [kind for kind, _, _ in log] == ["k", "v"]
    for _, _, stats in log:
        assert stats.shape == (2 * H, D, D)  # one per (batch, head) stream, batch-major
        torch.testing.assert_close(stats, S.repeat(2, 1, 1))


def test_cache_quantization_without_history_gets_identity(monkeypatch):
    cache = KVCache(CacheConfig(method="rtn", track_queries=True), n_layers=1)
    log = _spy(cache, monkeypatch)
    _fill(cache, 3)
    assert len(log) == 2
    for _, _, stats in log:
        torch.testing.assert_close(stats, torch.eye(D).expand(B * H, D, D))


def test_cache_quantwm_key_encoding_depends_on_s():
    n = 64
    g = torch.Generator().manual_seed(5)
    A = torch.randn(H, D, D, generator=g)
    S_aniso = A @ A.transpose(-1, -2) / D + torch.diag(torch.logspace(-2, 1, D))

    def middle_keys(S):
        cache = KVCache(CacheConfig(method="quantwm"), n_layers=1)
        if S is not None:
            cache.load_query_stats(0, S, count=1)
        written = _fill(cache, 3, n=n)
        return cache.keys(0)[:, :, n:2 * n], written[1][0]

    k_id, ref = middle_keys(None)
    k_id2, _ = middle_keys(None)
    k_an, _ = middle_keys(S_aniso)
    assert torch.equal(k_id, k_id2)  # deterministic for the same S
    assert not torch.allclose(k_id, k_an, atol=1e-4)  # different S, different encoding
    assert not torch.equal(k_id, ref)


# ---- accounting -------------------------------------------------------------------------------------

def _stored_bytes(cache: KVCache) -> int:
    total, shared = 0, {}
    for st in cache.layers:
        for c in st.chunks + ([st.current] if st.current is not None else []):
            for full, enc in ((c.k, c.k_enc), (c.v, c.v_enc)):
                if full is not None:
                    total += full.numel() * full.element_size()
                else:
                    total += sum(t.numel() * t.element_size() for t in enc.components().values())
                    shared.update({id(t): t for t in enc.shared().values()})  # a shared tensor counts once
    return total + sum(t.numel() * t.element_size() for t in shared.values())


def test_cache_counts_a_shared_psac_basis_once():
    cache = KVCache(CacheConfig(method="quantwm"), n_layers=1)
    S = torch.diag(torch.linspace(4.0, 0.1, D)).expand(H, D, D).contiguous()
    cache.load_query_stats(0, S)  # settled statistics: one basis serves every span
    _fill(cache, 6, n=32)
    encs = [c.k_enc for c in cache.layers[0].chunks if c.k_enc is not None]
    assert len(encs) == 4 and all(e.shared()["psac_basis"] is encs[0].shared()["psac_basis"] for e in encs)
    basis = encs[0].shared()["psac_basis"]
    assert cache.bytes_by_component()["k.psac_basis"] == basis.numel() * basis.element_size()
    assert cache.nbytes() == _stored_bytes(cache)


def test_cache_nbytes_counts_stored_tensors_rtn():
    cache = KVCache(CacheConfig(method="rtn"), n_layers=2)
    for layer in range(2):
        _fill(cache, 4, layer=layer, dtype=torch.bfloat16)
        _, k, v = _kv(4, layer, dtype=torch.bfloat16)
        cache.write(layer, k, v, chunk=4)
    elems = B * H * N * D
    per_layer = {"full": 3 * elems * 2, "codes": 2 * elems * 2 // 8,
                 "scales": 2 * B * H * N * (D // 64) * 2, "zeros": 2 * B * H * N * (D // 64) * 2}
    expected = {f"{w}.{name}": 2 * n for w in ("k", "v") for name, n in per_layer.items()}
    assert cache.bytes_by_component() == expected
    assert cache.nbytes() == sum(expected.values()) == _stored_bytes(cache)
    assert cache.bits_per_element() == pytest.approx(2.5, abs=1e-12)
    cbpe = cache.cache_bits_per_element()
    assert cbpe == pytest.approx(8 * cache.nbytes() / (2 * 2 * 5 * elems))
    assert 2.5 < cbpe < 16


def test_cache_nbytes_full_chunks_use_written_dtype():
    c32 = KVCache(CacheConfig(method="bf16"), n_layers=1)
    c16 = KVCache(CacheConfig(method="bf16"), n_layers=1)
    _fill(c32, 2, dtype=torch.float32)
    _fill(c16, 2, dtype=torch.bfloat16)
    assert c32.nbytes() == 2 * 2 * B * H * N * D * 4 == _stored_bytes(c32)
    assert c16.nbytes() == 2 * 2 * B * H * N * D * 2 == _stored_bytes(c16)
    assert c16.cache_bits_per_element() == pytest.approx(16.0)
    assert c32.cache_bits_per_element() == pytest.approx(32.0)


@pytest.mark.parametrize("method", ["kivi", "qvg", "quantwm"])
def test_cache_nbytes_matches_stored_tensors_other_methods(method):
    cache = KVCache(CacheConfig(method=method), n_layers=1)
    _fill(cache, 3, n=32)
    assert cache.nbytes() == _stored_bytes(cache)
    assert set(k for k in cache.bytes_by_component() if k.startswith("k.")) > {"k.full", "k.codes", "k.scales"}
    # qvg keeps 256 BF16 centroids per span: on 32-token chunks that is one per token, above 16 bits
    assert 2 < cache.bits_per_element() < (20 if method == "qvg" else 16)


def test_cache_bits_per_element_nan_when_nothing_quantized():
    cache = KVCache(CacheConfig(method="rtn"), n_layers=1)
    assert math.isnan(cache.bits_per_element())
    assert math.isnan(cache.cache_bits_per_element())
    _fill(cache, 2)  # sink and recent: nothing quantized yet
    assert math.isnan(cache.bits_per_element())
    assert cache.cache_bits_per_element() == pytest.approx(32.0)
    _fill_one(cache, 2)
    assert cache.bits_per_element() == pytest.approx(2.5)


# ---- target -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("target, exact", [("k", "v"), ("v", "k")])
def test_cache_target_leaves_the_other_half_exact(target, exact):
    cache = KVCache(CacheConfig(method="rtn", target=target), n_layers=1)
    written = _fill(cache, 4)
    read = {"k": cache.keys, "v": cache.values}
    idx = {"k": 0, "v": 1}
    assert torch.equal(read[exact](0), torch.cat([kv[idx[exact]] for kv in written], 2))
    assert not torch.equal(read[target](0)[:, :, _chunk_slice(1)], written[1][idx[target]])
    comp = cache.bytes_by_component()
    assert comp[f"{exact}.full"] == 4 * B * H * N * D * 4 and f"{exact}.codes" not in comp
    assert f"{target}.codes" in comp
    assert cache.bits_per_element() == pytest.approx(2.5)


# ---- +jensen ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["rtn+jensen", "kivi+jensen", "qvg+jensen"])
def test_cache_jensen_bias_nonpositive_and_zero_on_full_chunks(method):
    cache = KVCache(CacheConfig(method=method), n_layers=1)
    _fill(cache, 3)
    q, k, v = _kv(3)
    cache.write(0, k, v, chunk=3)
    scale = D ** -0.5
    bias = cache.logit_bias(0, q, scale)
    assert bias.shape == (B, H, N, 4 * N)
    assert (bias <= 0).all()
    for i in (0, 2, 3):  # sink, recent, current: full precision
        assert torch.equal(bias[..., _chunk_slice(i)], torch.zeros(B, H, N, N))
    assert (bias[..., _chunk_slice(1)] < 0).all()


def test_cache_jensen_bias_formula_rtn():
    cache = KVCache(CacheConfig(method="rtn+jensen"), n_layers=1)
    written = _fill(cache, 3)
    q = _kv(3)[0]
    tau = 0.2
    bias = cache.logit_bias(0, q, tau)[..., _chunk_slice(1)]
    k1 = written[1][0]  # (B, H, N, D), one group of 64 channels per token
    step = (k1.amax(-1) - k1.amin(-1)) / 3  # (B, H, N)
    expected = -(tau ** 2 / 24) * q.square().sum(-1)[..., :, None] * step.square()[..., None, :]
    torch.testing.assert_close(bias, expected, rtol=5e-3, atol=0)


def test_cache_jensen_attend_applies_bias():
    plain = KVCache(CacheConfig(method="rtn"), n_layers=1)
    jen = KVCache(CacheConfig(method="rtn+jensen"), n_layers=1)
    for c in (plain, jen):
        _fill(c, 3)
    q, k, v = _kv(3)
    q = q * 4  # larger logits, larger correction
    out_j = jen.attend(0, q, k, v, chunk=3)
    out_p = plain.attend(0, q, k, v, chunk=3)
    torch.testing.assert_close(jen.keys(0), plain.keys(0), rtol=0, atol=0)
    ref = F.scaled_dot_product_attention(q, jen.keys(0), jen.values(0), attn_mask=jen.logit_bias(0, q, D ** -0.5))
    torch.testing.assert_close(out_j, ref, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out_j, out_p, atol=1e-5)


@pytest.mark.parametrize("method,target", [("rtn", "kv"), ("bf16", "kv"), ("quantwm", "kv"), ("rtn+jensen", "v")])
def test_cache_logit_bias_none_without_jensen_keys(method, target):
    cache = KVCache(CacheConfig(method=method, target=target), n_layers=1)
    _fill(cache, 3)
    assert cache.logit_bias(0, _kv(3)[0], 0.125) is None


# ---- keep_exact -------------------------------------------------------------------------------------

def test_cache_keep_exact_returns_original_keys():
    cache = KVCache(CacheConfig(method="rtn", keep_exact=True), n_layers=1)
    written = _fill(cache, 4, dtype=torch.bfloat16)
    K_exact = torch.cat([k for k, _ in written], 2).float()
    assert torch.equal(cache.keys(0, exact=True), K_exact)
    assert not torch.equal(cache.keys(0), K_exact)
    # diagnostics only: the exact copy is not counted
    assert cache.nbytes() == _stored_bytes(cache)


def test_cache_keep_exact_pre_rope_rotates_exact_keys():
    rope = Rope3D(D, (2, 8))
    cache = KVCache(CacheConfig(method="rtn", keep_exact=True, rope="pre"), n_layers=1, rope=rope)
    written = _fill(cache, 3)
    K_raw = torch.cat([k for k, _ in written], 2)
    torch.testing.assert_close(cache.keys(0, exact=True), rope(K_raw, torch.arange(3 * N)), rtol=1e-6, atol=1e-6)


def test_cache_exact_keys_without_keep_exact_raise():
    cache = KVCache(CacheConfig(method="rtn"), n_layers=1)
    written = _fill(cache, 2)
    # nothing quantized yet: exact keys are available
    assert torch.equal(cache.keys(0, exact=True), torch.cat([k for k, _ in written], 2))
    _fill_one(cache, 2)
    with pytest.raises(ValueError, match="keep_exact=True"):
        cache.keys(0, exact=True)


# ---- bad inputs -------------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["k", "v"])
def test_cache_nan_in_kv_raises(which):
    cache = KVCache(CacheConfig(), n_layers=1)
    _, k, v = _kv(0)
    (k if which == "k" else v)[0, 1, 3, 5] = float("nan")
    with pytest.raises(ValueError, match=rf"{which} contains 1 NaN/Inf"):
        cache.write(0, k, v, chunk=0)
    assert cache.layers[0].current is None


def test_cache_nan_in_q_raises():
    cache = KVCache(CacheConfig(), n_layers=1)
    q, k, v = _kv(0)
    q[0, 0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="q contains"):
        cache.attend(0, q, k, v, chunk=0)


def test_cache_3d_tensors_raise():
    cache = KVCache(CacheConfig(), n_layers=1)
    _, k, v = _kv(0)
    with pytest.raises(ValueError, match=r"k must be 4-D in layout BHLD, got shape \(2, 16, 64\)"):
        cache.write(0, k[0], v[0], chunk=0)
    with pytest.raises(ValueError, match="q must be 4-D"):
        cache.attend(0, k[0], k, v, chunk=0)


def test_cache_integer_tensors_raise():
    cache = KVCache(CacheConfig(), n_layers=1)
    k = torch.ones(B, H, N, D, dtype=torch.int64)
    with pytest.raises(ValueError, match="floating-point"):
        cache.write(0, k, k, chunk=0)


def test_cache_mismatched_kv_shapes_raise():
    cache = KVCache(CacheConfig(), n_layers=1)
    _, k, v = _kv(0)
    with pytest.raises(ValueError, match="same non-empty shape"):
        cache.write(0, k, v[:, :, :8], chunk=0)
    with pytest.raises(ValueError, match="same non-empty shape"):
        cache.write(0, k[:, :, :0], v[:, :, :0], chunk=0)


def test_cache_chunk_shape_must_match_cached_chunks():
    cache = KVCache(CacheConfig(), n_layers=1)
    _fill(cache, 1)
    _, k, v = _kv(1, h=3)
    with pytest.raises(ValueError, match="does not match the cached chunks"):
        cache.write(0, k, v, chunk=1)
    _, k, v = _kv(1, n=8)  # a different token count is fine
    cache.write(0, k, v, chunk=1)
    assert cache.positions(0).tolist() == list(range(N + 8))


def test_cache_q_mismatch_raises():
    cache = KVCache(CacheConfig(), n_layers=1)
    _, k, v = _kv(0)
    q = _t(9, B, H, N, 32)
    with pytest.raises(ValueError):
        cache.attend(0, q, k, v, chunk=0)


@pytest.mark.parametrize("layer", [2, -1, 10])
def test_cache_layer_out_of_range_raises(layer):
    cache = KVCache(CacheConfig(), n_layers=2)
    _, k, v = _kv(0)
    with pytest.raises(ValueError, match=f"layer {layer} out of range: the cache has 2 layers"):
        cache.write(layer, k, v, chunk=0)
    for call in (lambda: cache.keys(layer), lambda: cache.positions(layer), lambda: cache.commit(layer, 0)):
        with pytest.raises(ValueError, match="out of range"):
            call()


def test_cache_empty_keys_and_values_raise():
    cache = KVCache(CacheConfig(), n_layers=1)
    with pytest.raises(ValueError, match="layer 0 of the cache is empty"):
        cache.keys(0)
    with pytest.raises(ValueError, match="empty"):
        cache.values(0)
    assert cache.positions(0).numel() == 0
    assert cache.nbytes() == 0


@pytest.mark.parametrize("kwargs,match", [
    ({"method": "nope"}, "unknown method 'nope'"),
    ({"method": "bf16+jensen"}, "unknown method"),
    ({"target": "x"}, "target must be one of k, v, kv"),
    ({"layout": "x"}, "layout must be one of BHLD, BLHD"),
    ({"rope": "x"}, "rope must be one of post, pre"),
    ({"k_bits": 5}, "unsupported bits=5"),
    ({"v_bits": 1}, "unsupported bits=1"),
    ({"max_chunks": 1}, r"max_chunks \(1\) must exceed sink_chunks \(1\)"),
    ({"max_chunks": 2, "sink_chunks": 3}, "must exceed sink_chunks"),
    ({"max_chunks": 0, "sink_chunks": 0}, "must exceed sink_chunks"),
    ({"sink_chunks": -1}, ">= 0"),
    ({"recent_chunks": -1}, ">= 0"),
])
def test_cache_config_bad_values_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CacheConfig(**kwargs)


def test_cache_bad_method_option_raises():
    with pytest.raises(ValueError, match="bad option for method 'rtn'"):
        KVCache(CacheConfig(method="rtn", method_options=(("no_such_option", 1),)), n_layers=1)


def test_cache_method_options_reach_the_method():
    cache = KVCache(CacheConfig(method="rtn", method_options=(("group_size", 32),)), n_layers=1)
    _fill(cache, 3)
    assert cache.bits_per_element() == pytest.approx(2 + 32 / 32)  # fp16 scale + zero per 32 channels


def test_cache_rejected_attend_does_not_poison_query_stats():
    # a q whose head dim does not match the keys is rejected; the cache must stay usable afterwards
    cache = KVCache(CacheConfig(track_queries=True, method="bf16"), n_layers=1)
    q, k, v = _kv(0)
    with pytest.raises(ValueError):
        cache.attend(0, _t(9, B, H, N, 32), k, v, chunk=0)
    cache.attend(0, q, k, v, chunk=0, commit=True)
    torch.testing.assert_close(cache.query_stats(0).double(), _second(q), rtol=1e-5, atol=1e-5)


# ---- spans of several chunks, strictly causal statistics (issue 12) ---------------------------------------

def test_cache_span_chunks_quantizes_several_chunks_as_one_span():
    one = KVCache(CacheConfig(method="qvg", keep_exact=True), n_layers=1)
    three = KVCache(CacheConfig(method="qvg", keep_exact=True, span_chunks=3), n_layers=1)
    for c in (one, three):
        _fill(c, 8, n=128)
    # sink 0 and recent 7 stay exact; chunks 1-6 leave the window: 6 spans of 1, or 2 spans of 3
    st = three.layers[0]
    assert [(x.index, x.n_chunks, x.quantized) for x in st.chunks] == [(0, 1, False), (1, 3, True), (4, 3, True),
                                                                       (7, 1, False)]
    assert torch.equal(three.positions(0), torch.arange(8 * 128))
    torch.testing.assert_close(three.keys(0, exact=True), one.keys(0, exact=True))
    assert three.bits_per_element() < one.bits_per_element()  # 256 centroids over 384 tokens; 128 over 128
    # chunks wait full precision until a whole span has left the window
    three.attend(0, *_kv(8, n=128), chunk=8, commit=True)
    assert [(x.index, x.quantized) for x in three.layers[0].chunks][-2:] == [(7, False), (8, False)]


def test_cache_span_chunks_eviction_counts_chunks():
    cache = KVCache(CacheConfig(method="rtn", span_chunks=2, max_chunks=5), n_layers=1)
    _fill(cache, 7)
    assert sum(x.n_chunks for x in cache.layers[0].chunks) <= 5
    assert cache.layers[0].chunks[0].index == 0  # the sink stays


def test_cache_causal_stats_hold_a_chunks_queries_back_until_it_is_quantized(monkeypatch):
    """quantwm-paper: the span of chunk c is quantized with the queries of chunks < c only."""
    from quantwm.core.methods.quantwm import QuantWMPaper

    seen = []
    encode = QuantWMPaper.encode
    monkeypatch.setattr(QuantWMPaper, "encode", lambda self, x, kind, ctx: (
        seen.append((ctx.stats.clone(), ctx.history)) if kind == "k" else None) or encode(self, x, kind, ctx))
    cache = KVCache(CacheConfig(method="quantwm-paper", target="k"), n_layers=1)
    qs = []
    for i in range(4):
        q, k, v = _kv(i)
        q = q * (i + 1)  # each chunk's queries distinguishable
        qs.append(q)
        cache.attend(0, q, k, v, chunk=i, commit=True)
    # committing chunk 2 quantizes chunk 1 (S from chunk 0); committing chunk 3 quantizes chunk 2 (chunks 0-1)
    # (a span whose storage dtype must widen is encoded twice: once with its checks deferred, then at once)
    seen = list({h: (S, h) for S, h in seen}.values())
    assert [h for _, h in seen] == [N * B, 2 * N * B]
    torch.testing.assert_close(seen[0][0][0], _second(qs[0])[0].float(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(seen[1][0][0], _second(torch.cat(qs[:2], 2))[0].float(), rtol=1e-4, atol=1e-5)


def test_quantwm_paper_first_span_without_history_has_uniform_weights_and_no_psac():
    from quantwm.core.methods import SpanContext, get_method

    m = get_method("quantwm-paper", n_centroids=8)
    x = torch.randn(2, 64, 64, generator=torch.Generator().manual_seed(0))
    cold = m.encode(x, "k", SpanContext())
    assert "psac_basis" not in cold.shared() and "psac_codes" not in cold.components()
    warm = m.encode(x, "k", SpanContext(stats=torch.eye(64).expand(2, 64, 64) * 2, history=10))
    assert "psac_basis" in warm.shared() and warm.shared()["psac_basis"].dtype == torch.bfloat16
    assert warm.components()["psac_codes"].shape == (2, 64, 8)  # 8 INT8 coefficients per token
    assert warm.components()["psac_scales"].shape == (2, 64, 1)  # one scale per token


def test_public_contract_seq_len_and_spans():
    from quantwm.core.cache import CacheConfig, KVCache

    c = KVCache(CacheConfig(method="rtn", recent_chunks=1), 2)
    k = torch.randn(1, 2, 4, 64)
    assert c.n_layers == 2 and c.seq_len(0) == 0 and c.inspect(0) == ()
    for i in range(3):
        c.attend(0, k, k, k, chunk=i, commit=True)
    c.write(0, k, k, chunk=3)
    spans = c.inspect(0)
    assert [s.index for s in spans] == [0, 1, 2, 3]
    assert spans[1].nbytes < spans[0].nbytes == 2 * 4 * 64 * 2 * 4  # a quantized span stores less than K+V in fp32
    with pytest.raises(AttributeError):
        spans[0].n_tokens = 1  # frozen: a view, not the cache's own record
    assert [s.quantized for s in spans] == [False, True, False, False]  # sink, quantized, recent, current
    assert c.seq_len(0) == 16 == len(c.positions(0)) == c.keys(0).shape[2] and c.seq_len(1) == 0
    with pytest.raises(ValueError, match="layer 5 out of range"):
        c.inspect(5)


def test_nothing_outside_the_core_uses_more_of_the_cache_than_its_contract():
    """Every attribute code outside quantwm/core reads on a cache is in the contract (`cache.PUBLIC`), or belongs
    to the SGLang-facing cache that wraps one (adapters/sglang_cache.py), or to a real pipeline's own cache."""
    import ast
    import pathlib

    from quantwm.adapters.sglang_cache import QuantWMCausalKVCache
    from quantwm.core.cache import PUBLIC

    wrapper = {n for n in dir(QuantWMCausalKVCache) if not n.startswith("_")}
    pipelines = {"update_and_get_attention_kv", "k", "v", "resident_nbytes", "get_history", "items"}
    root = pathlib.Path(__file__).resolve().parents[1]
    offenders = []
    for path in [*root.glob("quantwm/**/*.py"), *root.glob("app/*.py"), *root.glob("kernels/*.py"),
                 *root.glob("benchmarks/*.py")]:
        if path.parent.name == "core" or path.parent.parent.name == "core":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            holder = ast.unparse(node.value).split(".")[-1]
            if holder in ("cache", "store") or holder.endswith("_cache"):
                if node.attr not in PUBLIC and node.attr not in wrapper | pipelines:
                    offenders.append(f"{path.relative_to(root)}:{node.lineno} {ast.unparse(node)}")
    assert not offenders, offenders


def test_jensen_is_a_typed_field_and_the_suffix_spells_the_same_config():
    assert CacheConfig("qvg", jensen=True) == CacheConfig("qvg+jensen")
    cfg = CacheConfig("qvg", jensen=True)
    assert cfg.jensen and cfg.method == "qvg+jensen" and cfg.base_method == "qvg"
    assert not CacheConfig("qvg").jensen
    with pytest.raises(ValueError, match="bf16"):
        CacheConfig("bf16", jensen=True)


def test_reset_next_chunk_next_token_and_memory_are_the_public_contract():
    cache = KVCache(CacheConfig("quantwm"), 2)
    g = torch.Generator().manual_seed(0)
    for i in range(4):
        for layer in range(2):
            assert cache.next_chunk(layer) == i and cache.next_token(layer) == 16 * i
            k, v, q = (torch.randn(1, 2, 16, 64, generator=g) for _ in range(3))
            cache.attend(layer, q, k, v, chunk=i, commit=True)
    m = cache.memory()
    assert m.stored_bytes == cache.nbytes() and m.by_component == cache.bytes_by_component()
    assert m.bf16_bytes == 2 * 2 * (2 * 4 * 16 * 64) * 2  # K and V, 2 layers, 4 chunks of 2 heads x 16 x 64
    assert m.bits_per_element == cache.bits_per_element() and m.compression == pytest.approx(16 / m.bits_per_element)
    assert m.runtime_bytes == cache.runtime_bytes() and m.stored_mb == m.stored_bytes / 2 ** 20
    cache.reset()
    assert cache.next_chunk(0) == 0 and cache.next_token(1) == 0 and cache.seq_len(0) == 0 and cache.nbytes() == 0
    empty = cache.memory()
    assert empty.stored_bytes == 0 and empty.compression == 1.0 and empty.bits_per_element != empty.bits_per_element
    with pytest.raises(ValueError, match="layer 2 out of range"):
        cache.next_token(2)


def _host_syncs(cache, q, k, v, chunk):
    """The calls that would make the host wait on a device (quantwm/core/syncs.py) during one attend call."""
    from quantwm.core.syncs import HostSyncs

    with HostSyncs() as syncs:
        cache.attend(0, q, k, v, chunk=chunk)
    return syncs.calls


@pytest.mark.parametrize("method", ["bf16", "rtn", "kivi", "qvg", "quantwm", "quantwm+jensen"])
def test_attend_over_a_warm_cache_makes_no_host_sync(method):
    g = torch.Generator().manual_seed(0)
    caches = [KVCache(CacheConfig(method, check_inputs=check), 1) for check in (False, True)]
    for i in range(4):
        q, k, v = (torch.randn(1, 2, 16, 64, generator=g) for _ in range(3))
        for cache in caches:
            cache.attend(0, q, k, v, chunk=i, commit=True)
    q, k, v = (torch.randn(1, 2, 16, 64, generator=g) for _ in range(3))
    assert _host_syncs(caches[0], q, k, v, 4) == []  # nothing waits on the device: CUDA graphs can capture it
    assert _host_syncs(caches[1], q, k, v, 4) == ["__bool__"]  # on the CPU the NaN/Inf check is read at once
    with pytest.raises(ValueError, match="v contains 1 NaN/Inf"):
        caches[1].attend(0, q, k, v.index_put((torch.tensor([0]),) * 4, torch.tensor(float("nan"))), chunk=4)


@pytest.mark.parametrize("method", ["bf16", "kivi", "quantwm"])
def test_a_warm_attend_on_an_accelerator_makes_no_host_sync_with_the_default_configuration(method, monkeypatch):
    """Where a read is a host sync (a GPU), the default NaN/Inf check is a device flag read at the layer's next
    commit with the span's own checks: the attend waits on nothing, the commit reads once, and bad inputs are still
    named."""
    import quantwm.core.cache as cache_module

    monkeypatch.setattr(cache_module, "defers_checks", lambda x: True)  # as on a CUDA tensor
    g = torch.Generator().manual_seed(0)
    cache = KVCache(CacheConfig(method), 1)  # check_inputs=True, the default
    for i in range(4):
        q, k, v = (torch.randn(1, 2, 16, 64, generator=g) for _ in range(3))
        cache.attend(0, q, k, v, chunk=i, commit=True)
    q, k, v = (torch.randn(1, 2, 16, 64, generator=g) for _ in range(3))
    assert _host_syncs(cache, q, k, v, 4) == [] and _host_syncs(cache, q, k, v, 4) == []  # two denoising passes
    assert len(cache.layers[0].unchecked) == 2  # their flags wait on the device for the commit
    cache.commit(0, 4)
    assert cache.layers[0].unchecked == []
    bad = v.index_put((torch.tensor([0]),) * 4, torch.tensor(float("nan")))
    cache.attend(0, q, k, v, chunk=5)
    cache.attend(0, q, k, bad, chunk=5)  # no error yet: nothing was read
    with pytest.raises(ValueError, match=r"layer 0: the q/k/v written for chunk 5 contain NaN/Inf"):
        cache.commit(0, 5)


def test_a_storage_dtype_that_must_widen_is_found_at_commit_and_remembered(monkeypatch):
    """A span's value checks are read once at commit; where fp8 cannot hold a scale the span is quantized again
    with the checks immediate (the wider dtype counted), and later spans start from it: one repeat, not one each."""
    from quantwm.core.methods.rtn import RTN

    encodes = []
    encode = RTN.encode
    monkeypatch.setattr(RTN, "encode", lambda self, x, kind, ctx: encodes.append(kind) or encode(self, x, kind, ctx))
    cache = KVCache(CacheConfig("rtn", k_bits=2, v_bits=2, method_options=(("scale_dtype", "fp8"),)), 1)
    g = torch.Generator().manual_seed(0)
    for i in range(5):
        q, k, v = (torch.randn(1, 2, 16, 64, generator=g) * 1e-3 for _ in range(3))  # scales under fp8's normal range
        cache.attend(0, q, k, v, chunk=i, commit=True)
    assert encodes == ["k", "v", "k", "v"] + ["k", "v"] * 2  # span 1 twice (deferred, then at once), spans 2-3 once
    scales = cache.layers[0].chunks[1].k_enc.components()["scales"]
    assert scales.dtype == torch.float16  # widened from fp8, and stored so


@pytest.mark.parametrize("method", ["bf16", "rtn", "kivi", "qvg"])
def test_cache_keeps_no_query_statistics_where_nothing_reads_them(method, monkeypatch):
    from quantwm.core import stats

    calls = []
    monkeypatch.setattr(stats.QueryStats, "update", lambda self, q, anchor=None: calls.append(q.shape))
    cache = KVCache(CacheConfig(method=method, recent_chunks=0), n_layers=1)
    g = torch.Generator().manual_seed(0)
    for i in range(3):
        q, k, v = (torch.randn(1, 2, 8, 64, generator=g) for _ in range(3))
        cache.attend(0, q, k, v, chunk=i, commit=True)
        cache.observe(0, q)
    assert not cache.tracks_queries and calls == [] and cache.runtime_bytes()["query_stats"] == 0
    with pytest.raises(ValueError, match="track_queries=True"):
        cache.query_stats(0)
    kept = KVCache(CacheConfig(method=method, track_queries=True), n_layers=1)
    kept.attend(0, q, k, v, chunk=0)
    assert kept.tracks_queries and len(calls) == 1


def test_cache_keeps_query_statistics_for_methods_that_read_them():
    assert KVCache(CacheConfig(method="quantwm"), n_layers=1).tracks_queries
    assert KVCache(CacheConfig(method="quantwm", budget=2.5), n_layers=1).tracks_queries
    with pytest.raises(ValueError, match="track_queries=False"):
        KVCache(CacheConfig(method="quantwm", track_queries=False), n_layers=1)
