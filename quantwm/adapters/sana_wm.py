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

With a `ProbeCapture`, the last denoising pass of every block records each query's top-1 cached key (sink and
history) under exact and stored keys, the logits asked for, and the latent token each cached key holds
(`positions`, per block): `record_sana_wm` turns both runs into a run file for the app.

In BF16 the refined latents are bit-identical to the stock pipeline's (tests/test_sana_wm.py, a tiny random
refiner saved and loaded with `save_pretrained` / `from_pretrained`). The stock pipeline needs `transformers`
(its Gemma-3 text encoder).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from ..core.cache import CacheConfig, KVCache
from .self_forcing import ProbeCapture, check_logit_picks

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
                                 self.adapter.cache.next_chunk(self.layer))
        self.adapter.pending[self.layer] = key.shape[1]
        marker = key.new_empty(*key.shape[:2], 0)  # token count only: no bytes, no hold on the block's K/V
        self.stock.store_captured_post_rope(marker, marker)

    def history_tokens(self) -> int:
        """N: the history tokens the pipeline keeps for this window (its zero-width marker's length)."""
        marker = self.stock.get_history()
        return 0 if marker is None else marker[0].shape[1]

    def get_history(self):
        """The last N committed tokens (N: `history_tokens`), decoded in the captured keys' dtype; older spans
        are evicted."""
        marker = self.stock.get_history()
        if marker is None:
            return None
        n, pending = marker[0].shape[1], self.adapter.pending[self.layer]
        cache = self.adapter.cache
        committed = cache.inspect(self.layer)[:-1] if pending else cache.inspect(self.layer)
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
        if kv_cache_mode == "capture_pre_rope" and (self.adapter.pending[self.layer] or
                                                    self.adapter.cache.seq_len(self.layer)):
            raise ValueError("this QuantWM cache already holds a refinement: one pipeline call per cache "
                             "(adapter.reset() empties it)")
        self.adapter.commit_pending(self.layer)  # the block captured last time is history now
        view = _LayerView(kv_cache, self.adapter, self.layer, attn.heads)
        hook = None
        if kv_cache_mode in ATTENDING_MODES:
            rotate = self.adapter.rope_function(attn.rope_type)

            def observe(_module, _inputs, query):  # normed queries (B, N, H·D), before the block's K/V is written
                q = rotate(query, query_rotary_emb).unflatten(2, (attn.heads, -1))
                self.adapter.cache.observe(self.layer, q)
                if self.adapter.probe is not None and kv_cache_mode == "inject":
                    self.adapter.probe_pass(self.layer, q, view, sink_rotary_emb, rotate)
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

    def __init__(self, transformer, cache: KVCache, probe: ProbeCapture | None = None):
        blocks = getattr(transformer, "transformer_blocks", None)
        if blocks is None or not all(hasattr(b, "attn1") for b in blocks):
            raise ValueError(f"expected a SanaWMLTX2RefinerTransformer3DModel, got {type(transformer).__name__}")
        if not isinstance(cache, KVCache) or cache.n_layers != len(blocks):
            raise ValueError(f"the cache must be a KVCache with {len(blocks)} layers (one per block); use "
                             "sana_wm_kv_cache(transformer, config)")
        if cache.config.layout != "BLHD" or cache.config.rope != "post":
            raise ValueError("the refiner's history is post-RoPE (B, N, H, D): the cache needs layout='BLHD', rope='post'")
        if probe is not None and not cache.config.keep_exact and (cache.quantize_k or cache.quantize_v):
            raise ValueError("probes compare exact and stored keys: the cache needs CacheConfig(keep_exact=True)")
        self.transformer, self.cache, self.probe = transformer, cache, probe
        self.positions: dict[int, torch.Tensor] = {}  # block -> latent token of each key its queries attend to
        self.pending = [0] * len(blocks)  # tokens of the captured, not yet committed block, per layer
        self._saved: list | None = None
        module = __import__(type(transformer).__module__, fromlist=["_"])
        self._rope = {"interleaved": module.apply_interleaved_rotary_emb, "split": module.apply_split_rotary_emb}

    def rope_function(self, rope_type: str):
        if rope_type not in self._rope:
            raise ValueError(f"unsupported RoPE type {rope_type!r}; the refiner uses {', '.join(self._rope)}")
        return self._rope[rope_type]

    def probe_pass(self, layer: int, q: torch.Tensor, view: _LayerView, sink_rope, rotate) -> None:
        """Top-1 keys of a denoising pass's queries q (B, N, H, D) over [sink, history], exact vs stored."""
        chunk, heads = self.cache.next_chunk(layer), q.shape[2]
        exact, stored, pos = [], [], []
        sink = view.get_sink()
        if sink is not None:  # the stock processor re-RoPEs the sink for this window; so do the probes
            k = rotate(sink[0].to(q.dtype), sink_rope).unflatten(2, (heads, -1))[0].transpose(0, 1).float()
            exact.append(k), stored.append(k), pos.append(torch.arange(k.shape[1]))
        sink_tokens = exact[0].shape[1] if exact else 0
        n = view.history_tokens()
        if n:
            exact.append(self.cache.keys(layer, exact=True)[0, -n:].transpose(0, 1).float())  # (H, n, D)
            stored.append(self.cache.keys(layer)[0, -n:].transpose(0, 1).float())
            pos.append(sink_tokens + self.cache.positions(layer)[-n:])  # refined blocks follow the sink
        if not exact:
            return
        qh = q[0].transpose(0, 1).float()  # (H, N, D)
        scale = qh.shape[-1] ** -0.5
        bias = self.cache.logit_bias(layer, qh[None], scale) if n else None  # +jensen: stored history keys only
        if bias is not None:
            bias = torch.cat([bias.new_zeros(heads, qh.shape[1], sink_tokens), bias[0, :, :, -n:]], -1)
        self.probe.record(layer, chunk, qh, torch.cat(exact, 1), torch.cat(stored, 1), scale, bias)
        self.positions[chunk] = torch.cat(pos)

    def commit_pending(self, layer: int) -> None:
        if self.pending[layer]:
            self.cache.commit(layer, self.cache.next_chunk(layer))
            self.pending[layer] = 0

    def reset(self) -> None:
        """An empty cache for the next pipeline call."""
        self.cache.reset()
        self.pending = [0] * self.cache.n_layers
        self.positions = {}

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


def _decode(vae, latents: torch.Tensor) -> torch.Tensor:
    """Refined latents (1, C, F, H, W) -> output frames (T, H', W', 3) uint8, as the refiner pipeline decodes."""
    mean = vae.latents_mean.view(1, -1, 1, 1, 1).to(latents)
    std = vae.latents_std.view(1, -1, 1, 1, 1).to(latents)
    x = (latents / vae.config.scaling_factor * std + mean).to(next(vae.parameters()).dtype)
    with torch.no_grad():
        video = vae.decode(x, return_dict=False)[0]  # (1, 3, T, H', W') in [-1, 1]
    return ((video[0].permute(1, 2, 3, 0).float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu()


def load_stage1_latents(path: str | Path) -> torch.Tensor:
    """Stage-1 latents (1, C, F, H, W) from a safetensors file holding `latents` (SanaWMPipeline's latent output)."""
    from safetensors.torch import load_file

    try:
        z = load_file(str(path))["latents"]
    except Exception as err:  # noqa: BLE001 - any unreadable file is the same user error
        raise ValueError(f"{path}: no latents in a safetensors file ({str(err).splitlines()[0][:100]})") from None
    if z.dim() == 4:
        z = z[None]
    if z.dim() != 5 or z.shape[0] != 1 or not torch.isfinite(z).all():
        raise ValueError(f"{path}: latents must be finite (1, C, F, H, W), got {tuple(z.shape)}")
    return z


def record_sana_wm(base, latents, prompt: str, method: str = "quantwm", target: str = "kv", bits: int = 2,
                   seed: int = 42, logit_layers=(), logit_heads=(), device: str = "cpu", block_size: int = 3,
                   kv_max_frames: int = 11, sink_size: int = 1, fps: float = 16.0, progress: Callable | None = None,
                   pipe=None):
    """The run file contents (`runfile.Run`) of SANA-WM's refiner with `method`'s cache against BF16, from the
    same stage-1 latents and noise. `base`: a `SanaWMLTX2Refiner` folder with a vae; `pipe`: one already loaded."""
    from ..evaluation.runfile import Run, RunFacts, memory_meta

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device on this machine")
    if pipe is None:
        from diffusers import SanaWMLTX2Refiner

        if not (Path(base) / "model_index.json").is_file():
            raise ValueError(f"{base}: not a diffusers SanaWMLTX2Refiner folder (no model_index.json)")
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        pipe = SanaWMLTX2Refiner.from_pretrained(str(base), dtype=dtype).to(device)
    if getattr(pipe, "vae", None) is None:
        raise ValueError(f"{base}: the refiner has no vae (AutoencoderKLLTX2Video); a run needs decoded frames")
    z = load_stage1_latents(latents) if not torch.is_tensor(latents) else latents
    cfg = pipe.transformer.config
    C, F, H, W = z.shape[1:]
    if C != cfg.in_channels or H % cfg.patch_size or W % cfg.patch_size:
        raise ValueError(f"latents {tuple(z.shape)} do not fit the refiner ({cfg.in_channels} channels, patch "
                         f"{cfg.patch_size})")
    if kv_max_frames <= sink_size:
        raise ValueError(f"kv_max_frames ({kv_max_frames}) must exceed the sink ({sink_size}): the window holds the "
                         "sink and recent frames")
    if F < sink_size + 2 * block_size:
        raise ValueError(f"{F} latent frames: the refiner needs at least the sink ({sink_size}) and two blocks of "
                         f"{block_size}")
    layers, heads = cfg.num_layers, cfg.num_attention_heads
    check_logit_picks(layers, heads, logit_layers, logit_heads)

    def refine(config: CacheConfig, probe):
        cache = sana_wm_kv_cache(pipe.transformer, config)
        with SanaWMCacheAdapter(pipe.transformer, cache, probe) as adapter:
            out = pipe(z.to(device), prompt, fps=fps, sink_size=sink_size, block_size=block_size,
                       kv_max_frames=kv_max_frames, generator=torch.Generator(device=device).manual_seed(seed),
                       output_type="latent")
        return _decode(pipe.vae, out), cache, adapter.positions

    ref, _, _ = refine(CacheConfig("bf16", sink_chunks=0), None)
    if progress:
        progress(1, 2)
    probe = ProbeCapture(layers, logit_layers, logit_heads)
    frames, cache, positions = refine(CacheConfig(method, target=target, k_bits=bits, v_bits=bits, sink_chunks=0,
                                                  keep_exact=True, track_queries=True), probe)
    if progress:
        progress(2, 2)
    spatial, temporal = frames.shape[2] // (W // cfg.patch_size) // cfg.patch_size, (frames.shape[0] - 1) // (F - 1)
    facts = RunFacts("SANA-WM stage-2 refiner (LTX-2, diffusers SanaWMLTX2Refiner)", layers, heads,
                     cfg.attention_head_dim, (H // cfg.patch_size, W // cfg.patch_size), block_size, sink_size,
                     vae_spatial=spatial, patch=cfg.patch_size, vae_temporal=temporal, chunk_start=sink_size)
    stats = torch.stack([cache.query_stats(layer).float().cpu() for layer in range(layers)])
    top1 = probe.top1()
    meta = {"method": method, "target": target, "bits": bits, **memory_meta(cache.memory()),
            "logit_layers": list(logit_layers), "logit_heads": list(logit_heads),
            "source": {"base": str(base), "latents": str(latents) if not torch.is_tensor(latents) else "tensor",
                       "prompt": prompt, "seed": seed, "block_size": block_size, "kv_max_frames": kv_max_frames,
                       "sink_size": sink_size, "fps": fps}}
    return Run(facts, meta, ref, frames, stats, top1, probe.logits(), {c: positions[c] for c in top1})
