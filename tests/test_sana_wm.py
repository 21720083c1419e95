"""diffusers' SANA-WM stage-2 refiner, unmodified, over the QuantWM cache (quantwm.adapters.sana_wm).

A tiny random refiner (tests/tiny_sana.py) is saved with `save_pretrained` and loaded back in BF16 with
`SanaWMLTX2Refiner.from_pretrained`, as a user loads the released one; the stock pipeline is the reference.
"""
from __future__ import annotations

import pytest
import torch
from tiny_sana import tiny_sana_refiner

from quantwm.adapters.sana_wm import SanaWMCacheAdapter, sana_wm_kv_cache
from quantwm.core.cache import CacheConfig, KVCache

PROMPT = "a cat walks on the beach at dusk"


@pytest.fixture(scope="module")
def refiner(tmp_path_factory):
    from diffusers import SanaWMLTX2Refiner

    path = tmp_path_factory.mktemp("sana_wm_refiner")
    tiny_sana_refiner().save_pretrained(path)
    pipe = SanaWMLTX2Refiner.from_pretrained(path, dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def refine(pipe, stage1, cache=None):
    """The stock call (1 sink frame, blocks of 3, a window of 5 frames: the history trim cuts a block)."""
    def call():
        return pipe(stage1, PROMPT, fps=8.0, generator=torch.Generator().manual_seed(1), kv_max_frames=5,
                    output_type="latent")
    if cache is None:
        return call()
    with SanaWMCacheAdapter(pipe.transformer, cache):
        return call()


@pytest.fixture(scope="module")
def stage1():
    return torch.randn(1, 8, 13, 4, 4, generator=torch.Generator().manual_seed(0)).bfloat16()  # 1 sink + 4 blocks


def test_bf16_through_quantwm_equals_the_stock_refiner(refiner, stage1):
    reference = refine(refiner, stage1)
    cache = sana_wm_kv_cache(refiner.transformer, CacheConfig("bf16", sink_chunks=0))
    out = refine(refiner, stage1, cache)
    assert out.dtype == torch.bfloat16 and torch.equal(out, reference)
    # The window holds 4 frames (64 tokens) of history: blocks 2 and 3 (the trim cut block 2) plus block 4, the
    # last captured, not yet committed; block 1 was evicted.
    assert [s.index for s in cache.spans(0)] == [1, 2, 3] and cache.seq_len(0) == 3 * 48
    assert not torch.allclose(cache.query_stats(0).float(), torch.eye(64).expand(2, 64, 64))  # queries observed


def test_quantwm_refines_close_to_bf16_in_fewer_bytes(refiner, stage1):
    reference = refine(refiner, stage1)
    bf16 = sana_wm_kv_cache(refiner.transformer, CacheConfig("bf16", sink_chunks=0))
    refine(refiner, stage1, bf16)
    cache = sana_wm_kv_cache(refiner.transformer, CacheConfig("quantwm", sink_chunks=0))
    out = refine(refiner, stage1, cache)
    err = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
    assert 0 < err < 0.1
    assert any(s.quantized for s in cache.spans(0)) and cache.nbytes() < bf16.nbytes()
    assert torch.equal(out[:, :, :4], reference[:, :, :4])  # the sink and block 1 see no quantized history


def test_the_processors_are_restored_and_bad_input_is_refused(refiner):
    before = [b.attn1.processor for b in refiner.transformer.transformer_blocks]
    with SanaWMCacheAdapter(refiner.transformer, sana_wm_kv_cache(refiner.transformer)):
        assert all(b.attn1.processor is not p for b, p in zip(refiner.transformer.transformer_blocks, before))
    assert [b.attn1.processor for b in refiner.transformer.transformer_blocks] == before
    with pytest.raises(ValueError, match="one per block"):
        SanaWMCacheAdapter(refiner.transformer, KVCache(CacheConfig(layout="BLHD"), n_layers=5))
    with pytest.raises(ValueError, match="layout='BLHD', rope='post'"):
        SanaWMCacheAdapter(refiner.transformer, KVCache(CacheConfig(), n_layers=2))
    with pytest.raises(ValueError, match="expected a SanaWMLTX2RefinerTransformer3DModel"):
        SanaWMCacheAdapter(torch.nn.Linear(2, 2), sana_wm_kv_cache(refiner.transformer))
