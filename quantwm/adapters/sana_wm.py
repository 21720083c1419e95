"""QuantWM's cache inside diffusers' SANA-WM stage-2 refiner (`SanaWMLTX2Refiner`, diffusers 0.42.1), unmodified.

The refiner is chunk-causal. For each block of `block_size` latent frames it runs a few Euler steps that attend to
[sink, recent history, current block] (`kv_cache_mode="inject"`). A clean pass at σ=0 then captures the block's
post-RoPE K/V (`"inject_and_capture_post_rope"`), which the pipeline appends to each layer's history and trims to
`kv_max_frames - sink_size` frames (a trim that may cut inside a block).

`SanaWMCacheAdapter(transformer, cache)` swaps each block's self-attention processor for one that gives the stock
processor a view of the stock layer cache (`SanaWMRefinerKVLayerCache`):

* The captured post-RoPE K/V of a refined block is written into the QuantWM cache as one chunk, and committed
  when the next block starts (the capture pass itself still attends to the history without it). The stock
  layer cache keeps only a zero-width marker (B, N, 0), so the pipeline's own append and trim still count the
  tokens but hold no bytes.
* `get_history()` returns the last N tokens of the QuantWM cache, decoded (N is the marker's length). Spans that
  lie wholly before them are evicted.
* The sink stays in the stock cache in full precision (pre-RoPE; the stock processor re-RoPEs it for each
  window). SANA-WM's sink is the raw stage-1 frames, full precision by design, so the QuantWM cache holds the
  refined blocks only (make it with `sink_chunks=0`, as `sana_wm_kv_cache` does by default).
* The rotated queries of every pass feed S (`cache.observe`): a forward hook on `attn.norm_q` takes the normed
  queries, and the model's own RoPE function rotates them.

In BF16 the refined latents are bit-identical to the stock pipeline's (tests/test_sana_wm.py, a tiny random
refiner saved and loaded with `save_pretrained` / `from_pretrained`). The stock pipeline needs `transformers`
(its Gemma-3 text encoder).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ..core.cache import CacheConfig, KVCache

ATTENDING_MODES = ("inject", "inject_and_capture_post_rope")


def sana_wm_kv_cache(transformer, config: CacheConfig | None = None) -> KVCache:
    """A QuantWM cache for every block of a `SanaWMLTX2RefinerTransformer3DModel` (BLHD, post-RoPE keys; by
    default no sink chunk of its own: the refiner's sink stays in its stock cache)."""
    config = config or CacheConfig("quantwm", sink_chunks=0)
    return KVCache(replace(config, layout="BLHD", rope="post"), n_layers=len(transformer.transformer_blocks))


class _LayerView:
    """What the stock processor sees as its layer cache: the sink from the stock cache, the history from QuantWM."""

    def __init__(self, stock, adapter: SanaWMCacheAdapter, layer: int, heads: int):
        self.stock, self.adapter, self.layer, self.heads = stock, adapter, layer, heads

    def store_captured_pre_rope(self, key: torch.Tensor, value: torch.Tensor) -> None:
        self.stock.store_captured_pre_rope(key, value)  # the sink: kept in full precision by the stock cache

    def get_sink(self):
        return self.stock.get_sink()

    def store_captured_post_rope(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """A refined block's K/V (B, N, H·D): the QuantWM cache's current chunk (committed when the next block
        starts, after the pipeline has appended it to its history); a marker for the pipeline."""
        self.adapter.cache.write(self.layer, key.unflatten(2, (self.heads, -1)), value.unflatten(2, (self.heads, -1)),
                                 self.adapter.next_chunk[self.layer])
        self.adapter.pending[self.layer] = key.shape[1]
        self.stock.store_captured_post_rope(key[..., :0], value[..., :0])  # token count only, no bytes

    def get_history(self):
        """The last N committed tokens (N: the pipeline's history marker), decoded; older spans are evicted."""
        marker = self.stock.get_history()
        if marker is None:
            return None
        n, pending = marker[0].shape[1], self.adapter.pending[self.layer]
        cache = self.adapter.cache
        committed = cache.spans(self.layer)[:-1] if pending else cache.spans(self.layer)
        end = committed[-1].start + committed[-1].n_tokens
        for span in committed:  # the pipeline trimmed its history to the last n tokens: older spans go
            if span.start + span.n_tokens <= end - n:
                cache.evict_span(self.layer, span.index)
        dtype = marker[0].dtype
        k, v = cache.keys(self.layer), cache.values(self.layer)  # (B, L, H, D) float32, the pending chunk last
        L = k.shape[1] - pending
        return k[:, L - n:L].flatten(2).to(dtype), v[:, L - n:L].flatten(2).to(dtype)  # (B, n, H·D)


class QuantWMRefinerAttnProcessor:
    """The stock refiner self-attention processor over a QuantWM-backed view of its layer cache."""

    def __init__(self, stock, adapter: SanaWMCacheAdapter, layer: int):
        self.stock, self.adapter, self.layer = stock, adapter, layer

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, query_rotary_emb=None, key_rotary_emb=None,
                 sink_rotary_emb=None, kv_cache=None, kv_cache_mode: str | None = None) -> torch.Tensor:
        args = (attn, hidden_states, encoder_hidden_states, attention_mask, query_rotary_emb, key_rotary_emb)
        if kv_cache is None or kv_cache_mode is None:
            return self.stock(*args, sink_rotary_emb=sink_rotary_emb, kv_cache=kv_cache, kv_cache_mode=kv_cache_mode)
        self.adapter.commit_pending(self.layer)  # the block captured last time is history now
        view = _LayerView(kv_cache, self.adapter, self.layer, attn.heads)
        hook = None
        if kv_cache_mode in ATTENDING_MODES:
            rotate = self.adapter.rope_function(attn.rope_type)

            def observe(_module, _inputs, query):  # normed queries (B, N, H·D), before the block's K/V is written
                q = rotate(query, query_rotary_emb).unflatten(2, (attn.heads, -1))
                self.adapter.cache.observe(self.layer, q)
            hook = attn.norm_q.register_forward_hook(observe)
        try:
            return self.stock(*args, sink_rotary_emb=sink_rotary_emb, kv_cache=view, kv_cache_mode=kv_cache_mode)
        finally:
            if hook is not None:
                hook.remove()


class SanaWMCacheAdapter:
    """Runs the stock SANA-WM refiner over a QuantWM cache while inside the `with` block.

        cache = sana_wm_kv_cache(pipe.transformer, CacheConfig("quantwm", sink_chunks=0))
        with SanaWMCacheAdapter(pipe.transformer, cache):
            latents = pipe(stage1_latents, prompt, fps=16.0, output_type="latent")

    Leaving the block restores the original processors. One pipeline call per cache: `reset()` empties it."""

    def __init__(self, transformer, cache: KVCache):
        blocks = getattr(transformer, "transformer_blocks", None)
        if blocks is None or not all(hasattr(b, "attn1") for b in blocks):
            raise ValueError(f"expected a SanaWMLTX2RefinerTransformer3DModel, got {type(transformer).__name__}")
        if not isinstance(cache, KVCache) or cache.n_layers != len(blocks):
            raise ValueError(f"the cache must be a KVCache with {len(blocks)} layers (one per block); use "
                             "sana_wm_kv_cache(transformer, config)")
        if cache.config.layout != "BLHD" or cache.config.rope != "post":
            raise ValueError("the refiner's history is post-RoPE (B, N, H, D): the cache needs layout='BLHD', rope='post'")
        self.transformer, self.cache = transformer, cache
        self.next_chunk = [0] * len(blocks)
        self.pending = [0] * len(blocks)  # tokens of the captured, not yet committed block, per layer
        self._saved: list | None = None
        module = __import__(type(transformer).__module__, fromlist=["_"])
        self._rope = {"interleaved": module.apply_interleaved_rotary_emb, "split": module.apply_split_rotary_emb}

    def rope_function(self, rope_type: str):
        if rope_type not in self._rope:
            raise ValueError(f"unsupported RoPE type {rope_type!r}; the refiner uses {', '.join(self._rope)}")
        return self._rope[rope_type]

    def commit_pending(self, layer: int) -> None:
        if self.pending[layer]:
            self.cache.commit(layer, self.next_chunk[layer])
            self.next_chunk[layer] += 1
            self.pending[layer] = 0

    def reset(self) -> None:
        """An empty cache for the next pipeline call."""
        self.cache = KVCache(self.cache.config, self.cache.n_layers)
        self.next_chunk = [0] * self.cache.n_layers
        self.pending = [0] * self.cache.n_layers

    def __enter__(self) -> SanaWMCacheAdapter:
        blocks = self.transformer.transformer_blocks
        self._saved = [b.attn1.processor for b in blocks]
        for i, b in enumerate(blocks):
            b.attn1.set_processor(QuantWMRefinerAttnProcessor(self._saved[i], self, i))
        return self

    def __exit__(self, *exc) -> None:
        for b, processor in zip(self.transformer.transformer_blocks, self._saved):
            b.attn1.set_processor(processor)
        self._saved = None
