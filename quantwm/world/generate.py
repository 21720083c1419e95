"""Generation with the built-in world model through the library's KV cache, with attention probes.

    model = load_world_model()
    run = generate(model, world_seed=3, trajectory="loop", n_frames=32, cache_config=CacheConfig("quantwm"))
    run.frames       # (T, 64, 64, 3) float in [0, 1]; the first `context_frames` are the given ones
    run.probes       # per generated chunk and layer: top-1 source under exact and quantized keys, ...

The first chunks are the context (ground-truth frames, written by a clean pass and committed). Every
later chunk starts from seeded noise, takes `steps` Euler steps of the flow (each a pass that attends to
the cache plus the chunk), then a clean pass (t = 1) writes its K/V and commits it. BF16 and quantized
runs with the same seeds get the same noise, so they differ only by the cache.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path

import torch
from safetensors import safe_open

from ..core.cache import CacheConfig, KVCache
from ..core.rope import FrameShift
from ..evaluation import metrics as M
from ..evaluation.limits import TRIM_EVERY, release_memory
from .model import WorldConfig, WorldModel
from .scene import make_world, patchify, render, token_world_coords, trajectory, unpatchify

# The committed weights, shipped as package data (`quantwm.assets`, the repository's assets/).
DEFAULT_WEIGHTS = Path(str(resources.files("quantwm.assets").joinpath("world_model.safetensors")))


def load_world_model(path: str | Path = DEFAULT_WEIGHTS) -> WorldModel:
    """Load exported weights (safetensors, config in the metadata; int8 matrices with per-row scales, or
    fp16), eval mode, fp32."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no world-model weights (train them: python -m quantwm.world.train)")
    try:
        with safe_open(str(path), "pt") as f:
            cfg = WorldConfig(**json.loads(f.metadata()["config"]))
            state = {}
            for k in f.keys():
                if k.endswith("::scale"):
                    continue
                t = f.get_tensor(k)
                state[k] = t.float() * f.get_tensor(k + "::scale")[:, None] if t.dtype == torch.int8 else t.float()
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same user error
        raise ValueError(f"{path}: not a QuantWM world-model file ({str(e).splitlines()[0][:100]})") from None
    bad = next((k for k, t in state.items() if not torch.isfinite(t).all()), None)
    if bad is not None:
        raise ValueError(f"{path}: corrupt world-model file (tensor {bad!r} holds NaN or Inf)")
    model = WorldModel(cfg)
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise ValueError(f"{path}: the weights do not fit the model its metadata describes "
                         f"({str(e).splitlines()[0][:120]})") from None
    return model.eval()


@dataclass
class ChunkProbe:
    """What one generated chunk's queries did, per layer (lists indexed by layer).

    top1_exact / top1_quant: (H, N) cached-token index each query's argmax picks with exact / stored keys
    (cached tokens only, the chunk itself excluded); q: (H, N, D) the queries (temperature included);
    n_cached: how many cached tokens they saw; positions: their absolute token positions (the cache order under
    a rolling window, which evicts); same_place_mass: (H, N) exact attention probability on cached
    tokens that saw the query's world location (nan where no cached token did); top1_prob: (H, N).
    """

    chunk: int
    top1_exact: list = field(default_factory=list)
    top1_quant: list = field(default_factory=list)
    q: list = field(default_factory=list)
    same_place_mass: list = field(default_factory=list)
    top1_prob: list = field(default_factory=list)
    n_cached: int = 0
    positions: torch.Tensor | None = None  # (n_cached,) absolute token position of each cached token (a window evicts)
    logits: dict = field(default_factory=dict)  # layer -> (exact, stored) (n_heads, N, n_cached) of `rollout(logits=)`


class ProbingCache:
    """Passes `attend` through to a KVCache and, when armed, records what the queries select (and the attention
    logits of `logit_layers` x `logit_heads`, as float16 on the CPU)."""

    def __init__(self, cache: KVCache, token_places: torch.Tensor, logit_layers=(), logit_heads=()):
        self.cache, self.places, self.armed = cache, token_places, None
        self.logit_layers, self.logit_heads = tuple(logit_layers), list(logit_heads)

    def attend(self, layer, q, k, v, chunk, commit=False, scale=None, observe=True):
        out = self.cache.attend(layer, q, k, v, chunk=chunk, commit=commit, scale=scale, observe=observe)
        if self.armed is not None:
            self._record(layer, q, 1.0 if scale is None else scale)
        return out

    def _record(self, layer: int, q: torch.Tensor, scale: float) -> None:
        """Top-1 sources under exact and stored keys, compared on the logits the method attends with: the
        stored keys' logits carry the +jensen bias when the method applies it."""
        p = self.armed
        n_cur = q.shape[2]
        k_q = self.cache.keys(layer)[0, :, :-n_cur]
        k_all = self.cache.keys(layer, exact=True)[0]  # (H, L, D): cached tokens, then the chunk itself
        qq = q[0].float() * scale
        bias = self.cache.logit_bias(layer, q.float(), scale)
        # exact logits over the chunk itself too (the attention mass below needs them)
        full, lq = M.probe_logits(qq, k_all, k_q, 1.0, None if bias is None else bias[0, :, :, :-n_cur])
        le = full[..., :-n_cur]
        prob = full.softmax(-1)[..., :-n_cur]
        pos = self.cache.positions(layer)
        cached_places, query_places = self.places[pos[:-n_cur]], self.places[pos[-n_cur:]]
        same = (query_places[:, None, :] == cached_places[None, :, :]).all(-1).to(prob.device)  # (N, L)
        mass = (prob * same[None]).sum(-1)
        mass = torch.where(same.any(-1)[None], mass, torch.full_like(mass, float("nan")))
        p.top1_exact.append(le.argmax(-1)), p.top1_quant.append(lq.argmax(-1)), p.q.append(qq.clone())
        p.same_place_mass.append(mass), p.top1_prob.append(prob.max(-1).values)
        p.n_cached, p.positions = le.shape[-1], pos[:-n_cur]
        if layer in self.logit_layers and self.logit_heads:
            p.logits[layer] = (le[self.logit_heads].half().cpu(), lq[self.logit_heads].half().cpu())


@dataclass
class Rollout:
    frames: torch.Tensor  # (T, H, W, 3) generated (context frames are the ground truth)
    ground_truth: torch.Tensor  # (T, H, W, 3)
    poses: torch.Tensor  # (T, 2) camera poses in patches
    places: torch.Tensor  # (T*N, 2) world patch of every token
    probes: list[ChunkProbe]
    cache: KVCache
    config: WorldConfig

    def revisited(self) -> list[int]:
        """The generated frames whose view the context frames had fully seen (`revisited_frames`)."""
        return revisited_frames(self.poses, self.config.context_frames, self.config.view)

    def coverage(self) -> list[float]:
        """Per frame, the share of its view the context frames had seen (`context_coverage`)."""
        return context_coverage(self.poses, self.config.context_frames, self.config.view)

    def revisit_psnr(self) -> float:
        """PSNR against ground truth on the revisited views, averaged over them (NaN when there are none)."""
        rv = self.revisited()
        return float(M.psnr(self.frames[rv], self.ground_truth[rv]).mean()) if rv else float("nan")


def generate(model: WorldModel, world_seed: int, trajectory_kind: str = "loop", n_frames: int = 32,
             cache_config: CacheConfig = CacheConfig(), steps: int = 4, noise_seed: int = 0,
             probe: bool = True, progress=None, poses: torch.Tensor | None = None, world: str = "photo",
             photos: str | None = None) -> Rollout:
    """Roll the model out over a world and trajectory through a KVCache configured by `cache_config`.

    `world` is the world kind (`scene.WORLDS`: "photo", "procedural" or "place"); `photos` overrides the side of the
    photograph split the world's tiles come from (`scene.make_world`).

    `poses` (n_frames, 2), camera positions in patches, replaces the trajectory (diagnostics: a static camera).

    Runs on the model's device (noise is drawn on the CPU, so CPU and CUDA runs see the same noise);
    the returned frames are on the CPU. `rollout` is the same loop one chunk at a time (long rollouts).
    """
    steps_out = list(rollout(model, world_seed, trajectory_kind, n_frames, cache_config, steps, noise_seed, probe,
                             progress, poses, world, photos))
    first = steps_out[0]
    probes = [s.probe for s in steps_out if s.probe is not None]
    return Rollout(torch.cat([s.frames for s in steps_out]), torch.cat([s.ground_truth for s in steps_out]),
                   first.poses, first.places, probes, first.cache, model.cfg)


@dataclass
class ChunkStep:
    """One chunk of a rollout as `rollout` yields it: its frames (F, H, W, 3) in [0, 1] on the CPU and their
    ground truth, its probe (None for context chunks or probe=False), and the whole rollout's poses, token
    places and cache (shared by every step; the cache holds what it holds after this chunk's commit)."""

    chunk: int
    frames: torch.Tensor
    ground_truth: torch.Tensor
    probe: ChunkProbe | None
    poses: torch.Tensor
    places: torch.Tensor
    cache: KVCache


def rollout(model: WorldModel, world_seed: int, trajectory_kind: str = "loop", n_frames: int = 32,
            cache_config: CacheConfig = CacheConfig(), steps: int = 4, noise_seed: int = 0, probe: bool = True,
            progress=None, poses: torch.Tensor | None = None, world: str = "photo", photos: str | None = None,
            logits: tuple = ((), ())):
    """`generate`'s loop, one `ChunkStep` at a time: the caller keeps what it needs, so a long rollout through a
    rolling window (`cache_config.max_chunks`) holds the window, one chunk's frames and the poses, not the video;
    with a window it also gives the heap's freed pages back to the OS every `TRIM_EVERY` chunks.
    `logits`: (layers, heads) whose attention logits each probe keeps (`ChunkProbe.logits`), for a caller that
    cannot recompute them later (the window evicts the keys they were taken over)."""
    cfg = model.cfg
    device = next(model.parameters()).device
    if n_frames <= cfg.context_frames or (n_frames - cfg.context_frames) % cfg.chunk_frames:
        raise ValueError(f"n_frames must exceed {cfg.context_frames} by a multiple of {cfg.chunk_frames}, got {n_frames}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    world_map = make_world(world_seed, cfg.world_patches * cfg.patch, world, photos)
    if poses is None:
        poses = trajectory(trajectory_kind, n_frames, world_seed, cfg.world_patches, cfg.view)
    else:
        poses = torch.as_tensor(poses, dtype=torch.long)
        hi = cfg.world_patches - cfg.view
        if poses.shape != (n_frames, 2) or poses.min() < 0 or poses.max() > hi:
            raise ValueError(f"poses must be ({n_frames}, 2) patch positions in [0, {hi}], got shape {tuple(poses.shape)}")
    places = token_world_coords(poses, cfg.view).reshape(-1, 2)
    n, F = cfg.tokens_per_frame, cfg.chunk_frames
    cache = KVCache(replace(cache_config, keep_exact=probe, memo_decoded=True), cfg.layers,
                    frame_shift=FrameShift(cfg.head_dim, cfg.tokens_per_frame, cfg.rope_theta))
    layers, heads = logits
    bad = [x for x in layers if not 0 <= x < cfg.layers] + [x for x in heads if not 0 <= x < cfg.heads]
    if bad:
        raise ValueError(f"logit layer/head {bad[0]} out of range: the model has {cfg.layers} layers, {cfg.heads} heads")
    pc = ProbingCache(cache, places, layers, heads)
    places_on_device = places.to(device)  # once: each chunk's RoPE coordinates are built from it there
    g = torch.Generator().manual_seed(noise_seed * 1_000_003 + world_seed)
    n_chunks = n_frames // F
    conditioning: dict = {}  # flow time -> the model's conditioning: every chunk has the same F * n tokens

    def step(time: float) -> tuple[torch.Tensor, tuple]:
        """The chunk's flow time (1, F * n) and its conditioning, computed once per rollout."""
        t = torch.full((1, F * n), time, device=device)
        if time not in conditioning:
            conditioning[time] = model.conditioning(t)
        return t, conditioning[time]

    @torch.no_grad()  # a function, not a `with` around the loop: a generator suspended inside `no_grad` would
    def chunk(c: int):  # leave gradients off in its caller's thread while it waits (and forever if dropped)
        frames = slice(c * F, (c + 1) * F)
        gt = render(world_map, poses[frames], cfg.view, cfg.patch)  # (F, H, W, 3)
        coords = torch.cat([torch.arange(c * F, (c + 1) * F, device=device).repeat_interleave(n)[:, None],
                            places_on_device[c * F * n:(c + 1) * F * n]], -1)
        noise = torch.randn(1, F * n, cfg.patch_dim, generator=g).to(device)
        out, chunk_probe = (patchify(gt, cfg.patch) * 2 - 1).to(device), None  # (F, N, P)
        if c * F >= cfg.context_frames:
            x = noise
            for s in range(steps):
                if probe and s == steps - 1:
                    pc.armed = ChunkProbe(c)
                t, cond = step(s / steps)
                x = x + model(x, t, coords, cache=pc, chunk=c, conditioning=cond) / steps
                if pc.armed is not None:
                    chunk_probe, pc.armed = pc.armed, None
            out = x.clamp(-1, 1).reshape(F, n, -1)
        t, cond = step(1.0)
        model(out.reshape(1, F * n, -1), t, coords, cache=pc, chunk=c, commit=True, conditioning=cond)
        return unpatchify((out.cpu() + 1) / 2, cfg.view, cfg.patch).clamp(0, 1), gt, chunk_probe

    for c in range(n_chunks):
        frames_out, gt, chunk_probe = chunk(c)
        if cache_config.max_chunks is not None and c % TRIM_EVERY == TRIM_EVERY - 1:
            release_memory(collect=False)  # the heap's freed pages back: a long run's memory stays the window's
        if progress:
            progress(c + 1, n_chunks)
        yield ChunkStep(c, frames_out, gt, chunk_probe, poses, places, cache)


def context_coverage(poses: torch.Tensor, context_frames: int, view: int = 8) -> list[float]:
    """Per frame, the share of its view's world patches the context frames saw (1 for the context itself): 1
    is a revisit, where the model should reproduce what it was shown; below 1 it must invent the rest."""
    places = token_world_coords(poses, view)
    seen = {tuple(p) for p in places[:context_frames].reshape(-1, 2).tolist()}
    return [1.0 if t < context_frames else sum(tuple(p) in seen for p in places[t].tolist()) / len(places[t])
            for t in range(len(poses))]


def revisited_frames(poses: torch.Tensor, context_frames: int, view: int = 8) -> list[int]:
    """Generated frames whose every world patch was seen by the context frames."""
    places = token_world_coords(poses, view)
    seen = {tuple(p) for p in places[:context_frames].reshape(-1, 2).tolist()}
    return [t for t in range(context_frames, len(poses)) if all(tuple(p) in seen for p in places[t].tolist())]


def rollout_trace(run: Rollout, path: str | Path) -> None:
    """Write a v1 trace of a rollout: the last generated chunk's queries, the cache they saw, earlier
    queries as q_hist, and the frames. Queries carry the model's temperature, so softmax_scale is 1."""
    from ..evaluation.trace import TraceWriter

    if not run.probes:
        raise ValueError("the rollout has no probes: generate(..., probe=True) with at least one generated chunk")
    cfg, last = run.config, run.probes[-1]
    w = TraceWriter(cfg.tokens_per_frame, (cfg.view, cfg.view), 1.0, rope="post", model="quantwm-world")
    w.extra_meta["rope_theta"] = cfg.rope_theta  # its channels carry 3-D RoPE pairs (FrameShift)
    w.extra_meta["chunk_frames"] = cfg.chunk_frames
    for layer in range(cfg.layers):
        k = run.cache.keys(layer, exact=True)[0, :, :last.n_cached]
        v = run.cache.values(layer, exact=True)[0, :, :last.n_cached]
        earlier = run.probes[:-1]
        q_hist = torch.cat([p.q[layer] for p in earlier], 1) if earlier else None
        chunk_of = torch.cat([torch.full((p.q[layer].shape[1],), p.chunk) for p in earlier]) if earlier else None
        w.record(layer, last.q[layer], k, v, q_hist=q_hist, q_hist_chunk=chunk_of)
    w.set_frames(run.frames)
    w.save(path)
