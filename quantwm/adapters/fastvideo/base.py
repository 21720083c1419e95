"""What every FastVideo world model shares here: its description (`FastVideoModel`), the rollout plan and result,
the cache's window rules from the model's own, and the hook that gives a FastVideo attention module QuantWM's cache.

A model module (lingbot.py, matrixgame.py, causal_wan.py, hyworld.py, longcat.py) subclasses `FastVideoModel`
and writes two things: `tiny_arch()`, a small architecture of FastVideo's own config class, and `rollout(model,
plan, attn)`, the model's generation loop as FastVideo's pipeline runs it. With `attn=None` the loop runs through
FastVideo's own KV-cache code, untouched: the reference. With a `ChunkedAttention`, each self-attention module's
forward is swapped (`swapped_forwards`) for one that computes q, k, v with the module's own layers and RoPE and
hands them to QuantWM's cache; everything else is FastVideo's.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from ...core.cache import CacheConfig
from ...core.cache_types import frame_window
from ..attention import ChunkedAttention
from . import runtime


@dataclass(frozen=True)
class Plan:
    """One rollout: latent frames, frames per chunk, the latent grid (h, w) before patching, the seed that draws
    the noise and the conditioning, and `given` inputs (a conditioning file's tensors: the prompt's embeddings, the
    first frame's latents, the camera...) that replace the drawn ones of the same name."""

    latent_frames: int
    chunk_frames: int
    latent_hw: tuple[int, int]
    seed: int = 0
    given: tuple = field(default=(), compare=False)  # ((name, tensor), ...): inputs in place of the drawn ones

    @property
    def chunks(self) -> int:
        return self.latent_frames // self.chunk_frames


@dataclass
class Rollout:
    """A rollout's latents (C, F, h, w) float32 and, per chunk, which latent frames its queries read and how they
    were held (`cache_map`: [{"chunk", "frames", "read": {"bf16": [...], "quantized": [...], "memory": [...],
    "conditioning": [...]}}]; "memory" and "conditioning" name frames a model attends for its own reasons)."""

    latents: torch.Tensor
    cache_map: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    context_frames: int = 0  # leading latent frames given, not generated (LongCat's conditioning)


class FastVideoModel:
    """One FastVideo world model as QuantWM drives it (subclasses fill the class attributes and two methods)."""

    name: str = ""
    aliases: tuple[str, ...] = ()
    title: str = ""
    class_name: str = ""  # FastVideo's registry name (config.json's _class_name)
    model_module: str = ""  # the module that defines the class
    config_path: str = ""  # "module:Class" of FastVideo's DiT config
    source: str = ""  # the file in FastVideo
    latent_channels: int = 16
    vae_spatial: int = 8  # pixels per latent cell (the preview upsamples by this)
    patch: int = 2
    flash: tuple[tuple[str, str], ...] = ()  # flash-attn calls the CPU arrangement replaces (runtime.on_cpu)
    default_frames: int = 8  # latent frames of a --tiny run

    # ---- to be written per model -----------------------------------------------------------------
    def tiny_arch(self) -> dict:
        raise NotImplementedError

    def rollout(self, model: torch.nn.Module, plan: Plan, attn: ChunkedAttention | None,
                progress: Callable | None = None) -> Rollout:
        raise NotImplementedError

    def tiny_plan(self, latent_frames: int | None, seed: int) -> Plan:
        """The plan of a --tiny run (an 8x8 latent grid, the tiny config's chunk)."""
        return Plan(latent_frames or self.default_frames, _chunk_of(self.tiny_arch()), (8, 8), seed)

    def check_plan(self, plan: Plan) -> None:
        """ValueError unless the plan is whole chunks, at least two (a model with another rule overrides this)."""
        if plan.latent_frames % plan.chunk_frames or plan.chunks < 2:
            raise ValueError(f"{self.name}: latent frames must be a multiple of its {plan.chunk_frames}-frame chunk, "
                             f"at least two chunks, got {plan.latent_frames}")

    def plan(self, model: torch.nn.Module, latent_frames: int, latent_hw: tuple[int, int], seed: int) -> Plan:
        """The plan of a run of `model` (its chunk from its config)."""
        return Plan(latent_frames, self.chunk_frames(model), latent_hw, seed)

    # ---- shared ----------------------------------------------------------------------------------
    def given(self, drawn: dict, plan: Plan) -> dict:
        """`drawn` (name -> tensor, drawn from the seed) with `plan.given`'s tensors in place of those they name, each
        on its drawn tensor's device and dtype; ValueError for a name the model does not take, another shape, or
        NaN/Inf."""
        out = dict(drawn)
        names = sorted(k for k, v in drawn.items() if torch.is_tensor(v))
        for name, t in plan.given:
            if name not in names:
                raise ValueError(f"{self.name} takes no input {name!r}; its inputs: {', '.join(names)}")
            want = drawn[name]
            if not torch.is_tensor(t) or tuple(t.shape) != tuple(want.shape):
                got = tuple(t.shape) if torch.is_tensor(t) else type(t).__name__
                raise ValueError(f"input {name!r} must have shape {tuple(want.shape)} for this run, got {got}")
            if not torch.is_floating_point(t) and torch.is_floating_point(want):
                raise ValueError(f"input {name!r} must be floating point, got {t.dtype}")
            if torch.is_floating_point(t) and not bool(torch.isfinite(t).all()):
                raise ValueError(f"input {name!r} holds NaN or Inf")
            out[name] = t.to(want.device, want.dtype)
        return out

    def config_cls(self) -> type:
        mod, cls = self.config_path.split(":")
        return getattr(runtime.module(mod), cls)

    def model_cls(self) -> type:
        return getattr(runtime.module(self.model_module), self.class_name)

    def arch(self, model: torch.nn.Module):
        return model.config.arch_config if hasattr(model.config, "arch_config") else model.config

    def shape(self, model: torch.nn.Module) -> tuple[int, int, int]:
        """(layers, heads, head_dim) of the model's self-attention."""
        a = self.arch(model)
        return a.num_layers, a.num_attention_heads, a.attention_head_dim

    def chunk_frames(self, model: torch.nn.Module) -> int:
        """Latent frames per chunk, under whichever name the model's config gives them."""
        return _chunk_of(vars(self.arch(model)))

    def key_rope(self, model: torch.nn.Module):
        """The rope function a KVCache needs when the model stores keys before RoPE (CacheConfig(rope="pre")); None
        for the models that store them rotated."""
        return None

    def window(self, model: torch.nn.Module) -> tuple[int | None, int]:
        """(window frames or None for all, sink frames) of the model's rolling cache."""
        a = self.arch(model)
        local = getattr(a, "local_attn_size", -1)
        return (None if local in (-1, None) else int(local)), int(getattr(a, "sink_size", 0) or 0)

    def cache_config(self, model: torch.nn.Module, notes: list[str] | None = None, **kw) -> CacheConfig:
        """QuantWM's CacheConfig with the model's window: sink frames as sink chunks, a window of W frames as at
        most W / chunk - 1 committed chunks held beside the one being generated. A window or sink that is not a
        whole number of chunks is rounded up to whole chunks (QuantWM evicts whole chunks) and said in `notes`."""
        window, sink = self.window(model)
        chunk = self.chunk_frames(model)
        sink_chunks, max_chunks, rounded = frame_window(window, sink, chunk)
        if notes is not None and rounded:
            notes.append(f"{self.title}'s window ({window} latent frames, sink {sink}) is not a whole number of "
                         f"{chunk}-frame chunks: QuantWM held sink {sink_chunks * chunk} and "
                         f"{(max_chunks or 0) * chunk + chunk} frames in all (whole chunks)")
        return CacheConfig(layout="BLHD", sink_chunks=sink_chunks, max_chunks=max_chunks, **kw)

    def load(self, folder, device: str = "cpu") -> torch.nn.Module:
        """The model from a FastVideo transformer folder (or a model folder with transformer/), by FastVideo's own
        loader (runtime.load_transformer)."""
        return runtime.load_transformer(folder, self.config_cls(), self.class_name, device).eval()

    def save(self, model: torch.nn.Module, folder, arch: dict | None = None):
        """`model` as a FastVideo transformer folder (config.json with `arch`, default the tiny one)."""
        return runtime.save_transformer(model, folder, self.class_name, arch or self.tiny_arch())

    def build_tiny(self, seed: int = 0) -> torch.nn.Module:
        """A randomly initialised model of FastVideo's class at `tiny_arch()` (float32, CPU)."""
        runtime.init_single_process()
        cfg = self.config_cls()()
        cfg.update_model_arch(dict(self.tiny_arch()))
        with torch.random.fork_rng(devices=[]), runtime.sdpa_backend_on_cpu():
            torch.manual_seed(seed)
            model = self.model_cls()(cfg, {})
            init_linear_layers(model, seed)
            randomize_zeros(model, seed)
        return model.eval()


CHUNK_FIELDS = ("chunk_size", "num_frames_per_block", "num_frame_per_block")  # the names FastVideo's configs use


def _chunk_of(arch: dict) -> int:
    for name in CHUNK_FIELDS:
        if arch.get(name):
            return int(arch[name])
    raise ValueError(f"the model's config names no chunk length (one of {', '.join(CHUNK_FIELDS)})")


def init_linear_layers(model: torch.nn.Module, seed: int) -> None:
    """Seeded values for FastVideo's own linear layers, which allocate with torch.empty and leave the values to the
    checkpoint (fastvideo/layers/linear.py): weights N(0, 1/fan_in), biases N(0, 0.02^2)."""
    LinearBase = runtime.module("fastvideo.layers.linear").LinearBase
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for layer in (m for m in model.modules() if isinstance(m, LinearBase)):
            for name, p in layer.named_parameters(recurse=False):
                std = p.shape[-1] ** -0.5 if name == "weight" else 0.02
                p.copy_(std * torch.randn(p.shape, generator=g).to(p.dtype))


def randomize_zeros(model: torch.nn.Module, seed: int) -> None:
    """Give parameters a release initialises to zero (output heads, gates, modulation) small random values, so a
    tiny model's every path carries signal."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.numel() and p.dim() >= 1 and not p.is_meta and bool((p == 0).all()):
                p.copy_(0.02 * torch.randn(p.shape, generator=g).to(p.dtype))


@contextmanager
def swapped_forwards(modules: list[torch.nn.Module], make: Callable[[int, torch.nn.Module], Callable],
                     name: str = "forward") -> Iterator[None]:
    """Replace method `name` (forward by default) of modules[i] with make(i, modules[i]) while inside; restored on
    exit."""
    saved = [m.__dict__.get(name) for m in modules]
    try:
        for i, m in enumerate(modules):
            setattr(m, name, make(i, m))
        yield
    finally:
        for m, f in zip(modules, saved, strict=True):
            if f is None:
                m.__dict__.pop(name, None)
            else:
                setattr(m, name, f)


def own_kv_cache(layers: int, tokens: int, heads: int, head_dim: int, device, batch: int = 1) -> list[dict]:
    """FastVideo's own per-block cache in the Self-Forcing form its causal pipelines allocate: preallocated bf16
    `k`, `v` (batch, tokens, heads, head_dim) and the `global_end_index` / `local_end_index` counters."""
    def entry() -> dict:
        return {"k": torch.zeros(batch, tokens, heads, head_dim, dtype=torch.bfloat16, device=device),
                "v": torch.zeros(batch, tokens, heads, head_dim, dtype=torch.bfloat16, device=device),
                "global_end_index": torch.zeros(1, dtype=torch.long, device=device),
                "local_end_index": torch.zeros(1, dtype=torch.long, device=device)}
    return [entry() for _ in range(layers)]


def at(attn: ChunkedAttention | None, chunk: int, commit: bool = False):
    """`attn.at(chunk, commit)`, or nothing for FastVideo's own path (attn None)."""
    return attn.at(chunk, commit=commit) if attn is not None else nullcontext()


def hooked(hooks: Callable[[], object], attn: ChunkedAttention | None):
    """The model's attention hooks (a context manager from `hooks()`) when attn is given, else nothing."""
    return hooks() if attn is not None else nullcontext()


def check_chunk(attn: ChunkedAttention, current_start: int, chunk_tokens: int) -> None:
    """The pipeline's token offset must be where the cache's position says chunk `attn.chunk` starts."""
    if attn.chunk is None:
        raise ValueError("no chunk position set: run the model inside `with attention.at(chunk, commit=...)`")
    if current_start != attn.chunk * chunk_tokens:
        raise ValueError(f"the model is at token {current_start}, but the cache at chunk {attn.chunk} "
                         f"(token {attn.chunk * chunk_tokens})")


def read_map(cache, chunk: int, chunk_frames: int, layer: int = 0) -> dict:
    """Which latent frames chunk `chunk`'s queries read from `cache` (layer `layer`, committed chunks) and how each is
    held: {"chunk", "frames", "read": {"bf16": [...], "quantized": [...]}}."""
    read = {"bf16": [], "quantized": []}
    for span in cache.inspect(layer):
        if span.index >= chunk:
            continue
        for c in range(span.index, span.index + span.n_chunks):
            read["quantized" if span.quantized else "bf16"] += list(range(c * chunk_frames, (c + 1) * chunk_frames))
    return {"chunk": chunk, "frames": list(range(chunk * chunk_frames, (chunk + 1) * chunk_frames)), "read": read}
