"""Matrix-Game-2 (FastVideo's `CausalMatrixGame2WanModel`, fastvideo/models/dits/matrixgame2/causal_model.py) over
QuantWM's cache.

FastVideo keeps, per block, a dict of preallocated (B, L, H, D) self-attention keys and values (post-RoPE under the
default "absolute" RoPE policy) with `global_end_index`/`local_end_index`: `sink_size` latent frames pinned at the
front and a rolling window of `local_attn_size` frames (sink and the chunk being generated included). Each block's
action module (keyboard and mouse conditioning) keeps two more such dicts, one entry per latent frame; those stay
FastVideo's on both paths, as do the image cross-attention's cached keys.

Here each block's `CausalMatrixGame2SelfAttention.forward`, which receives the block's q, k, v after its projections
and RMS norms, applies `causal_rope_apply` at the chunk's absolute start frame and attends through
`ChunkedAttention`: keys are stored post-RoPE as FastVideo stores them, the sink and window become the cache's
`sink_chunks`/`max_chunks` (base.FastVideoModel.cache_config). The loop is FastVideo's
`MatrixGame2CausalDenoisingStage` (fastvideo/pipelines/stages/matrixgame2_denoising.py): per chunk of
`num_frames_per_block` latent frames, the pipeline config's few-step timesteps ([1000, 666, 333] warped onto
FastVideo's FlowMatchEulerDiscreteScheduler at the config's shift 5, as its Wan DMD pipelines build it; the
Matrix-Game DMD pipeline takes the scheduler from the checkpoint folder), x0 from the flow prediction, re-noised to
the next step, then a clean pass at t = 0 that writes and commits the chunk. The image conditioning (mask +
first-frame latents, concatenated on channels through the forward context, and CLIP-like image tokens) and the
keyboard/mouse actions are drawn from the seed for a tiny run. The "relativistic" RoPE policy (raw keys cached,
roped per window) is not supported, nor a window of -1 (FastVideo's stage refuses it too). On a CPU the model is built
with FastVideo's SDPA attention backend, which its CPU platform does not name (runtime.sdpa_backend_on_cpu).
"""
from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch

from ..attention import ChunkedAttention
from . import runtime
from .base import FastVideoModel, Plan, Rollout, at, check_chunk, hooked, own_kv_cache, read_map, swapped_forwards

MODULE = "fastvideo.models.dits.matrixgame2.causal_model"
PIPELINE_CONFIG = "fastvideo.configs.pipelines.matrixgame2:MatrixGame2I2V480PConfig"
MASK_CHANNELS = 4  # the I2V mask channels ahead of the first-frame latents in the conditioning
IMAGE_TOKENS = 9  # a tiny run's image-encoder tokens (CLIP's 257 x 1280 in the release)


class MatrixGame2(FastVideoModel):
    name = "matrix-game-2"
    title = "Matrix-Game-2"
    class_name = "CausalMatrixGame2WanModel"
    model_module = MODULE
    config_path = "fastvideo.configs.models.dits.matrixgame2:MatrixGame2WanVideoConfig"
    source = "fastvideo/models/dits/matrixgame2/causal_model.py"
    flash = ()  # self-attention uses SDPA, cross and action attention FastVideo's LocalAttention (SDPA on a CPU)
    default_frames = 9

    def tiny_arch(self) -> dict:
        # the action module's RoPE is built for 64-dim heads (action_module.py forward), so its hidden dims are 2 x 64
        action = dict(blocks=[0, 1], enable_mouse=True, enable_keyboard=True, heads_num=2, hidden_size=16,
                      img_hidden_size=64, keyboard_dim_in=4, keyboard_hidden_dim=128, mouse_dim_in=2,
                      mouse_hidden_dim=128, mouse_qk_dim_list=[8, 28, 28], patch_size=[1, 2, 2], qk_norm=True,
                      qkv_bias=False, rope_dim_list=[8, 28, 28], rope_theta=256, vae_time_compression_ratio=4,
                      windows_size=3)
        return dict(num_attention_heads=2, attention_head_dim=32, num_layers=2, ffn_dim=128, freq_dim=32,
                    in_channels=36, out_channels=16, text_dim=0, image_dim=32, added_kv_proj_dim=64,
                    local_attn_size=15, sink_size=0, num_frames_per_block=3, action_config=action)

    def window(self, model) -> tuple[int | None, int]:
        """(window, sink) latent frames as the model holds them: FastVideo reads them from the config at construction
        and `set_causal_attention_window` changes them (causal_model.py)."""
        return int(model.local_attn_size), int(model.sink_size)

    def _inputs(self, model, plan: Plan, device) -> dict:
        a = self.arch(model)
        act = model.action_config
        g = torch.Generator().manual_seed(plan.seed)
        h, w = plan.latent_hw
        F = plan.latent_frames
        pixel_frames = 1 + act["vae_time_compression_ratio"] * (F - 1)  # the VAE's 4x time compression
        noise = torch.randn(1, a.out_channels, F, h, w, generator=g)
        cond = torch.randn(1, a.in_channels - a.out_channels, F, h, w, generator=g)  # mask + first-frame latents
        cond[:, :MASK_CHANNELS, 1:] = 0.0  # only the first frame is given
        image = torch.randn(1, IMAGE_TOKENS, a.image_dim, generator=g)
        keyboard = (torch.rand(1, pixel_frames, act["keyboard_dim_in"], generator=g) < 0.3).float()
        mouse = 0.1 * torch.randn(1, pixel_frames, act["mouse_dim_in"], generator=g)
        return self.given({"noise": noise.to(device), "cond": cond.to(device), "image": image.to(device),
                           "keyboard": keyboard.to(device), "mouse": mouse.to(device), "g": g}, plan)

    def _caches(self, model, frame_seqlen: int, device, own_kv: bool) -> dict:
        """FastVideo's per-block cache dicts as MatrixGame2CausalDenoisingStage allocates them (bf16)."""
        L, H, D = self.shape(model)
        window = model.local_attn_size
        act = model.action_config
        heads = act["heads_num"]
        dt = torch.bfloat16

        return {
            "kv_cache": own_kv_cache(L, window * frame_seqlen, H, D, device) if own_kv else [{} for _ in range(L)],
            "kv_cache_keyboard": own_kv_cache(L, window, heads, act["keyboard_hidden_dim"] // heads, device),
            "kv_cache_mouse": own_kv_cache(L, window, heads, act["mouse_hidden_dim"] // heads, device,
                                           batch=frame_seqlen),
            "crossattn_cache": [{"k": torch.zeros(1, IMAGE_TOKENS, H, D, dtype=dt, device=device),
                                 "v": torch.zeros(1, IMAGE_TOKENS, H, D, dtype=dt, device=device),
                                 "is_init": False} for _ in range(L)],
        }

    def rollout(self, model, plan: Plan, attn: ChunkedAttention | None, progress: Callable | None = None) -> Rollout:
        if model.local_attn_size == -1:  # FastVideo's stage asserts the same (matrixgame2_denoising.py)
            raise ValueError("Matrix-Game-2 needs a window: local_attn_size is -1 (the action module's caches have "
                             "no global mode)")
        a = self.arch(model)
        device = next(model.parameters()).device
        pc = _pipeline_config()
        sched_mod = runtime.module("fastvideo.models.schedulers.scheduling_flow_match_euler_discrete")
        scheduler = sched_mod.FlowMatchEulerDiscreteScheduler(shift=pc.flow_shift)
        steps = torch.tensor(pc.dmd_denoising_steps, dtype=torch.long)
        if pc.warp_denoising_step:  # [1000, 666, 333] as indices into the shifted schedule
            steps = torch.cat([scheduler.timesteps, torch.zeros(1)])[1000 - steps]
        timesteps = steps.to(device)
        pred_video = runtime.module("fastvideo.models.utils").pred_noise_to_pred_video
        set_forward_context = runtime.module("fastvideo.forward_context").set_forward_context

        inp = self._inputs(model, plan, device)
        h, w = plan.latent_hw
        frame_seqlen = h * w // (a.patch_size[1] * a.patch_size[2])
        chunk = plan.chunk_frames
        caches = self._caches(model, frame_seqlen, device, own_kv=attn is None)
        # the forward context carries the I2V conditioning the model concatenates on channels (causal_model.py)
        batch = SimpleNamespace(image_latent=inp["cond"].to(torch.bfloat16))
        vae_t = model.action_config["vae_time_compression_ratio"]
        g = inp["g"]
        out, cache_map = [], []
        hooks = hooked(lambda: self.hooks(model, attn, chunk * frame_seqlen), attn)
        with torch.no_grad(), runtime.on_cpu(model, self.flash), hooks:
            for i in range(plan.chunks):
                start = i * chunk
                seen = 1 + vae_t * (start + chunk - 1)  # action frames up to this chunk's last latent frame
                kwargs = {"mouse_cond": inp["mouse"][:, :seen], "keyboard_cond": inp["keyboard"][:, :seen],
                          "num_frame_per_block": chunk, "current_start": start * frame_seqlen, "start_frame": start,
                          "encoder_hidden_states_image": [inp["image"].to(torch.bfloat16)], **caches}
                if attn is not None:
                    cache_map.append(read_map(attn.cache, i, chunk))
                x = inp["noise"][:, :, start:start + chunk]  # (1, C, f, h, w)
                for j, t in enumerate(timesteps):
                    t_frames = t * torch.ones(1, chunk, dtype=torch.long, device=device)
                    with at(attn, i, False), set_forward_context(current_timestep=j, attn_metadata=None,
                                                                  forward_batch=batch):
                        flow = model(x.to(torch.bfloat16), None, t_frames, **kwargs)
                    # (1, C, f, h, w) -> (f, C, h, w): the stage's per-frame layout
                    x0 = pred_video(pred_noise=flow[0].transpose(0, 1), noise_input_latent=x[0].transpose(0, 1),
                                    timestep=t.repeat(chunk), scheduler=scheduler)
                    if j + 1 < len(timesteps):
                        noise = torch.randn(x0.shape, dtype=x0.dtype, generator=g).to(device)
                        x0 = scheduler.add_noise(x0, noise, timesteps[j + 1] * torch.ones(1, dtype=torch.long,
                                                                                        device=device))
                    x = x0.transpose(0, 1).unsqueeze(0)
                out.append(x[0].float().cpu())
                t_clean = torch.full((1, chunk), int(pc.context_noise), dtype=torch.long, device=device)
                with at(attn, i, True), set_forward_context(current_timestep=0, attn_metadata=None,
                                                             forward_batch=batch):
                    model(x.to(torch.bfloat16), None, t_clean, **kwargs)
                if progress:
                    progress(i + 1, plan.chunks)
        return Rollout(torch.cat(out, dim=1), cache_map)

    def hooks(self, model, attn: ChunkedAttention, chunk_tokens: int):
        mod_ = runtime.module(MODULE)
        rope, rope_params = mod_.causal_rope_apply, mod_.rope_params
        freqs = {}

        def make(layer: int, mod):
            if mod.rope_cache_policy != "absolute":
                raise ValueError(f"Matrix-Game-2's {mod.rope_cache_policy!r} RoPE policy caches raw keys: only "
                                 "'absolute' (post-RoPE keys) is supported")

            def forward(q, k, v, freqs_cis, block_mask, grid_sizes, kv_cache=None, current_start=0, cache_start=None):
                check_chunk(attn, current_start, chunk_tokens)
                d = mod.head_dim
                if d not in freqs:  # Wan's split of a head between time, height and width (1024 positions each)
                    freqs[d] = torch.cat([rope_params(1024, d - 4 * (d // 6)), rope_params(1024, 2 * (d // 6)),
                                          rope_params(1024, 2 * (d // 6))], dim=1).to(q.device)
                start_frame = current_start // (grid_sizes[1] * grid_sizes[2])
                rq = rope(q, grid_sizes, freqs[d], start_frame=start_frame).type_as(v)
                rk = rope(k, grid_sizes, freqs[d], start_frame=start_frame).type_as(v)
                return attn(layer, rq, rk, v)
            return forward

        return swapped_forwards([blk.attn1 for blk in model.blocks], make)


def _pipeline_config():
    mod, cls = PIPELINE_CONFIG.split(":")
    return getattr(runtime.module(mod), cls)()
