"""Block-causal, chunk-by-chunk generation of diffusers' WanTransformer3DModel over the QuantWM cache.

The Wan 2.1 transformer (diffusers 0.42.1 `WanTransformer3DModel`) is what Matrix-Game-2, Self-Forcing,
Causal-Forcing and LingBot-World build on. `WanCacheAdapter` swaps every block's self-attention
processor (`blocks[i].attn1`) for one that sends the chunk's Q/K/V through `chunk_attention`, and hooks
`model.rope` so the chunk's RoPE starts at its absolute latent frame (read from the cache: the tokens it
already holds). Cross-attention, norms and FFN are untouched; on exit the original processors return.

    cache = wan_kv_cache(model, CacheConfig("quantwm"))
    with WanCacheAdapter(model, cache) as wan:
        for i, latents in enumerate(chunks):                  # (B, C, F, H, W): one chunk's latent frames
            for t in timesteps:
                with wan.chunk(i):                            # denoising pass: attends to cache + itself
                    velocity = model(x, t, text).sample
            with wan.chunk(i, commit=True):                   # clean pass: writes chunk i's K/V, commits
                model(clean, t0, text)

`wan_block_causal` is the reference: one pass over the whole sequence with a block-causal mask (chunk c
sees chunks <= c), what the chunked clean passes must reproduce. A rope="pre" cache stores keys before
RoPE and rotates at read with quantwm.core.rope.Rope3D, which is Wan's 3-D RoPE (theta 10000, same channel
split and interleaved pairs). Known limits: self-attention only (I2V's image cross-attention is untouched
and fine); one chunk position per forward pass; the RoPE table bounds positions to `rope_max_seq_len` frames.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from ..core.cache import CacheConfig, KVCache
from ..core.rope import FrameShift, Rope3D
from .attention import ChunkedAttention
from .capture import TraceCapture


def _check_wan(model) -> None:
    blocks = getattr(model, "blocks", None)
    rope = getattr(model, "rope", None)
    if blocks is None or rope is None or not all(hasattr(b, "attn1") for b in blocks) or not hasattr(rope, "t_dim"):
        raise ValueError(f"expected a diffusers WanTransformer3DModel (blocks[i].attn1 and rope), got {type(model).__name__}")


def wan_kv_cache(model, config: CacheConfig | None = None, frame_grid: tuple[int, int] | None = None) -> KVCache:
    """A KVCache for `model` (default CacheConfig(): bf16), one layer per block. `frame_grid`, the latent token
    grid (h, w) per frame, is needed by rope="pre"; given with post-RoPE keys it also hands the cache the model's
    RoPE as a frame shift, so that the allocator re-aims S at the frames that read a span (docs/method.md §2.9)."""
    _check_wan(model)
    config = CacheConfig() if config is None else config
    rope = None
    if config.rope == "pre":
        if frame_grid is None:
            raise ValueError("rope='pre' rotates keys at read: pass frame_grid=(h, w), the tokens per latent frame")
        rope = Rope3D(model.rope.attention_head_dim, tuple(frame_grid))
    shift = None if frame_grid is None else wan_frame_shift(model.rope, frame_grid[0] * frame_grid[1])
    return KVCache(config, len(model.blocks), rope=rope, frame_shift=shift)


def wan_frame_shift(rope, tokens_per_frame: int) -> FrameShift:
    """The model's 3-D RoPE (a diffusers WanRotaryPosEmbed) as a `FrameShift`: its head dim, and its θ read off
    its temporal table (the second frequency θ^(-2/t_dim) is the angle at frame 1)."""
    angle = torch.acos(rope.freqs_cos[1, 2].double().clamp(-1, 1))
    theta = float(angle ** (-rope.t_dim / 2))
    theta = float(round(theta)) if abs(theta - round(theta)) < 1e-5 * theta else theta  # the table's fp32 rounding
    return FrameShift(rope.attention_head_dim, tokens_per_frame, theta)


def wan_qkv(attn, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """WanAttention self-attention projections: (B, L, dim) -> q, k, v (B, L, H, D), normed, pre-RoPE."""
    if getattr(attn, "fused_projections", False):
        q, k, v = attn.to_qkv(hidden_states).chunk(3, dim=-1)
    else:
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
    q, k = attn.norm_q(q), attn.norm_k(k)
    return tuple(x.unflatten(2, (attn.heads, -1)) for x in (q, k, v))


def wan_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's RoPE: rotate channel pairs (2i, 2i+1) of x (B, L, H, D) by cos/sin (1, L, 1, D) (interleaved)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], -1).flatten(-2).type_as(x)


def wan_rope_at(rope, hidden_states: torch.Tensor, frame_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """WanRotaryPosEmbed.forward for latents (B, C, F, H, W) whose first frame is frame `frame_offset`."""
    _, _, n_frames, height, width = hidden_states.shape
    p_t, p_h, p_w = rope.patch_size
    ppf, pph, ppw = n_frames // p_t, height // p_h, width // p_w
    if frame_offset < 0 or frame_offset + ppf > rope.freqs_cos.shape[0]:
        raise ValueError(f"frames {frame_offset}..{frame_offset + ppf - 1} exceed the RoPE table of "
                         f"{rope.freqs_cos.shape[0]} frames (rope_max_seq_len)")
    split = [rope.t_dim, rope.h_dim, rope.w_dim]
    out = []
    for table in (rope.freqs_cos, rope.freqs_sin):
        t, h, w = table.split(split, dim=1)
        parts = (t[frame_offset:frame_offset + ppf].view(ppf, 1, 1, -1).expand(ppf, pph, ppw, -1),
                 h[:pph].view(1, pph, 1, -1).expand(ppf, pph, ppw, -1),
                 w[:ppw].view(1, 1, ppw, -1).expand(ppf, pph, ppw, -1))
        out.append(torch.cat(parts, -1).reshape(1, ppf * pph * ppw, 1, -1))
    return out[0], out[1]


def _grid(model, hidden_states: torch.Tensor) -> tuple[int, int, int]:
    """Latents (B, C, F, H, W) -> token grid (frames, h, w) after patching."""
    p_t, p_h, p_w = model.rope.patch_size
    _, _, f, h, w = hidden_states.shape
    return f // p_t, h // p_h, w // p_w


class _CachedProcessor:
    """attn1 processor: the chunk's Q/K/V go through the adapter's ChunkedAttention."""

    def __init__(self, adapter: WanCacheAdapter, layer: int):
        self.adapter, self.layer = adapter, layer

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if encoder_hidden_states is not None or attention_mask is not None or rotary_emb is None:
            raise ValueError("the QuantWM Wan processor serves self-attention with RoPE, no mask")
        q, k, v = wan_qkv(attn, hidden_states)  # (B, L, H, D)
        q = wan_rotate(q, *rotary_emb)
        cache = self.adapter.attention.cache
        if cache.config.rope == "post":
            k = wan_rotate(k, *rotary_emb)
        if cache.config.layout == "BHLD":
            q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        out = self.adapter.attention(self.layer, q, k, v)
        if cache.config.layout == "BHLD":
            out = out.transpose(1, 2)
        out = out.flatten(2, 3).type_as(q)  # (B, L, H*D)
        return attn.to_out[1](attn.to_out[0](out))


class _BlockCausalProcessor:
    """attn1 processor for the reference: the whole sequence, chunk c attending to chunks <= c."""

    def __init__(self, state: dict):
        self.state = state

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        q, k, v = wan_qkv(attn, hidden_states)
        q, k = wan_rotate(q, *rotary_emb), wan_rotate(k, *rotary_emb)
        chunk_tokens = self.state["frames_per_chunk"] * self.state["tokens_per_frame"]
        ids = torch.arange(q.shape[1], device=q.device) // chunk_tokens
        mask = ids[:, None] >= ids[None, :]  # (L, L) True = may attend
        out = F.scaled_dot_product_attention(*(x.transpose(1, 2).float() for x in (q, k, v)), attn_mask=mask)
        out = out.transpose(1, 2).flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


@contextmanager
def _processors(model, make) -> Iterator[None]:
    """Install make(layer) on every block's attn1; restore the originals on exit."""
    originals = [b.attn1.processor for b in model.blocks]
    try:
        for i, b in enumerate(model.blocks):
            b.attn1.set_processor(make(i))
        yield
    finally:
        for b, p in zip(model.blocks, originals):
            b.attn1.set_processor(p)


class WanCacheAdapter:
    """Context manager: `model` generates chunk by chunk over `cache`; see the module docstring."""

    def __init__(self, model, cache: KVCache, capture: TraceCapture | None = None):
        _check_wan(model)
        if not isinstance(cache, KVCache):
            raise ValueError(f"cache must be a quantwm KVCache, got {type(cache).__name__}")
        if cache.n_layers != len(model.blocks):
            raise ValueError(f"the cache has {cache.n_layers} layers, the model {len(model.blocks)} blocks "
                             "(build it with wan_kv_cache(model, config))")
        self.model, self.attention = model, ChunkedAttention(cache, capture)
        self.grid: tuple[int, int, int] | None = None  # (frames, h, w) tokens of the last pass
        self._stack = None

    def _rope_hook(self, module, args, output):
        hidden_states = args[0]
        self.grid = _, h, w = _grid(self.model, hidden_states)
        cache, capture = self.attention.cache, self.attention.capture
        if isinstance(cache.rope, Rope3D) and cache.rope.grid != (h, w):
            raise ValueError(f"the latents have {h}x{w} tokens per frame, the pre-RoPE cache was built for "
                             f"{cache.rope.grid[0]}x{cache.rope.grid[1]}")
        if capture is not None and capture.frame_grid is None:
            capture.frame_grid = (h, w)
        start = cache.next_token(0)
        if start % (h * w):
            raise ValueError(f"the cache holds {start} tokens, not whole frames of {h}x{w} tokens")
        return wan_rope_at(module, hidden_states, start // (h * w))

    def __enter__(self) -> WanCacheAdapter:
        from contextlib import ExitStack

        stack = ExitStack()
        stack.enter_context(_processors(self.model, lambda i: _CachedProcessor(self, i)))
        stack.callback(self.model.rope.register_forward_hook(self._rope_hook).remove)
        self._stack = stack
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        self._stack = None

    def chunk(self, index: int, commit: bool = False):
        """Context manager: the passes inside are chunk `index`'s (commit=True: the clean pass)."""
        if self._stack is None:
            raise ValueError("enter the adapter first: `with WanCacheAdapter(model, cache) as wan:`")
        return self.attention.at(index, commit)


@contextmanager
def wan_block_causal(model, frames_per_chunk: int) -> Iterator[None]:
    """Reference: inside, a forward pass over all latent frames attends block-causally by chunks of
    `frames_per_chunk` latent frames (post-patch), the mask Self-Forcing-style models train with."""
    _check_wan(model)
    if isinstance(frames_per_chunk, bool) or not isinstance(frames_per_chunk, int) or frames_per_chunk < 1:
        raise ValueError(f"frames_per_chunk must be a positive int, got {frames_per_chunk!r}")
    state = {"frames_per_chunk": frames_per_chunk}

    def hook(module, args, output):
        _, h, w = _grid(model, args[0])
        state["tokens_per_frame"] = h * w

    handle = model.rope.register_forward_hook(hook)
    try:
        with _processors(model, lambda i: _BlockCausalProcessor(state)):
            yield
    finally:
        handle.remove()
