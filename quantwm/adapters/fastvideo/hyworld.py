"""HY-World 1.5 (WorldPlay on HunyuanVideo-1.5; FastVideo's `HYWorldTransformer3DModel`,
fastvideo/models/dits/hyworld/hyworld.py) over QuantWM's cache.

What FastVideo runs (pipelines/stages/hyworld_denoising.py, the bidirectional model): no KV cache at all. Per chunk it
picks history frames with `select_aligned_memory_frames` (frames 0-3, the 12 frames before each 4-frame query group,
and the 4-frame history groups whose field of view best overlaps the query's), puts their clean latents in front of
the chunk at timestep 14, and runs the whole model on [memory, chunk] at every denoising step: the memory's K/V are
recomputed each step, jointly with the chunk (full attention both ways), with RoPE positions 0..n-1 over the
concatenation. `prope_qkv`'s `kv_cache` argument is accepted and never read (camera_rope.py:77).

What runs here with a `ChunkedAttention`: the cached form of that memory. Each double-stream block has two image
self-attentions, each one QuantWM cache layer (`shape()` counts 2 x blocks): layer 2b the RoPE branch (keys stored
post-RoPE at their absolute frame), layer 2b+1 the PRoPE branch (keys and values stored as `prope_qkv` makes them,
P⁻¹k and P⁻¹v with the frame's own camera, no RoPE). Only `attn.forward` of each block is swapped: FastVideo's block
still computes q, k, v, the PRoPE transforms and the output projections. A chunk is denoised with its own frames
only, then a pass at the memory timestep (14) over its clean latents writes and commits its K/V; later chunks read
from the cache exactly the frames FastVideo's retrieval picks (the cache attends to everything it holds, so the
selection is done here over `cache.keys`/`values` by `cache.positions`), and the RoPE branch re-positions each
retrieved frame as FastVideo's concatenation does (the chunk at its absolute frame, memory frame j of n at
chunk start - n + j: a time-only rotation by the difference; the frames right before the chunk are not moved).
Text tokens are conditioning, recomputed each pass, never cached.

Kept BF16: the current chunk, frames 0-3 (sink: every chunk reads them) and the chunks of the recent 12-frame
context; quantized by the method: older chunks as they leave that set, whether or not retrieval reads them again.
Known differences from FastVideo's path: memory K/V computed once (at commit, seeing its own memory) instead of
jointly with every chunk, so BF16 here equals FastVideo bit for bit on the first chunk only, and within a measured
bound after (tests/test_fastvideo_hyworld.py). Query statistics S are fed from image queries, not text queries.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext

import numpy as np
import torch

from ..attention import ChunkedAttention
from . import runtime
from .base import FastVideoModel, Plan, Rollout, read_map, swapped_forwards

MODULE = "fastvideo.models.dits.hyworld.hyworld"
RETRIEVAL = "fastvideo.models.dits.hyworld.retrieval_context"
# the retrieval's settings as FastVideo's stage calls it (pipelines/stages/hyworld_denoising.py:187-193)
MEMORY_FRAMES, CONTEXT_FRAMES, GROUP = 20, 12, 4
MEMORY_T = 15 - 1  # the memory frames' timestep: stabilization_level - 1 (hyworld_denoising.py:83, 239)


class HYWorld15(FastVideoModel):
    name = "hy-world-1.5"
    title = "HY-World 1.5 (WorldPlay)"
    class_name = "HYWorldTransformer3DModel"
    model_module = MODULE
    config_path = "fastvideo.configs.models.dits.hyworld:HYWorldConfig"
    source = "fastvideo/models/dits/hyworld/hyworld.py"
    latent_channels = 32
    vae_spatial = 16
    patch = 1
    flash = ()  # every attention goes through FastVideo's attention backends
    default_frames = 32  # 8 chunks of 4: the last two retrieve (frame index > MEMORY_FRAMES)
    steps = 2  # denoising steps per chunk of a tiny run
    points = 4096  # FOV-overlap sample points of a tiny run (FastVideo draws 50000)

    def tiny_arch(self) -> dict:
        return dict(hidden_size=64, heads_num=2, mm_double_blocks_depth=2, rope_dim_list=[8, 12, 12],
                    text_states_dim=32, text_states_dim_2=32, vision_states_dim=32)

    def tiny_plan(self, latent_frames: int | None, seed: int) -> Plan:
        return Plan(latent_frames or self.default_frames, GROUP, (4, 4), seed)

    def shape(self, model) -> tuple[int, int, int]:
        """(cache layers, heads, head_dim): two image self-attentions per block (RoPE, PRoPE), one layer each."""
        a = self.arch(model)
        return 2 * a.num_layers, a.num_attention_heads, a.attention_head_dim

    def chunk_frames(self, model) -> int:
        return GROUP  # a chunk is one retrieval group; FastVideo's stage defaults to 16 (4 groups)

    def window(self, model) -> tuple[int | None, int]:
        return None, GROUP  # every frame may be retrieved again; frames 0-3 are read by every chunk

    def cache_config(self, model, notes: list[str] | None = None, **kw):
        """The base config, with the chunks of the recent context kept BF16 (every chunk reads them)."""
        kw.setdefault("recent_chunks", math.ceil(CONTEXT_FRAMES / self.chunk_frames(model)))
        return super().cache_config(model, notes, **kw)

    def build_tiny(self, seed: int = 0):
        """The tiny model, every parameter drawn from `seed`: FastVideo's HunyuanVideo-1.5 layers are made with
        uninitialised storage (a checkpoint fills them), so the base class's zeros-only draw is not enough."""
        model = super().build_tiny(seed)
        g = torch.Generator().manual_seed(seed + 2)
        with torch.no_grad():
            for _, p in sorted(model.named_parameters()):
                r = torch.randn(p.shape, generator=g)  # drawn for every parameter: the stream never depends on values
                if p.dim() >= 2:
                    p.copy_(r / math.sqrt(p[0].numel()))
                elif not bool((p == 1).all()):  # norm gains stay 1
                    p.copy_(0.02 * r)
        return model

    # ---- conditioning of a tiny run --------------------------------------------------------------
    def cameras(self, frames: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w2c (F, 4, 4), Ks (F, 3, 3), action (F,)) of a walk drawn from `seed`: forward with a drifting yaw, then
        a turn back, so later chunks see again what early ones saw and retrieval has a choice to make."""
        g = np.random.default_rng(seed)
        yaw = np.cumsum(g.normal(0.0, 0.08, frames))
        yaw[frames // 2:] += np.linspace(0.0, math.pi, frames - frames // 2)  # turn around in the second half
        pos = np.cumsum(0.3 * np.stack([np.sin(yaw), np.zeros(frames), np.cos(yaw)], 1), 0)
        c2w = np.tile(np.eye(4), (frames, 1, 1))
        c2w[:, 0, 0], c2w[:, 0, 2], c2w[:, 2, 0], c2w[:, 2, 2] = np.cos(yaw), np.sin(yaw), -np.sin(yaw), np.cos(yaw)
        c2w[:, :3, 3] = pos
        w2c = torch.from_numpy(np.linalg.inv(c2w)).float()
        Ks = torch.tensor([[0.505, 0.0, 0.5], [0.0, 0.898, 0.5], [0.0, 0.0, 1.0]]).expand(frames, 3, 3).clone()
        action = torch.from_numpy(g.integers(0, 9, frames)).float()
        return w2c, Ks, action

    def _inputs(self, model, plan: Plan) -> dict:
        a = self.arch(model)
        g = torch.Generator().manual_seed(plan.seed)
        h, w = plan.latent_hw
        F = plan.latent_frames
        C = a.out_channels
        noise = torch.randn(1, C, F, h, w, generator=g)
        cond = torch.zeros(1, C + 1, F, h, w)  # I2V: the first frame's latents and a mask, zeros after
        cond[:, :C, 0] = torch.randn(1, C, h, w, generator=g)
        cond[:, C, 0] = 1.0
        text = [torch.randn(1, 6, a.text_embed_dim, generator=g), torch.randn(1, 4, a.text_embed_2_dim, generator=g)]
        masks = [torch.tensor([[1, 1, 1, 1, 1, 0]]), torch.tensor([[1, 1, 1, 0]])]
        image = torch.randn(1, 5, a.image_embed_dim, generator=g)
        w2c, Ks, action = self.cameras(F, plan.seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(plan.seed)
            points = runtime.module(RETRIEVAL).generate_points_in_sphere(self.points, 8.0)
        return self.given({"noise": noise, "cond": cond, "text": text, "masks": masks, "image": image,
                           "w2c": w2c[None], "Ks": Ks[None], "action": action[None], "points": points}, plan)

    def memory(self, inp: dict, chunk: int, chunk_frames: int) -> list[int]:
        """The history frames chunk `chunk` reads, as FastVideo's stage picks them: the union over the chunk's
        4-frame groups of `select_aligned_memory_frames`, less the chunk's own frames."""
        if chunk == 0:
            return []
        select = runtime.module(RETRIEVAL).select_aligned_memory_frames
        start = chunk * chunk_frames
        w2c = inp["w2c"][0].numpy()
        picked = set()
        for s in range(start, start + chunk_frames, GROUP):
            picked.update(select(w2c, s, memory_frames=MEMORY_FRAMES, temporal_context_size=CONTEXT_FRAMES,
                                 pred_latent_size=GROUP, points_local=inp["points"], device="cpu"))
        return sorted(f for f in picked if not start <= f < start + chunk_frames)

    # ---- the loop --------------------------------------------------------------------------------
    def rollout(self, model, plan: Plan, attn: ChunkedAttention | None, progress: Callable | None = None) -> Rollout:
        sched_mod = runtime.module("fastvideo.models.schedulers.scheduling_flow_match_euler_discrete")
        scheduler = sched_mod.FlowMatchEulerDiscreteScheduler(shift=5.0)
        inp = self._inputs(model, plan)
        device = next(model.parameters()).device
        for k in ("noise", "cond", "image", "Ks", "action"):  # cameras and sample points stay on the host (retrieval)
            inp[k] = inp[k].to(device)
        inp["text"], inp["masks"] = [x.to(device) for x in inp["text"]], [x.to(device) for x in inp["masks"]]
        latents = inp["noise"].clone()
        C = plan.chunk_frames
        hooks = _Hooks(self, model, plan, attn) if attn is not None else None
        cache_map = []
        with torch.no_grad(), runtime.on_cpu(model, self.flash), (hooks.swapped() if hooks else nullcontext()):
            for i in range(plan.chunks):
                mem = self.memory(inp, i, C)
                now = list(range(i * C, (i + 1) * C))
                scheduler.set_timesteps(self.steps, device=device)
                if attn is None:
                    self._chunk_reference(model, scheduler, inp, latents, mem, now)
                else:
                    hooks.at(i, mem)
                    cache_map.append(hooks.read_map(i, mem))
                    self._chunk_cached(model, scheduler, inp, latents, now, attn, i)
                if progress:
                    progress(i + 1, plan.chunks)
        return Rollout(latents[0].float().cpu(), cache_map)

    def _call(self, model, x: torch.Tensor, cond: torch.Tensor, t_frames: torch.Tensor, t: torch.Tensor,
              inp: dict, frames: list[int]) -> torch.Tensor:
        """One forward of FastVideo's model over latent frames `frames` (x and cond (1, C, len, h, w))."""
        fc = runtime.module("fastvideo.forward_context")
        dt = torch.bfloat16
        idx = torch.tensor(frames, dtype=torch.long)
        with fc.set_forward_context(current_timestep=0, attn_metadata=None):
            return model(torch.cat([x, cond], 1), inp["text"], t_frames, [inp["image"].to(dt)], inp["masks"],
                         action=inp["action"][:, idx].reshape(-1).to(dt), viewmats=inp["w2c"][:, idx].to(x.device, dt),
                         Ks=inp["Ks"][:, idx].to(dt), timestep_txt=t.reshape(1))

    def _chunk_reference(self, model, scheduler, inp, latents, mem: list[int], now: list[int]) -> None:
        """One chunk as FastVideo's HYWorldDenoisingStage runs it: memory latents in front at the memory timestep,
        conditioning latents from the video's start, the scheduler stepping the whole input, the chunk kept."""
        frames = mem + now
        n = len(now)
        for t in scheduler.timesteps:
            x = latents[:, :, frames]
            t_frames = torch.cat([torch.full((len(mem),), float(MEMORY_T), device=x.device),
                                  torch.full((n,), t.item(), device=x.device)]).to(scheduler.timesteps.dtype)
            cond = inp["cond"][:, :, :len(frames)]
            flow = self._call(model, x, cond, t_frames, t, inp, frames)
            x = scheduler.step(flow, t, x, return_dict=False)[0]
            latents[:, :, now[0]:now[-1] + 1] = x[:, :, -n:]

    def _chunk_cached(self, model, scheduler, inp, latents, now: list[int], attn: ChunkedAttention, i: int) -> None:
        """One chunk over QuantWM's cache: its own frames denoised (memory read from the cache), then a pass at the
        memory timestep over the clean latents that commits the chunk's K/V."""
        sl = slice(now[0], now[-1] + 1)
        cond = inp["cond"][:, :, sl]
        n = len(now)
        t = scheduler.timesteps[0]
        for t in scheduler.timesteps:
            x = latents[:, :, sl]
            with attn.at(i, commit=False):
                flow = self._call(model, x, cond, torch.full((n,), t.item(), dtype=t.dtype, device=x.device), t,
                                  inp, now)
            latents[:, :, sl] = scheduler.step(flow, t, x, return_dict=False)[0]
        with attn.at(i, commit=True):
            self._call(model, latents[:, :, sl], cond, torch.full((n,), float(MEMORY_T), device=latents.device), t,
                       inp, now)


class _Hooks:
    """Each block's `attn.forward` swapped for one that writes the chunk's image K/V to QuantWM's cache and attends
    [retrieved memory, chunk, text] from it; `at` sets the chunk and its memory before a chunk's passes."""

    def __init__(self, spec: HYWorld15, model, plan: Plan, attn: ChunkedAttention):
        a = spec.arch(model)
        self.spec, self.model, self.attn, self.arch = spec, model, attn, a
        h, w = plan.latent_hw
        self.grid = (h // a.patch_size, w // a.patch_size)
        self.tokens = self.grid[0] * self.grid[1]  # tokens per latent frame
        self.C = plan.chunk_frames
        self.chunk, self.mem, self.read = 0, [], {}

    def _rope(self, frames: int, start: int, hw: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.arch
        rot = runtime.module("fastvideo.layers.rotary_embedding").get_rotary_pos_embed
        return rot((frames, *hw), a.hidden_size, a.num_attention_heads, a.rope_axes_dim, a.rope_theta,
                   start_frame=start)

    def at(self, chunk: int, mem: list[int]) -> None:
        """Chunk `chunk` reading frames `mem`: its RoPE at its absolute frames, each memory frame's time shift."""
        self.chunk, self.mem = chunk, mem
        self.read = {}  # layer -> the retrieved frames' K/V: read once per chunk, every pass of it reads the same
        start = chunk * self.C
        self.freqs = self._rope(self.C, start, self.grid)
        n = len(mem)
        # memory frame j of n sits at start - n + j, as in FastVideo's concatenation (the chunk at `start`)
        shifts = [start - n + j - f for j, f in enumerate(mem)]
        D = self.arch.attention_head_dim
        cos = torch.ones(n * self.tokens, D)
        sin = torch.zeros(n * self.tokens, D)
        for j, s in enumerate(shifts):
            if s > 0:  # a time-only rotation: one frame at (s, 0, 0)
                c, si = self._rope(1, s, (1, 1))
                cos[j * self.tokens:(j + 1) * self.tokens], sin[j * self.tokens:(j + 1) * self.tokens] = c, si
        self.shift = (cos, sin) if any(s > 0 for s in shifts) else None

    def read_map(self, chunk: int, mem: list[int]) -> dict:
        """{"chunk", "frames", "read": {"memory": retrieved frames, "bf16"/"quantized": how each was held}}: the
        held frames' map (base.read_map) kept to the retrieved ones."""
        entry = read_map(self.attn.cache, chunk, self.C)
        held = entry["read"]
        entry["read"] = {"memory": list(mem), **{how: [f for f in mem if f in held[how]] for how in held}}
        return entry

    def swapped(self):
        layer_mod = runtime.module("fastvideo.layers.rotary_embedding")
        fc = runtime.module("fastvideo.forward_context")
        cache = self.attn.cache

        def make(block: int, mod):
            def forward(q, k, v, original_seq_len=None, txt_q=None, txt_k=None, txt_v=None, freqs_cis=None):
                # q, k, v: (1, N, H, D) the chunk's image tokens; txt_*: (1, Lt, H, D)
                layer = 2 * block + (0 if freqs_cis is not None else 1)  # RoPE branch, then PRoPE branch
                if freqs_cis is not None:  # FastVideo's freqs start at frame 0: the chunk's absolute frames instead
                    cos, sin = (x.to(q.device) for x in self.freqs)
                    q = layer_mod._apply_rotary_emb(q, cos, sin, is_neox_style=False)
                    k = layer_mod._apply_rotary_emb(k, cos, sin, is_neox_style=False)
                mk, mv = self._memory(layer, k, v, rope=freqs_cis is not None)
                scale = mod.softmax_scale
                self._observe(layer, q, k, v, scale)
                n = q.shape[1]
                Q = torch.cat([q, txt_q], 1)
                K = torch.cat([mk, k, txt_k], 1)
                V = torch.cat([mv, v, txt_v], 1)
                out = mod.attn_impl.forward(Q, K, V, fc.get_forward_context().attn_metadata)
                if self.attn.commit:
                    cache.commit(layer, self.chunk)
                return out[:, :n], out[:, n:]
            return forward

        return swapped_forwards([blk.attn for blk in self.model.double_blocks], make)

    def _memory(self, layer: int, k: torch.Tensor, v: torch.Tensor, rope: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk's K/V written to `layer`; the retrieved frames' K/V (1, M, H, D) read back from it (dequantized
        where the method quantized them), RoPE-branch keys moved to their frames' places in FastVideo's order."""
        cache = self.attn.cache
        cache.write(layer, k, v, self.chunk)
        if not self.mem:
            return k[:, :0], v[:, :0]
        if layer in self.read:  # the held spans do not change while a chunk is denoised (commits come at its end)
            return self.read[layer]
        frame = cache.positions(layer) // self.tokens  # (L,) latent frame of every held token, cache order (host)
        order = torch.cat([torch.nonzero(frame == f).flatten() for f in self.mem])  # host indices: no device sync
        # every held span decoded, then the retrieved ones taken (the reference read path, not the fused kernel)
        mk = cache.keys(layer)[:, order.to(k.device)].to(k.dtype)  # (1, M, H, D), frames in `mem` order
        mv = cache.values(layer)[:, order.to(v.device)].to(v.dtype)
        if rope and self.shift is not None:
            cos, sin = (x.to(k.device) for x in self.shift)
            mk = runtime.module("fastvideo.layers.rotary_embedding")._apply_rotary_emb(mk, cos, sin,
                                                                                        is_neox_style=False)
        self.read[layer] = mk, mv
        return mk, mv

    def _observe(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> None:
        """The chunk's image queries into the cache's S and the capture (as chunk_attention feeds them)."""
        cache, attn = self.attn.cache, self.attn
        if cache.tracks_queries:
            cache.observe(layer, q)
        if attn.capture is not None:
            attn.capture.observe(cache, layer, self.chunk, attn.commit, q, scale)
