"""LingBot-World-v2 (FastVideo's `LingBotWorld2CausalFastTransformer3DModel`,
fastvideo/models/dits/lingbotworld2/causal_fast.py) over QuantWM's cache.

FastVideo keeps, per block, a dict of preallocated (B, L, H, D) post-RoPE keys and values with
`global_end_index`/`local_end_index`, `sink_size` latent frames kept at the start and a rolling window of
`local_attn_size` frames. Here each block's `CausalWanSelfAttention.forward` computes q, k, v with the block's own
projections, RMS norms and `causal_rope_apply` (the chunk's absolute start frame), and attends through
`ChunkedAttention`: keys are stored post-RoPE as FastVideo stores them, the sink and window become the cache's
`sink_chunks`/`max_chunks` (base.FastVideoModel.cache_config). The generation loop is FastVideo's
`LingBotWorld2CausalFastGenerationStage`: per chunk, the scheduler's 4 few-step timesteps (FlowUniPC, shift 10),
x0 from the flow prediction, the next step re-noised, then a clean pass at t = 0 that writes and commits the chunk.
Image conditioning (`y`: mask and first-frame latents), the camera's Plücker embedding and the text context are drawn
from the seed for a tiny run (no encoders: their outputs' shapes only).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..attention import ChunkedAttention
from . import runtime
from .base import FastVideoModel, Plan, Rollout, at, check_chunk, hooked, own_kv_cache, read_map, swapped_forwards

MODULE = "fastvideo.models.dits.lingbotworld2.causal_fast"


class LingBotWorld2(FastVideoModel):
    name = "lingbot-world-v2"
    title = "LingBot-World-v2"
    class_name = "LingBotWorld2CausalFastTransformer3DModel"
    model_module = MODULE
    config_path = "fastvideo.configs.models.dits.lingbotworld2:LingBotWorld2CausalFastVideoConfig"
    source = "fastvideo/models/dits/lingbotworld2/causal_fast.py"
    flash = ((MODULE, "flash_attention"),)  # the text cross-attention calls flash-attn directly

    def tiny_arch(self) -> dict:
        return dict(dim=64, ffn_dim=128, num_heads=2, num_layers=2, text_dim=32, text_len=8, freq_dim=32,
                    local_attn_size=-1, sink_size=0, chunk_size=2)

    def _inputs(self, model, plan: Plan, device) -> dict:
        a = self.arch(model)
        g = torch.Generator().manual_seed(plan.seed)
        h, w = plan.latent_hw
        F = plan.latent_frames
        noise = torch.randn(a.out_dim, F, h, w, generator=g)
        y = torch.randn(a.in_dim - a.out_dim, F, h, w, generator=g)  # mask + first-frame latents (I2V)
        cam = 0.1 * torch.randn(1, 6 * 64, F, h, w, generator=g)  # Plücker embedding at latent resolution
        context = torch.randn(a.text_len, a.text_dim, generator=g)
        return self.given({"noise": noise.to(device), "y": y.to(device), "cam": cam.to(device),
                           "context": context.to(device), "g": g}, plan)

    def rollout(self, model, plan: Plan, attn: ChunkedAttention | None, progress: Callable | None = None) -> Rollout:
        a = self.arch(model)
        device = next(model.parameters()).device
        sched_mod = runtime.module("fastvideo.models.schedulers.scheduling_flow_unipc_multistep")
        scheduler = sched_mod.FlowUniPCMultistepScheduler(shift=1.0, use_dynamic_shifting=False)
        scheduler.set_timesteps(a.num_train_timesteps, shift=a.sample_shift)
        timesteps = scheduler.timesteps[list(a.timesteps_index)]
        inp = self._inputs(model, plan, device)
        h, w = plan.latent_hw
        frame_seqlen = h * w // (a.patch_size[1] * a.patch_size[2])
        chunk = plan.chunk_frames
        L, H, D = self.shape(model)
        window, _ = self.window(model)
        kv_size = frame_seqlen * (window if window is not None else plan.latent_frames)
        dt = torch.bfloat16
        kv = [{} for _ in range(L)] if attn is not None else own_kv_cache(L, kv_size, H, D, device)
        cross = [{"k": torch.zeros(1, a.text_len, H, D, dtype=dt, device=device),
                  "v": torch.zeros(1, a.text_len, H, D, dtype=dt, device=device),
                  "is_init": torch.zeros(1, dtype=torch.bool, device=device)} for _ in range(L)]
        out, cache_map = [], []
        g = inp["g"]
        hooks = hooked(lambda: self.hooks(model, attn, chunk * frame_seqlen), attn)
        with torch.no_grad(), runtime.on_cpu(model, self.flash), hooks:
            for i in range(plan.chunks):
                sl = slice(i * chunk, (i + 1) * chunk)
                kwargs = {"context": [inp["context"]], "seq_len": chunk * frame_seqlen, "y": [inp["y"][:, sl]],
                          "dit_cond_dict": {"c2ws_plucker_emb": [inp["cam"][:, :, sl]]}, "kv_cache": kv,
                          "crossattn_cache": cross, "current_start": i * chunk * frame_seqlen,
                          "max_attention_size": kv_size, "frame_seqlen": frame_seqlen}
                if attn is not None:
                    cache_map.append(read_map(attn.cache, i, chunk))
                x = inp["noise"][:, sl]
                x0 = x
                for j, t in enumerate(timesteps):
                    with at(attn, i, False):
                        flow = model(x=[x], t=t.reshape(1).to(device), cross_attn_first_call=(i == 0 and j == 0),
                                     **kwargs)[0]
                    sigma = scheduler.sigmas[torch.argmin((scheduler.timesteps - t).abs())].double()
                    x0 = (x.double() - sigma * flow.double()).to(x.dtype)
                    if j + 1 < len(timesteps):
                        x = scheduler.add_noise(x0, torch.randn(x0.shape, generator=g).to(device),
                                                timesteps[j + 1].reshape(1))
                out.append(x0.float().cpu())
                with at(attn, i, True):
                    model(x=[x0], t=(timesteps[-1] * 0.0).reshape(1).to(device), cross_attn_first_call=False,
                          **kwargs)
                if progress:
                    progress(i + 1, plan.chunks)
        return Rollout(torch.cat(out, dim=1), cache_map)

    def hooks(self, model, attn: ChunkedAttention, chunk_tokens: int):
        rope = runtime.module(MODULE).causal_rope_apply

        def make(layer: int, mod):
            def forward(x, seq_lens, grid_sizes, freqs, kv_cache, current_start=0, max_attention_size=1_000_000,
                        frame_seqlen=None, seq_lens_int=None):
                b, s, n, d = *x.shape[:2], mod.num_heads, mod.head_dim
                q = mod.norm_q(mod.q(x)).view(b, s, n, d)
                k = mod.norm_k(mod.k(x)).view(b, s, n, d)
                v = mod.v(x).view(b, s, n, d)
                check_chunk(attn, current_start, chunk_tokens)
                start_frame = current_start // frame_seqlen
                rq = rope(q, grid_sizes, freqs, start_frame=start_frame).type_as(v)
                rk = rope(k, grid_sizes, freqs, start_frame=start_frame).type_as(v)
                return mod.o(attn(layer, rq, rk, v).flatten(2))
            return forward

        return swapped_forwards([blk.self_attn for blk in model.blocks], make)
