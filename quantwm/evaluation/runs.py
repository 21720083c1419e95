"""A rollout's name and its compact record: `RunKey` (the settings that determine a rollout, printable and
parseable as a run id) and `Record` (what the app shows and recomputes from), plus the memory figures every
recorder reports (`cache_memory_mb`), and the run file of a built-in run (`make_run`)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..core.cache import CacheConfig
from ..world.scene import TRAIN_SEED_BASE, TRAJECTORIES

MiB = 2 ** 20


@dataclass(frozen=True)
class RunKey:
    """The settings that determine a rollout; `id` is its printable, parseable name."""

    seed: int = 0
    trajectory: str = "loop"
    method: str = "quantwm"
    target: str = "kv"
    bits: int = 2
    frames: int = 32
    budget: float | None = None  # bits per element: the method configures itself within it (replaces `bits`)

    def __post_init__(self):
        if self.trajectory not in TRAJECTORIES:
            raise ValueError(f"unknown trajectory {self.trajectory!r}; known: {', '.join(TRAJECTORIES)}")
        if not 0 <= self.seed < TRAIN_SEED_BASE:
            raise ValueError(f"world seed must lie in [0, {TRAIN_SEED_BASE}) (the evaluation worlds, of held-out "
                             f"photographs; training worlds use the seeds above), got {self.seed}")
        self.cache_config()  # validates method, target and bits with the cache's own messages

    def cache_config(self) -> CacheConfig:
        return CacheConfig(method=self.method, target=self.target, k_bits=self.bits, v_bits=self.bits,
                           budget=None if self.method == "bf16" else self.budget)

    @property
    def id(self) -> str:
        size = f"{self.bits}-bit" if self.budget is None else f"budget={self.budget:g}"
        return f"seed={self.seed} {self.trajectory} {self.method} {self.target} {size} {self.frames}f"

    @classmethod
    def parse(cls, text: str) -> RunKey:
        """Inverse of `id`; ValueError for anything else."""
        if not str(text or "").strip():
            raise ValueError("Generate a run first (or open a recorded one): no run is shown yet")
        try:
            seed, traj, method, target, size, frames = str(text).split()
            if not (seed.startswith("seed=") and (size.endswith("-bit") or size.startswith("budget="))
                    and frames.endswith("f")):
                raise ValueError
            bits, budget = (int(size[:-4]), None) if size.endswith("-bit") else (2, float(size[7:]))
            return cls(int(seed[5:]), traj, method, target, bits, int(frames[:-1]), budget)
        except (ValueError, TypeError) as e:
            why = f": {e}" if str(e) else ""
            raise ValueError(f"not a run id: {text!r}{why} (generate first)") from None

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
    bits_per_element: float
    memory_mb: dict  # {"bf16": ..., "stored": ...}, full-precision chunks counted at 2 bytes per element
    seconds: float
    flow: torch.Tensor | None = None  # BF16 records: the optical flow every warping error against it uses
    budget_choice: dict | None = None  # the cache's {kind: options} a budget chose (`KVCache.budget_choice`)
    coverage: list | None = None  # per frame, the share of its view the context frames saw (1: a revisit)

    def nbytes(self) -> int:
        """Bytes of every tensor the record holds (what it costs the results cache)."""
        tensors = [self.frames, *self.k_exact, *self.k_stored, *self.v_exact, *self.v_stored, *self.stats,
                   *(self.k_steps or []), *([self.flow] if self.flow is not None else [])]
        for p in self.probes:
            for name in ("top1_exact", "top1_quant", "q", "same_place_mass", "top1_prob"):
                tensors += getattr(p, name)
        return sum(t.numel() * t.element_size() for t in tensors)


def cache_memory_mb(cache) -> dict:
    """{"bf16": MB the cache's K and V would take in BF16, "stored": MB as stored}, full-precision chunks
    (sink, recent) counted at 2 bytes per element, every quantized byte (codes, scales, codebooks, PSAC)."""
    m = cache.memory()
    full = sum(n for name, n in m.by_component.items() if name.endswith(".full"))
    qbytes = m.stored_bytes - full
    qelems = 8 * qbytes / m.bits_per_element if m.bits_per_element == m.bits_per_element else 0
    return {"bf16": m.bf16_mb, "stored": (qbytes + m.bf16_bytes - 2 * qelems) / MiB}


def make_run(wb, key: RunKey, logit_layers=(1,), logit_heads=(0,), source: dict | None = None,
             progress: Callable | None = None):
    """The run file contents (`runfile.Run`) of `key` against BF16, from the same rollouts the Workbench `wb`
    shows (the built-in model's `quantwm record`)."""
    from .runfile import Run, RunFacts

    c = wb.cfg
    for name, vals, n in (("logit layer", logit_layers, c.layers), ("logit head", logit_heads, c.heads)):
        bad = [v for v in vals if not 0 <= v < n]
        if bad:
            raise ValueError(f"{name} {bad[0]} out of range: the model has {n}")
    ref, rec = wb.pair(key, progress)
    shown = wb.compare(key)  # the numbers the app shows for this run, from the float frames
    facts = RunFacts("quantwm built-in world model", c.layers, c.heads, c.head_dim, (c.view, c.view),
                     c.chunk_frames, c.context_frames, vae_spatial=1, patch=c.patch, vae_temporal=1)
    top1, logits = {}, {}
    for p in rec.probes:
        top1[p.chunk] = (torch.stack(p.top1_exact).int(), torch.stack(p.top1_quant).int())
        if logit_layers and logit_heads:
            pairs = [[wb.probe_logits(rec, p, l, h) for h in logit_heads] for l in logit_layers]
            logits[p.chunk] = tuple(torch.stack([torch.stack([hh[i] for hh in row]) for row in pairs]) for i in (0, 1))
    meta = {"method": key.method, "target": key.target, "bits": key.bits, "bits_per_element": rec.bits_per_element,
            "memory_mb": rec.memory_mb, "logit_layers": list(logit_layers), "logit_heads": list(logit_heads),
            "summary": shown["summary"], "series": shown["series"],
            "source": {"seed": key.seed, "trajectory": key.trajectory, "frames": key.frames, **(source or {})}}
    return Run(facts, meta, torch.from_numpy(wb.frames_uint8(ref)), torch.from_numpy(wb.frames_uint8(rec)),
               torch.stack(rec.stats).float(), top1, logits)
