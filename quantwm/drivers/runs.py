"""A rollout's name and its compact record: `RunKey` (the settings that determine a rollout, printable and
parseable as a run id), `Record` (what the app shows and recomputes from, its memory a `CacheMemory`), the
attention logits of a probed chunk (`probe_logits`) and a built-in run's pair of records as the contents of a run
file (`builtin_run`), which `views.RunView` shows like any opened run."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch

from ..core.cache import CacheConfig, CacheMemory, jensen_bias
from ..evaluation import diagnostics as D
from ..evaluation import metrics as M
from ..evaluation.runfile import Run, RunFacts, memory_meta
from ..world.scene import TRAIN_SEED_BASE, TRAJECTORIES, WORLDS

MiB = 2 ** 20


@dataclass(frozen=True)
class RunKey:
    """The settings that determine a rollout; `id` is its printable, parseable name: "seed=6 place loop quantwm kv
    budget=2.5 32f", the world kind after the seed except for photo worlds (the first ids had no world: one without
    it parses as a photo world, "seed=4 loop quantwm kv budget=2.5 32f")."""

    seed: int = 0
    trajectory: str = "loop"
    method: str = "quantwm"
    target: str = "kv"
    bits: int = 2
    frames: int = 32
    budget: float | None = None  # bits per element: the method configures itself within it (replaces `bits`)
    world: str = "photo"  # the world kind (`scene.WORLDS`): photo mosaic, procedural or one held-out place

    def __post_init__(self):
        if self.world not in WORLDS:
            raise ValueError(f"unknown world {self.world!r}; known: {', '.join(WORLDS)}")
        if self.trajectory not in TRAJECTORIES:
            raise ValueError(f"unknown trajectory {self.trajectory!r}; known: {', '.join(TRAJECTORIES)}")
        if not 0 <= self.seed < TRAIN_SEED_BASE:
            raise ValueError(f"world seed must lie in [0, {TRAIN_SEED_BASE}) (the evaluation worlds, of held-out "
                             f"photographs; training worlds use the seeds above), got {self.seed}")
        self.cache_config()  # validates method, target and bits with the cache's own messages

    def cache_config(self) -> CacheConfig:
        """The rollout's cache; it keeps the history queries' S for every method (the energy view reads it)."""
        return CacheConfig(method=self.method, target=self.target, k_bits=self.bits, v_bits=self.bits,
                           budget=None if self.method == "bf16" else self.budget, track_queries=True)

    @property
    def id(self) -> str:
        size = f"{self.bits}-bit" if self.budget is None else f"budget={self.budget:g}"
        world = "" if self.world == "photo" else f" {self.world}"
        return f"seed={self.seed}{world} {self.trajectory} {self.method} {self.target} {size} {self.frames}f"

    @classmethod
    def parse(cls, text: str) -> RunKey:
        """Inverse of `id`; ValueError for anything else."""
        if not str(text or "").strip():
            raise ValueError("Generate a run first (or open a recorded one): no run is shown yet")
        bad = (f"{str(text)!r:.120} is not a run id: a run id names a run of this app, such as "
               "'seed=6 place loop quantwm kv budget=2.5 32f' (press Generate) or an opened run file")
        parts = str(text).split()
        world = parts.pop(1) if len(parts) == 7 and parts[1] in WORLDS else "photo"  # ids without one: photo
        try:
            seed, traj, method, target, size, frames = parts if len(parts) == 6 else [None] * 6
            if not (seed and seed.startswith("seed=") and (size.endswith("-bit") or size.startswith("budget="))
                    and frames.endswith("f")):
                raise ValueError(bad)
            bits, budget = (int(size[:-4]), None) if size.endswith("-bit") else (2, float(size[7:]))
            seed, frames = int(seed[5:]), int(frames[:-1])
        except ValueError:  # the shape or a number of the id is wrong: say what an id reads like
            raise ValueError(bad) from None
        try:
            return cls(seed, traj, method, target, bits, frames, budget, world)
        except ValueError as e:  # well formed, but a setting is unknown or out of range: say which
            raise ValueError(f"{str(text)!r:.120} is not a run id: {e}") from None

    def reference(self) -> RunKey:
        return replace(self, method="bf16", target="kv", bits=2, budget=None)


@dataclass
class Record:
    """One rollout, compact: what the app shows and recomputes from."""

    key: RunKey
    frames: torch.Tensor  # (T, H, W, 3) float in [0, 1]
    probes: list
    k_exact: list  # per layer (H, L, D)
    k_stored: list
    v_exact: list
    v_stored: list
    stats: list  # per layer S (H, D, D)
    k_steps: list | None  # per layer Δ of the stored keys (H, L, D) for +jensen methods (its logit bias), else None
    memory: CacheMemory  # the cache's memory report at the end of the rollout
    seconds: float
    flow: torch.Tensor | None = None  # BF16 records: the optical flow every warping error against it uses
    budget_choice: dict | None = None  # the cache's {kind: options} a budget chose (`KVCache.budget_choice`)
    coverage: list | None = None  # per frame, the share of its view the context frames saw (1: a revisit)
    channel_bits: dict | None = None  # {kind: {bits: channels}} where channels have widths of their own (the allocator)
    place_shift_rate: float | None = None  # share of probed top-1s that moved to another world place (world.evaluate)
    metrics: dict = field(default_factory=dict)  # the studies' metrics of this record, computed once (studies.py)

    def nbytes(self) -> int:
        """Bytes of every tensor the record holds (what it costs the results cache)."""
        tensors = [self.frames, *self.k_exact, *self.k_stored, *self.v_exact, *self.v_stored, *self.stats,
                   *(self.k_steps or []), *([self.flow] if self.flow is not None else [])]
        for p in self.probes:
            for name in ("top1_exact", "top1_quant", "q", "same_place_mass", "top1_prob"):
                tensors += getattr(p, name)
        return sum(t.numel() * t.element_size() for t in tensors)

    def reference_flow(self) -> torch.Tensor:
        """Optical flow (T-1, H, W, 2) of a BF16 record's frames, computed once and kept with the record."""
        if self.flow is None:
            self.flow = M.reference_flow(self.frames)
        return self.flow

    def frames_uint8(self) -> torch.Tensor:
        return (self.frames * 255).round().to(torch.uint8)


def probe_logits(rec: Record, probe, layer: int, head: int, chunk_tokens: int,
                 queries=slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
    """(n_queries, n_cached) attention logits of a probed chunk's queries (`queries`: an index or slice of the
    chunk's N; default all) in (layer, head) over the cache that chunk saw, under exact and under stored keys
    (with the +jensen bias where the method applies it)."""
    k_seen = D.seen_by_chunk(rec.k_exact[layer], rec.k_stored[layer], probe.chunk, chunk_tokens, 1)
    q = probe.q[layer][head][queries].cpu()
    bias = None
    if rec.k_steps is not None:  # +jensen: the logits the method compares carry its bias
        steps = D.seen_by_chunk(torch.zeros_like(rec.k_steps[layer]), rec.k_steps[layer], probe.chunk, chunk_tokens, 1)
        bias = jensen_bias(q, steps[head], 1.0)
    return M.probe_logits(q, rec.k_exact[layer][head, :k_seen.shape[1]], k_seen[head], 1.0, bias)


def builtin_facts(cfg) -> RunFacts:
    """The built-in model's facts in a run file's terms (no VAE: one output frame per latent frame)."""
    return RunFacts("quantwm built-in world model", cfg.layers, cfg.heads, cfg.head_dim, (cfg.view, cfg.view),
                    cfg.chunk_frames, cfg.context_frames, vae_spatial=1, patch=cfg.patch, vae_temporal=1)


def builtin_run(cfg, ref: Record, rec: Record, logit_layers=(), logit_heads=(), extra: dict | None = None) -> Run:
    """The run file contents (`runfile.Run`) of a built-in method record `rec` against its BF16 record `ref`, with
    the logits of `logit_layers` x `logit_heads` (none by default: `RunView.of_records` computes any on demand);
    `extra`: more metadata (summary, series, source)."""
    key = rec.key
    chunk_tokens = cfg.chunk_frames * cfg.tokens_per_frame
    top1, logits = {}, {}
    for p in rec.probes:
        top1[p.chunk] = (torch.stack(p.top1_exact).int(), torch.stack(p.top1_quant).int())
        if logit_layers and logit_heads:
            pairs = [[probe_logits(rec, p, l, h, chunk_tokens) for h in logit_heads] for l in logit_layers]
            logits[p.chunk] = tuple(torch.stack([torch.stack([hh[i] for hh in row]) for row in pairs]) for i in (0, 1))
    meta = {"method": key.method, "target": key.target, "bits": key.bits, **memory_meta(rec.memory),
            "logit_layers": list(logit_layers), "logit_heads": list(logit_heads), **(extra or {})}
    return Run(builtin_facts(cfg), meta, ref.frames_uint8(), rec.frames_uint8(), torch.stack(rec.stats).float(),
               top1, logits)


@contextmanager
def denormals_flushed():
    """Denormal floats read and written as 0 on this thread while the block runs (x86 FTZ/DAZ, a per-thread flag:
    rollouts on threads already running are untouched; a thread started inside the block would inherit it, so the
    block starts none), then back to torch's default, off. A softmax over logits ~150 apart
    leaves probabilities under 1e-38 that make a CPU's matmul about 7x slower; next to the row's largest
    probability (at least 1/L) a float32 sum cannot hold them, so what is computed does not change
    (tests/test_studies.py compares the attention error both ways). A no-op where the CPU has no such flag."""
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)
