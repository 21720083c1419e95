"""Self-Forcing and Causal-Forcing (FastVideo's `CausalWanTransformer3DModel`, fastvideo/models/dits/causal_wanvideo.py)
over QuantWM's cache.

Both releases are a causal Wan2.1 T2V DiT distilled with DMD; FastVideo runs them with `CausalDMDDenosingStage`
(fastvideo/pipelines/stages/causal_denoising.py): per chunk of `num_frames_per_block` latent frames, the warped DMD
timesteps (1000, 750, 500, 250 read through the flow-match table, shift 5), x0 from the flow prediction, re-noise
to the next timestep, then a clean pass at t = 0 that writes the chunk into every block's cache. `rollout` replays
that loop; the text context is drawn from the seed (its shape only, no encoder).

FastVideo's cache per block is a preallocated (B, L, H, D) buffer of `local_attn_size` frames (21 when -1, and a
rollout past 21 frames is refused), `sink_size` frames pinned at its start, the oldest others shifted out. Keys are
stored as the `rope_cache_policy` says:
* "absolute" (the default): post-RoPE at the chunk's absolute frame. QuantWM stores them the same way (rope="post");
  sink and window become `sink_chunks`/`max_chunks` (base.FastVideoModel.cache_config).
* "relativistic": raw keys; at every step the held window is rotated at its rank (0 .. window) and the queries at
  the window's tail, so positions stay in the trained range. QuantWM stores keys pre-RoPE (rope="pre") with
  `WindowRope`, which rotates every held key at its rank, as FastVideo does; the cache must then hold exactly
  FastVideo's window (a window of whole chunks), checked at every call. A quantizer that aims query statistics at
  a pre-RoPE span sees the span at ranks 0.. (a key's rank changes as the window rolls: there is no one position).
Known not to work: Wan2.2 MoE variants (two transformers, `boundary_ratio`), image conditioning (I2V), context noise.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..attention import ChunkedAttention
from . import runtime
from .base import FastVideoModel, Plan, Rollout, at, check_chunk, hooked, own_kv_cache, read_map, swapped_forwards

MODULE = "fastvideo.models.dits.causal_wanvideo"
DMD_STEPS = (1000, 750, 500, 250)  # SelfForcingWanT2V480PConfig.dmd_denoising_steps, warped
FLOW_SHIFT = 5.0  # SelfForcingWanT2V480PConfig.flow_shift
POLICIES = ("absolute", "relativistic")


class WindowRope:
    """rope(x, positions): FastVideo's relativistic key RoPE: x (B, H, L, D), the held window in cache order, rotated
    at ranks 0 .. L-1 of the (cos, sin) table the model built for this step. The attention hook sets `table` and
    `window` (the tokens FastVideo's window holds at this step, which L must equal) before each call."""

    def __init__(self):
        self.table: tuple[torch.Tensor, torch.Tensor] | None = None
        self.window: int | None = None

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        if self.table is None:
            raise ValueError("WindowRope has no table yet: it is filled by SelfForcing's attention hook")
        if inverse:
            raise ValueError("WindowRope rotates a window by rank; it has no inverse")
        apply = runtime.module("fastvideo.layers.rotary_embedding")._apply_rotary_emb
        cos, sin = self.table
        n = x.shape[2]
        if self.window is not None and n != self.window:
            raise ValueError(f"the cache holds {n} tokens where FastVideo's window holds {self.window}: the "
                             "relativistic policy needs a window and sink of whole chunks")
        # FastVideo rotates the bf16 buffer and keeps bf16: (B, H, L, D) -> (B, L, H, D) and back
        kb = x.transpose(1, 2).to(torch.bfloat16)
        return apply(kb, cos[:n], sin[:n], is_neox_style=False).type_as(kb).transpose(1, 2).to(x.dtype)


class SelfForcing(FastVideoModel):
    name = "self-forcing"
    aliases = ("causal-forcing",)
    title = "Self-Forcing / Causal-Forcing (causal Wan2.1)"
    class_name = "CausalWanTransformer3DModel"
    model_module = MODULE
    config_path = "fastvideo.configs.models.dits.wanvideo:WanVideoConfig"
    source = "fastvideo/models/dits/causal_wanvideo.py"

    def tiny_arch(self) -> dict:
        return dict(num_attention_heads=2, attention_head_dim=32, ffn_dim=128, num_layers=2, in_channels=16,
                    out_channels=16, text_dim=32, freq_dim=32, local_attn_size=-1, sink_size=0,
                    num_frames_per_block=2, rope_cache_policy="absolute")

    def policy(self, model) -> str:
        """The model's rope_cache_policy; ValueError for one QuantWM does not know."""
        p = self.arch(model).rope_cache_policy
        if p not in POLICIES:
            raise ValueError(f"rope_cache_policy {p!r} is not supported; allowed: {', '.join(POLICIES)}")
        return p

    def cache_config(self, model, notes: list[str] | None = None, **kw):
        """base's window rules; keys pre-RoPE under the relativistic policy (build the cache with `key_rope()`)."""
        if self.policy(model) == "relativistic":
            kw.setdefault("rope", "pre")
        return super().cache_config(model, notes, **kw)

    def key_rope(self, model) -> WindowRope | None:
        """The `rope` the KVCache needs for this model: WindowRope under the relativistic policy, else None."""
        return WindowRope() if self.policy(model) == "relativistic" else None

    # ---- the generation loop -------------------------------------------------------------------
    def _scheduler_and_timesteps(self):
        sched_mod = runtime.module("fastvideo.models.schedulers.scheduling_flow_match_euler_discrete")
        scheduler = sched_mod.FlowMatchEulerDiscreteScheduler(shift=FLOW_SHIFT)
        table = torch.cat([scheduler.timesteps.cpu(), torch.zeros(1, dtype=torch.float32, device="cpu")])
        steps = torch.tensor(DMD_STEPS, dtype=torch.long, device="cpu")
        return scheduler, table[1000 - steps]  # the pipeline's warp_denoising_step

    def rollout(self, model, plan: Plan, attn: ChunkedAttention | None, progress: Callable | None = None) -> Rollout:
        a = self.arch(model)
        device = next(model.parameters()).device
        pred_to_x0 = runtime.module("fastvideo.models.utils").pred_noise_to_pred_video
        forward_context = runtime.module("fastvideo.forward_context").set_forward_context
        scheduler, timesteps = self._scheduler_and_timesteps()
        timesteps = timesteps.to(device)
        if plan.latent_frames % plan.chunk_frames:
            raise ValueError(f"{plan.latent_frames} latent frames are not whole {plan.chunk_frames}-frame chunks")
        h, w = plan.latent_hw
        frame_seqlen = h * w // (a.patch_size[1] * a.patch_size[2])
        chunk = plan.chunk_frames
        L, H, D = self.shape(model)
        dt = torch.bfloat16
        g = torch.Generator().manual_seed(plan.seed)
        latents = torch.randn(1, a.out_channels, plan.latent_frames, h, w, generator=g, device="cpu").to(device)
        context = torch.randn(1, 8, a.text_dim, generator=g, device="cpu").to(device, dt)  # 8 prompt tokens, no encoder
        inp = self.given({"latents": latents, "context": context}, plan)
        latents, context = inp["latents"], inp["context"]
        window = a.local_attn_size if a.local_attn_size != -1 else a.sliding_window_num_frames
        kv = [{} for _ in range(L)] if attn is not None else own_kv_cache(L, window * frame_seqlen, H, D, device)
        cross = [{"k": torch.zeros(1, 8, H, D, dtype=dt, device=device),
                  "v": torch.zeros(1, 8, H, D, dtype=dt, device=device), "is_init": False} for _ in range(L)]
        cache_map = []
        hooks = hooked(lambda: self.hooks(model, attn, chunk * frame_seqlen), attn)
        with torch.no_grad(), runtime.on_cpu(model, self.flash), hooks:
            for i in range(plan.chunks):
                sl = slice(i * chunk, (i + 1) * chunk)
                kwargs = {"kv_cache": kv, "crossattn_cache": cross, "current_start": i * chunk * frame_seqlen,
                          "start_frame": i * chunk}
                if attn is not None:
                    cache_map.append(read_map(attn.cache, i, chunk))
                x = latents[:, :, sl]  # (1, C, chunk, h, w)
                for j, t in enumerate(timesteps):
                    with at(attn, i, False), forward_context(current_timestep=j, attn_metadata=None):
                        flow = model(x.to(dt), [context], t * torch.ones((1, 1), dtype=torch.long, device=device),
                                     **kwargs)
                    # (1, C, F, h, w) -> (F, C, h, w), the pipeline's BTCHW flattened
                    x0 = pred_to_x0(pred_noise=flow[0].transpose(0, 1), noise_input_latent=x[0].transpose(0, 1),
                                    timestep=t.reshape(1), scheduler=scheduler)
                    if j + 1 < len(timesteps):
                        noise = torch.randn((chunk, *x0.shape[1:]), dtype=x0.dtype, generator=g, device="cpu")
                        t_next = timesteps[j + 1] * torch.ones(1, dtype=torch.long, device=device)
                        x0 = scheduler.add_noise(x0, noise.to(device), t_next)
                    x = x0.transpose(0, 1)[None]
                latents[:, :, sl] = x
                with at(attn, i, True), forward_context(current_timestep=0, attn_metadata=None):
                    model(x.to(dt), [context], torch.zeros((1, 1), dtype=torch.long, device=device), **kwargs)
                if progress:
                    progress(i + 1, plan.chunks)
        return Rollout(latents[0].float().cpu(), cache_map)

    def hooks(self, model, attn: ChunkedAttention, chunk_tokens: int):
        """Each block's `CausalWanSelfAttention.forward` swapped for one that ropes q/k by the model's policy and
        attends through `attn` (q, k, v arrive from the block already projected and RMS-normed, (B, L, H, D))."""
        mod = runtime.module(MODULE)
        apply = runtime.module("fastvideo.layers.rotary_embedding")._apply_rotary_emb
        relativistic = self.policy(model) == "relativistic"
        a = self.arch(model)
        max_frames = a.local_attn_size if a.local_attn_size != -1 else mod.GLOBAL_ATTN_COMPAT_MAX_LATENT_FRAMES
        rope = attn.cache.rope
        if relativistic and not (attn.cache.config.rope == "pre" and isinstance(rope, WindowRope)):
            raise ValueError("the relativistic rope_cache_policy keeps keys before RoPE: build the cache with "
                             "spec.cache_config(model) and KVCache(..., rope=spec.key_rope(model))")
        if not relativistic and attn.cache.config.rope != "post":
            raise ValueError("the absolute rope_cache_policy stores post-RoPE keys: the cache needs rope='post'")

        def make(layer: int, m):
            def forward(q, k, v, freqs_cis, block_mask=None, kv_cache=None, current_start=0, cache_start=None,
                        frame_seqlen=1560):
                check_chunk(attn, current_start, chunk_tokens)
                n = q.shape[1]
                end = current_start + n
                if a.local_attn_size == -1 and end > max_frames * frame_seqlen:
                    raise ValueError(f"Causal Wan with local_attn_size=-1 holds at most {max_frames} latent frames "
                                     f"(FastVideo refuses more); set local_attn_size for longer rollouts")
                cos, sin = freqs_cis
                if not relativistic:
                    rq = apply(q, cos, sin, is_neox_style=False).type_as(v)
                    rk = apply(k, cos, sin, is_neox_style=False).type_as(v)
                    return attn(layer, rq, rk, v)
                span = min(end, max_frames * frame_seqlen)  # the held window's tokens; the queries are its tail
                rope.table, rope.window = (cos, sin), span
                rq = apply(q, cos[span - n:span], sin[span - n:span], is_neox_style=False).type_as(v)
                return attn(layer, rq, k.type_as(v), v)
            return forward

        return swapped_forwards([blk.attn1 for blk in model.blocks], make)
