"""The generic entry: chunk_attention and ChunkedAttention over the QuantWM cache."""
import pytest
import torch
import torch.nn.functional as F

from quantwm.adapters import ChunkedAttention, chunk_attention
from quantwm.core.cache import CacheConfig, KVCache


def _qkv(seed, n=8, heads=2, dim=64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, n, heads, dim, generator=g) for _ in range(3)]  # (B, L, H, D) like Self-Forcing


def test_chunk_attention_attends_to_committed_history_plus_the_chunk():
    cache = KVCache(CacheConfig("bf16", layout="BLHD"), 1)
    q0, k0, v0 = _qkv(0)
    chunk_attention(q0, k0, v0, cache, layer=0, chunk=0, commit=True)
    q1, k1, v1 = _qkv(1)
    stale = _qkv(2)
    chunk_attention(*stale, cache, layer=0, chunk=1)  # a denoising pass: overwritten by the next one
    out = chunk_attention(q1, k1, v1, cache, layer=0, chunk=1, commit=True)
    bhld = lambda x: x.transpose(1, 2)
    ref = F.scaled_dot_product_attention(bhld(q1), torch.cat([bhld(k0), bhld(k1)], 2), torch.cat([bhld(v0), bhld(v1)], 2))
    assert out.shape == q1.shape and torch.allclose(out, bhld(ref), atol=1e-6)
    assert cache.next_chunk(0) == 2 and cache.next_token(0) == 16


def test_chunked_attention_position_is_set_inside_and_restored_after():
    cache = KVCache(CacheConfig("bf16", layout="BLHD"), 2)
    attn = ChunkedAttention(cache)
    q, k, v = _qkv(0)
    with attn.at(0, commit=True):
        assert (attn.chunk, attn.commit) == (0, True)
        for layer in range(2):
            attn(layer, q, k, v)
        with pytest.raises(ValueError, match="do not nest"):
            with attn.at(1):
                pass
    assert (attn.chunk, attn.commit) == (None, False)
    assert [cache.next_chunk(layer) for layer in range(cache.n_layers)] == [1, 1]
    with pytest.raises(ValueError, match="no chunk position set"):
        attn(0, q, k, v)


@pytest.mark.parametrize("chunk, commit, needle", [(-1, False, "chunk must be"), (True, False, "chunk must be"),
                                                   (0, 1, "commit must be")])
def test_chunk_attention_rejects_bad_positions(chunk, commit, needle):
    cache = KVCache(CacheConfig("bf16", layout="BLHD"), 1)
    with pytest.raises(ValueError, match=needle):
        chunk_attention(*_qkv(0), cache, layer=0, chunk=chunk, commit=commit)
    with pytest.raises(ValueError, match=needle):
        with ChunkedAttention(cache).at(chunk, commit):
            pass
    with pytest.raises(ValueError, match="KVCache"):
        chunk_attention(*_qkv(0), cache={}, layer=0, chunk=0)
