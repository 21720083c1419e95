"""LongCat-Video's video continuation (FastVideo's `LongCatTransformer3DModel`, fastvideo/models/dits/longcat.py)
over QuantWM's cache.

FastVideo's continuation pipeline (pipelines/basic/longcat/longcat_vc_pipeline.py) runs the conditioning latents
once through the DiT at t = 0 with `return_kv=True` (`LongCatKVCacheInitStage`): every block hands back its
conditioning keys (after the per-head RMS norm, before RoPE) and values, and every denoising step of the new
segment reads them beside its own K/V (`LongCatSelfAttention.forward_with_kv_cache`, RoPE over conditioning plus
segment, the segment's frames after the conditioning's). Here the conditioning K/V are QuantWM's committed chunks
0..n-1 (`chunk` latent frames each, written and committed once, in the conditioning pass: the method quantizes them
then, `sink_chunks=0, recent_chunks=0`); the segment is chunk n, written by every denoising step and never
committed (FastVideo's pipeline makes one segment per call and rebuilds the cache from the next call's
conditioning). The conditioning pass itself attends among the conditioning frames as FastVideo does (its own
forward); the queries it makes are the only ones that exist when the cache is built, so they are the method's S.

Keys are stored after RoPE by default: the conditioning frames sit at frames 0..n_cond-1 at every step, so their
rotation never changes and rotating once at write reads the same as FastVideo's rotation at every step; a
`CacheConfig(rope="pre")` cache stores them as FastVideo does, before RoPE, given `key_rope(model)`.
The loop is FastVideo's distilled setting (guidance 1.0: no CFG pass), FlowMatchEuler steps on the negated
prediction. For a tiny run the conditioning latents and the text embedding are drawn from the seed (no VAE, no
UMT5). Block-sparse attention is off: the tiny config keeps `enable_bsa=False` (BSA is a CUDA kernel, and
FastVideo's continuation pipeline turns it off unless asked); the real model's cache-reading steps are dense
(`forward_with_kv_cache` calls SDPA) whatever BSA says.
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from types import SimpleNamespace

import torch

from ..attention import ChunkedAttention
from . import runtime
from .base import FastVideoModel, Plan, Rollout, at, check_chunk, read_map, swapped_forwards

MODULE = "fastvideo.models.dits.longcat"
TEXT_TOKENS = 8  # a tiny run's text length (the real pipeline pads UMT5's output to 512)
STEPS = 3  # denoising steps of a tiny run (the distilled continuation model takes 16)


class LongCatVideo(FastVideoModel):
    name = "longcat-video"
    title = "LongCat-Video"
    class_name = "LongCatTransformer3DModel"
    model_module = MODULE
    config_path = "fastvideo.configs.models.dits.longcat:LongCatVideoConfig"
    source = "fastvideo/models/dits/longcat.py"
    latent_channels = 16
    vae_spatial = 8
    patch = 2
    flash = ()  # LongCat calls FastVideo's attention layers and SDPA, no flash-attn directly
    cond_frames = 4  # conditioning latent frames: FastVideo's default 13 video frames, 1 + (13 - 1) // 4
    chunk = 2  # latent frames per conditioning chunk (QuantWM quantizes a chunk as one span)
    default_frames = 6  # a tiny run: 4 conditioning frames, a 2-frame segment

    def tiny_arch(self) -> dict:
        return dict(hidden_size=64, depth=2, num_attention_heads=2, caption_channels=32, adaln_tembed_dim=32,
                    frequency_embedding_size=32, mlp_ratio=2, enable_bsa=False)

    def shape(self, model) -> tuple[int, int, int]:
        a = self.arch(model)
        return a.depth, a.num_attention_heads, a.hidden_size // a.num_attention_heads

    def chunk_frames(self, model) -> int:
        return self.chunk

    def tiny_plan(self, latent_frames: int | None, seed: int) -> Plan:
        return Plan(latent_frames or self.default_frames, self.chunk, (8, 8), seed)

    def cache_config(self, model, notes: list[str] | None = None, **kw):
        """The conditioning chunks are quantized as they are committed (no sink, no recent window); LongCat keeps
        no window of its own."""
        return super().cache_config(model, notes, **{"recent_chunks": 0, **kw})

    def key_rope(self, model) -> GridRope:
        """The rope a CacheConfig(rope="pre") cache needs (keys stored before RoPE, as FastVideo stores them); the
        default post-RoPE cache ignores it."""
        return GridRope(model.blocks[0].self_attn.rope_3d)

    # ---- the generation loop -------------------------------------------------------------------------
    def _inputs(self, model, plan: Plan, device) -> dict:
        a = self.arch(model)
        g = torch.Generator().manual_seed(plan.seed)
        h, w = plan.latent_hw
        cond = torch.randn(1, a.in_channels, self.cond_frames, h, w, generator=g)  # the VAE's conditioning latents
        noise = torch.randn(1, a.in_channels, plan.latent_frames - self.cond_frames, h, w, generator=g)
        text = torch.randn(1, TEXT_TOKENS, a.caption_channels, generator=g)  # UMT5's output, shape only
        return self.given({"latents": torch.cat([cond, noise], 2).to(device), "text": text.to(device)}, plan)

    def check_plan(self, plan: Plan) -> None:
        if self.cond_frames % plan.chunk_frames or plan.latent_frames <= self.cond_frames:
            raise ValueError(f"{self.title}: {self.cond_frames} conditioning frames in {plan.chunk_frames}-frame "
                             f"chunks and at least one frame to generate; got {plan.latent_frames} latent frames")

    def rollout(self, model, plan: Plan, attn: ChunkedAttention | None, progress: Callable | None = None) -> Rollout:
        self.check_plan(plan)
        device = next(model.parameters()).device
        sched_mod = runtime.module("fastvideo.models.schedulers.scheduling_flow_match_euler_discrete")
        scheduler = sched_mod.FlowMatchEulerDiscreteScheduler()
        scheduler.set_timesteps(STEPS, device=device)
        init_stage = runtime.module("fastvideo.pipelines.stages.longcat_kv_cache_init").LongCatKVCacheInitStage
        set_forward_context = runtime.module("fastvideo.forward_context").set_forward_context
        inp = self._inputs(model, plan, device)
        batch = SimpleNamespace(latents=inp["latents"], num_cond_latents=self.cond_frames)
        args = SimpleNamespace(pipeline_config=SimpleNamespace(use_kv_cache=True, offload_kv_cache=False))
        n_chunks = self.cond_frames // plan.chunk_frames  # the segment is QuantWM's chunk n_chunks
        cache_map = []
        with torch.no_grad(), runtime.on_cpu(model, self.flash), ExitStack() as stack:
            if attn is not None:
                stack.enter_context(self.hooks(model, attn, plan))
            init_stage(model).forward(batch, args)  # FastVideo's conditioning pass: K/V of every block
            if attn is not None:
                entry = read_map(attn.cache, n_chunks, plan.chunk_frames)
                entry["frames"] = list(range(self.cond_frames, plan.latent_frames))
                entry["read"]["conditioning"] = list(range(self.cond_frames))
                cache_map.append(entry)
            latents = batch.latents  # the segment's noise (the conditioning is in the cache)
            for i, t in enumerate(scheduler.timesteps):  # LongCatVCDenoisingStage's loop, guidance 1.0
                x = latents.to(torch.bfloat16)
                timestep = t.expand(x.shape[0]).to(torch.bfloat16).unsqueeze(-1).repeat(1, x.shape[2])
                with set_forward_context(current_timestep=i, attn_metadata=None, forward_batch=batch), \
                        at(attn, n_chunks):
                    pred = model(hidden_states=x, encoder_hidden_states=inp["text"], timestep=timestep,
                                 num_cond_latents=self.cond_frames, kv_cache_dict=batch.kv_cache_dict)
                latents = scheduler.step(-pred, t, latents, return_dict=False)[0]
                if progress:
                    progress(i + 1, STEPS)
        out = torch.cat([batch.cond_latents, latents], 2)[0].float().cpu()  # conditioning put back, as FastVideo
        return Rollout(out, cache_map, context_frames=self.cond_frames)

    def hooks(self, model, attn: ChunkedAttention, plan: Plan):
        """Each block's self-attention through `attn`: the conditioning pass commits the conditioning K/V as chunks
        0..n-1; a denoising step attends the segment's queries to them and its own K/V (chunk n)."""
        h, w = (n // self.patch for n in plan.latent_hw)
        frame_tokens = h * w
        chunk_tokens = plan.chunk_frames * frame_tokens
        cache = attn.cache
        pre = cache.config.rope == "pre"
        if pre:
            if not isinstance(cache.rope, GridRope):
                raise ValueError("a rope='pre' cache for LongCat needs KVCache(..., rope=spec.key_rope(model))")
            cache.rope.grid = (h, w)

        def rotated(mod, q, k, start: int, grid):
            """q, k (B, heads, N, D) rotated as frames start.. of the (T, h, w) grid `grid` ends."""
            pad = q.new_zeros(q.shape[0], q.shape[1], start * frame_tokens, q.shape[3])
            rq, rk = mod.rope_3d(torch.cat([pad, q], 2), torch.cat([pad, k], 2), grid_size=grid)
            return rq[:, :, -q.shape[2]:], rk[:, :, -k.shape[2]:]

        def qkv(mod, x):
            B, N, _ = x.shape
            q = mod.q_norm(mod.to_q(x)[0].view(B, N, mod.num_heads, mod.head_dim))
            k = mod.k_norm(mod.to_k(x)[0].view(B, N, mod.num_heads, mod.head_dim))
            return q.transpose(1, 2), k.transpose(1, 2), mod.to_v(x)[0].view(B, N, mod.num_heads, mod.head_dim)

        def make_cond(layer: int, mod):
            own = type(mod).forward

            def forward(x, latent_shape, num_cond_latents=0, return_kv=False, **kw):
                if not return_kv or num_cond_latents or attn.chunk is not None:
                    raise ValueError("QuantWM's LongCat path runs the DiT on the segment with the conditioning "
                                     "in the cache (FastVideo's continuation with use_kv_cache)")
                out, (k, v) = own(mod, x, latent_shape, return_kv=True)  # FastVideo's attention among the frames
                if cache.tracks_queries:  # the conditioning pass's queries: the method's S
                    q, _ = rotated(mod, *qkv(mod, x)[:2], 0, tuple(latent_shape))
                    cache.observe(layer, q.transpose(1, 2))
                if not pre:
                    _, k = mod.rope_3d(k, k, grid_size=tuple(latent_shape))
                k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, N, D) -> (B, N, heads, D)
                for c in range(k.shape[1] // chunk_tokens):
                    sl = slice(c * chunk_tokens, (c + 1) * chunk_tokens)
                    cache.write(layer, k[:, sl], v[:, sl], c)
                    cache.commit(layer, c)
                empty = k.new_zeros(0)
                return out, (empty, empty)  # FastVideo's dict holds placeholders: the K/V live in QuantWM's cache
            return forward

        def make_step(layer: int, mod):
            def forward_with_kv_cache(x, latent_shape, num_cond_latents, kv_cache):
                B, N, C = x.shape
                T = latent_shape[0]
                check_chunk(attn, num_cond_latents * frame_tokens, chunk_tokens)
                q, k, v = qkv(mod, x)
                rq, rk = rotated(mod, q, k, num_cond_latents, (num_cond_latents + T, *latent_shape[1:]))
                out = attn(layer, rq.transpose(1, 2), (k if pre else rk).transpose(1, 2), v)
                return mod.to_out(out.reshape(B, N, C))[0]
            return forward_with_kv_cache

        modules = [blk.self_attn for blk in model.blocks]
        stack = ExitStack()
        stack.enter_context(swapped_forwards(modules, make_cond))
        stack.enter_context(swapped_forwards(modules, make_step, "forward_with_kv_cache"))
        return stack


class GridRope:
    """rope(x, positions, inverse=False): x (B, H, N, D) rotated at absolute token positions by LongCat's own 3-D RoPE
    table (`RotaryPositionalEmbedding3D.precompute_freqs_3d`), a token's frame, row and column read from the
    patched latent grid (h, w) that the attention hook sets in `grid` before a rollout."""

    def __init__(self, rope3d):
        self.rope3d, self.grid = rope3d, None

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        if self.grid is None:
            raise ValueError("GridRope has no grid yet: LongCatVideo's attention hook sets it")
        h, w = self.grid
        frames = int(positions.max()) // (h * w) + 1  # one host read per call (the table's length)
        freqs = self.rope3d.precompute_freqs_3d((frames, h, w)).to(x.device)[positions.long()]  # (N, D)
        cos, sin = freqs.cos(), freqs.sin()
        if inverse:
            sin = -sin
        xf = x.float()  # FastVideo rotates in float32 and casts back
        rotate_half = runtime.module("fastvideo.layers.rotary_embedding_3d").rotate_half
        return (xf * cos + rotate_half(xf) * sin).type_as(x)
