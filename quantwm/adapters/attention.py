"""The generic entry for models that call their own attention: q, k, v, chunk position, cache -> output.

Repositories of the Self-Forcing family (Self-Forcing, Causal-Forcing, Matrix-Game-2, LingBot-World)
keep a dict of preallocated [B, L, H, D] K/V tensors per block and call flash-attn on a slice of it.
Replacing that slice-and-attend with one call hands the K/V to the QuantWM cache instead:

    cache = KVCache(CacheConfig("quantwm", layout="BLHD"), n_layers=30)
    out = chunk_attention(roped_q, roped_k, v, cache, layer=block_index, chunk=i)               # denoising pass
    out = chunk_attention(roped_q, roped_k, v, cache, layer=block_index, chunk=i, commit=True)  # clean pass

`ChunkedAttention` bundles the cache with where generation stands (chunk, commit) so a pipeline sets
the position once per forward pass (`with attn.at(i, commit=True): model(...)`) and every layer calls
`attn(layer, q, k, v)`. A `TraceCapture` passed to either records Q/K/V for the analysis tools.
docs/self_forcing.md is the worked example. Known limits: one chunk position per forward pass (the whole
batch is at the same chunk); positions in the cache are token offsets, so RoPE frame offsets are the
caller's job (the diffusers adapter does it for Wan).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ..core.cache import KVCache
from .capture import TraceCapture


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, layer: int, chunk: int,
                    commit: bool = False, scale: float | None = None,
                    capture: TraceCapture | None = None) -> torch.Tensor:
    """Attention of one chunk's queries to the cache plus the chunk itself, through the QuantWM cache.

    q, k, v: the chunk's tensors in the cache's layout, (B, L, H, D) for CacheConfig(layout="BLHD") or
    (B, H, L, D) for "BHLD"; q post-RoPE, k post-RoPE (or pre-RoPE for a rope="pre" cache).
    chunk: the chunk's index (0, 1, ...); every denoising pass of chunk i overwrites chunk i's K/V.
    commit: True on the clean pass: after attending, chunk i joins the history (and older chunks leaving
    the full-precision set are quantized). scale: softmax scale (default D**-0.5).
    Returns the attention output (same layout and dtype as q).
    """
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
        raise ValueError(f"chunk must be a non-negative int, got {chunk!r}")
    if not isinstance(commit, bool):
        raise ValueError(f"commit must be True or False, got {commit!r}")
    if not isinstance(cache, KVCache):
        raise ValueError(f"cache must be a quantwm KVCache, got {type(cache).__name__}")
    out = cache.attend(layer, q, k, v, chunk=chunk, commit=commit, scale=scale)
    if capture is not None:
        D = q.shape[-1]
        capture.observe(cache, layer, chunk, commit, q, D ** -0.5 if scale is None else float(scale))
    return out


class ChunkedAttention:
    """A KVCache plus where generation stands (chunk, commit): what each layer's attention call needs.

        attn = ChunkedAttention(cache)
        with attn.at(chunk=2):               # a denoising pass of chunk 2
            model(x)                         # inside, every layer calls attn(layer, q, k, v)
        with attn.at(chunk=2, commit=True):  # the clean pass commits chunk 2
            model(clean)
    """

    def __init__(self, cache: KVCache, capture: TraceCapture | None = None):
        if not isinstance(cache, KVCache):
            raise ValueError(f"cache must be a quantwm KVCache, got {type(cache).__name__}")
        if capture is not None and not isinstance(capture, TraceCapture):
            raise ValueError(f"capture must be a TraceCapture or None, got {type(capture).__name__}")
        self.cache, self.capture = cache, capture
        self.chunk: int | None = None
        self.commit = False

    @contextmanager
    def at(self, chunk: int, commit: bool = False) -> Iterator[ChunkedAttention]:
        """Set the chunk position and commit mode for the passes run inside; restored on exit."""
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
            raise ValueError(f"chunk must be a non-negative int, got {chunk!r}")
        if not isinstance(commit, bool):
            raise ValueError(f"commit must be True or False, got {commit!r}")
        if self.chunk is not None:
            raise ValueError(f"already at chunk {self.chunk}: chunk positions do not nest")
        self.chunk, self.commit = chunk, commit
        try:
            yield self
        finally:
            self.chunk, self.commit = None, False

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float | None = None) -> torch.Tensor:
        """chunk_attention at the current position (q, k, v in the cache's layout)."""
        if self.chunk is None:
            raise ValueError("no chunk position set: run the model inside `with attention.at(chunk, commit=...)`")
        return chunk_attention(q, k, v, self.cache, layer, self.chunk, self.commit, scale, self.capture)
