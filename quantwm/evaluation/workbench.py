"""The diagnostics app's compute side: the built-in world model loaded once, rollouts cached by settings.

    wb = Workbench()                                  # loads assets/world_model.safetensors
    key = RunKey(seed=0, trajectory="loop", method="quantwm", target="kv", bits=2, frames=32)
    cmp = wb.compare(key)                             # BF16 and the method, same seeds, per-frame series
    wb.pixel_trace(key.id, frame=20, x=31, y=12, layer=1, head=0)

Everything returned is a plain value (numpy arrays, lists, floats, dicts) for the app's handlers. Each
rollout is kept as a compact record (frames, probes, exact and stored K/V, query statistics, memory) in
a results cache shared by every user, bounded in bytes (`cache_mb`) and evicted least recently used
first. A run is never kept without its BF16 reference: using a run also uses its reference, and evicting
a reference evicts the runs compared against it; `on_evict` callbacks hear of every eviction (the app
deletes the run's videos). The views (`frame_view`, `pixel_trace`, `energy`) never generate: for an
evicted run they say so. One generation runs at a time: a second waits for the first (the app's queue
shows its users their position). `limits` (`quantwm.evaluation.limits.Limits`) bounds what a request may
ask for; `calibrate()` measures this machine's speed for it. On CUDA the model runs there; on CPU torch
uses `threads` intra-op threads (1 by default: these are small matrices, and more threads only spin
against other work on the machine).
"""
from __future__ import annotations

import ctypes
import gc
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..core.cache import CacheConfig, jensen_bias
from ..core.methods import get_method, known_methods
from ..world.evaluate import shift_rate
from ..world.generate import generate, load_world_model
from ..world.scene import TRAIN_SEED_BASE, TRAJECTORIES
from . import diagnostics as D
from . import metrics as M
from .limits import Limits, fit_chunk_seconds, generated_chunk_tokens

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


def release_memory() -> None:
    """Give freed memory back to the OS (glibc keeps freed heap pages otherwise, and a long-running server's
    resident size would creep up after every eviction)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


class Workbench:
    def __init__(self, weights: str | None = None, device: str | None = None, threads: int = 1,
                 cache_mb: float | None = None, limits: Limits | None = None, model=None):
        """`model`: an already loaded world model to share (instead of loading `weights`); `limits`: the
        request limits (default: this machine's, without a speed calibration); `cache_mb` overrides the
        results cache's budget."""
        self.model = model if model is not None else load_world_model(weights) if weights else load_world_model()
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cpu":
            torch.set_num_threads(max(1, int(threads)))
        self.model.to(self.device)
        self.cfg = self.model.cfg
        self.limits = limits or Limits.from_machine(self.cfg, len(self.methods()), cache_mb=cache_mb)
        self.cache_bytes = int((cache_mb or self.limits.cache_mb) * MiB)
        self._records: OrderedDict[RunKey, Record] = OrderedDict()
        self._lock = threading.Lock()  # one generation at a time
        self._cache_lock = threading.RLock()  # the records table
        self._evicted: set[RunKey] = set()
        self.on_evict: list[Callable[[RunKey], None]] = []
        self.running: str | None = None
        self._loaded: dict[str, LoadedRun] = {}  # run files opened (`open_run`), by run id, oldest first
        self.max_opened = 8

    @contextmanager
    def generation(self):
        """Hold the one-generation-at-a-time lock (the live backend's generations share it)."""
        with self._lock:
            yield

    def set_limits(self, limits: Limits) -> None:
        """New limits; the results cache takes their budget (evicting at once if it shrank)."""
        self.limits = limits
        self.cache_bytes = int(limits.cache_mb * MiB)
        with self._cache_lock:
            self._evict(set())

    # ---- facts --------------------------------------------------------------------------------
    def describe_device(self) -> str:
        if self.device.startswith("cuda"):
            return f"CUDA ({torch.cuda.get_device_name(0)})"
        return f"CPU ({torch.get_num_threads()} torch thread(s))"

    @staticmethod
    def methods() -> list[str]:
        """Every registered method the built-in model can run (not the pre-RoPE ones: its RoPE runs over world
        coordinates the cache does not know)."""
        return [m for m in known_methods() if not get_method(m).pre_rope]

    def model_facts(self) -> dict:
        c = self.cfg
        return {"layers": c.layers, "heads": c.heads, "head_dim": c.head_dim, "frame_size": c.view * c.patch,
                "grid": (c.view, c.view), "chunk_frames": c.chunk_frames, "context_frames": c.context_frames}

    def check_frames(self, n: int) -> None:
        """A valid frame count within this server's limit (ValueError naming what is wrong)."""
        c = self.cfg
        if n <= c.context_frames or (n - c.context_frames) % c.chunk_frames:
            raise ValueError(f"frames must exceed {c.context_frames} by a multiple of {c.chunk_frames}, got {n}")
        self.limits.check_frames(n)

    def calibrate(self, generated_chunks: int = 8) -> tuple[float, float]:
        """Time each generated chunk of a short BF16 rollout here (a training world) after a warm-up one;
        returns (a, b) of seconds per chunk = a + b x cached tokens (the time model of `limits`)."""
        c = self.cfg
        generate(self.model, TRAIN_SEED_BASE, "loop", c.context_frames + c.chunk_frames, CacheConfig())  # warm-up
        frames = c.context_frames + generated_chunks * c.chunk_frames
        stamps = [time.perf_counter()]
        generate(self.model, TRAIN_SEED_BASE, "loop", frames, CacheConfig(),
                 progress=lambda done, total: stamps.append(time.perf_counter()))
        first = c.context_frames // c.chunk_frames  # the context chunks are only committed
        seconds = [b - a for a, b in zip(stamps[first:], stamps[first + 1:])]
        return fit_chunk_seconds(generated_chunk_tokens(c, frames), seconds)

    # ---- rollouts -----------------------------------------------------------------------------
    def cached(self, key: RunKey) -> bool:
        return key in self._records

    def cached_bytes(self) -> int:
        with self._cache_lock:
            return sum(r.nbytes() for r in self._records.values())

    def _touch(self, key: RunKey) -> Record | None:
        """The cached record (its reference used with it), or None."""
        with self._cache_lock:
            rec = self._records.get(key)
            if rec is not None:
                ref = key.reference()
                if ref in self._records:
                    self._records.move_to_end(ref)
                self._records.move_to_end(key)
            return rec

    def run(self, key: RunKey, progress: Callable | None = None, keep: tuple = ()) -> Record:
        """The rollout for `key`, from the cache or generated now (waiting for a running generation first);
        `keep`: keys the eviction that makes room must spare (the pair being built)."""
        rec = self._touch(key)
        if rec is not None:
            return rec
        self.check_frames(key.frames)
        with self._lock:
            rec = self._touch(key)  # made by the generation this one waited for?
            if rec is not None:
                return rec
            self.running = key.id
            try:
                rec = self._generate(key, progress)
            finally:
                self.running = None
        with self._cache_lock:
            self._records[key] = rec
            self._evicted.discard(key)
            self._evict({key, *keep})
        return rec

    def _evict(self, keep: set) -> None:
        """Drop least recently used records until the cache fits its budget; a reference takes the runs
        compared against it along."""
        sizes = {k: r.nbytes() for k, r in self._records.items()}
        total = sum(sizes.values())
        for k in list(self._records):
            if total <= self.cache_bytes:
                break
            if k in keep or k not in self._records:
                continue
            if k.method == "bf16" and any(d.reference() == k for d in keep):
                continue  # the reference of a run being kept stays
            gone = [k] + ([d for d in self._records if d != k and d.reference() == k] if k.method == "bf16" else [])
            for d in gone:
                del self._records[d]
                total -= sizes[d]
                self._evicted.add(d)
                for callback in self.on_evict:
                    callback(d)
        if len(self._records) < len(sizes):
            release_memory()  # once, after everything this call evicted

    def _generate(self, key: RunKey, progress: Callable | None) -> Record:
        rec = self._rollout(key, progress)
        for name, t in (("frames", rec.frames), *((f"layer {l} keys", k) for l, k in enumerate(rec.k_stored)),
                        *((f"layer {l} values", v) for l, v in enumerate(rec.v_stored))):
            if not torch.isfinite(t).all():
                raise ValueError(f"the {key.method} run produced non-finite {name} (NaN or Inf); nothing was kept. "
                                 "Try more bits or another method")
        return rec

    def _rollout(self, key: RunKey, progress: Callable | None) -> Record:
        t0 = time.time()
        run = generate(self.model, key.seed, key.trajectory, key.frames, key.cache_config(), progress=progress)
        c, L = run.cache, self.cfg.layers
        k_exact = [c.keys(l, exact=True)[0].cpu() for l in range(L)]
        v_exact = [c.values(l, exact=True)[0].cpu() for l in range(L)]
        bpe = c.bits_per_element()
        memory = cache_memory_mb(c)
        steps = [c.key_steps(l)[0].cpu() for l in range(L)] if c.config.jensen else None
        return Record(key, run.frames.cpu(), run.probes, k_exact, [c.keys(l)[0].cpu() for l in range(L)],
                      v_exact, [c.values(l)[0].cpu() for l in range(L)],
                      [c.query_stats(l).cpu() for l in range(L)], steps, bpe, memory, time.time() - t0)

    def pair(self, key: RunKey, progress: Callable | None = None) -> tuple[Record, Record]:
        """(BF16 record, method record) with the same world, trajectory and noise."""
        ref_key = key.reference()
        todo = [k for k in dict.fromkeys([ref_key, key]) if k not in self._records]
        done = [0]

        def step(i, n):
            if progress:
                progress(done[0] * n + i, n * len(todo))
        ref = self.run(ref_key, step, keep=(key,))
        done[0] = int(ref_key in todo)
        return ref, self.run(key, step, keep=(ref_key,))

    def compare(self, key: RunKey, progress: Callable | None = None) -> dict:
        """Per-frame series of the method against BF16 plus the summary numbers."""
        ref, rec = self.pair(key, progress)
        c = self.cfg
        series = D.frame_series(rec.frames, ref.frames, c.context_frames, self.reference_flow(ref))
        series["shift_rate"] = D.shift_rate_per_frame(rec.probes, key.frames, c.chunk_frames, c.tokens_per_frame)
        return {"key": key.id, "bf16": self.frames_uint8(ref), "method": self.frames_uint8(rec),
                "series": series, "summary": self.summary(ref, rec, lpips=False),
                "worst": D.worst_frames(series["tdiff"][c.context_frames:], 3),
                "seconds": ref.seconds + rec.seconds}

    @staticmethod
    def frames_uint8(rec: Record) -> np.ndarray:
        return (rec.frames * 255).round().to(torch.uint8).numpy()

    def summary(self, ref: Record, rec: Record, lpips: bool = True) -> dict:
        """Clip-level numbers of `rec` against `ref` (generated frames only)."""
        ctx = self.cfg.context_frames
        out = {**D.clip_metrics(rec.frames, ref.frames, ctx, self.reference_flow(ref)),
               "shift_rate": shift_rate(rec), "bits_per_element": rec.bits_per_element,
               "compression": 16 / rec.bits_per_element if rec.bits_per_element == rec.bits_per_element else 1.0,
               "memory_bf16_mb": rec.memory_mb["bf16"], "memory_mb": rec.memory_mb["stored"]}
        if lpips:
            out["lpips"] = float(M.lpips(rec.frames[ctx:], ref.frames[ctx:]).mean())
        return out

    @staticmethod
    def reference_flow(ref: Record) -> torch.Tensor:
        """Optical flow (T-1, H, W, 2) of a BF16 record's frames, computed once and kept with the record."""
        if ref.flow is None:
            ref.flow = M.reference_flow(ref.frames)
        return ref.flow

    def record(self, run_id: str) -> Record:
        """A cached record (used: it and its reference move to the recent end); ValueError when it was
        never generated or was evicted, saying which."""
        key = RunKey.parse(run_id)
        rec = self._touch(key)
        if rec is None:
            if key in self._evicted:
                raise ValueError(f"run {run_id!r} was evicted from the shared results cache "
                                 f"({self.cache_bytes / MiB:.0f} MB) to make room for newer runs: press Generate "
                                 "to make it again")
            raise ValueError(f"run {run_id!r} is not generated: press Generate")
        return rec

    # ---- views of one run ---------------------------------------------------------------------
    def check_frame(self, rec: Record, frame: int) -> int:
        T = rec.frames.shape[0]
        if not 0 <= int(frame) < T:
            raise ValueError(f"frame {frame} out of range: the run has frames 0..{T - 1}")
        return int(frame)

    def frame_view(self, run_id: str, frame: int, layer: int | None = None, head: int | None = None) -> dict:
        """Both frames (uint8), the flicker and warping-error maps (H, W) and the top-1 jump map (h, w) or
        None (context)."""
        if run_id in self._loaded:
            return self._loaded[run_id].frame_view(frame, layer, head)
        rec = self.record(run_id)
        ref = self.record(rec.key.reference().id)
        t = self.check_frame(rec, frame)
        c = self.cfg
        flick, warp = D.frame_maps(rec.frames, ref.frames, self.reference_flow(ref), t)
        jumps = D.frame_jumps(rec.probes, t, c.chunk_frames, c.tokens_per_frame, layer, head)
        return {"frame": t, "bf16": self.frames_uint8(ref)[t], "method": self.frames_uint8(rec)[t],
                "flicker": flick.numpy(), "warp": warp.numpy(),
                "jumps": None if jumps is None else jumps.reshape(c.view, c.view).numpy(),
                "context": t < c.context_frames}

    def pixel_trace(self, run_id: str, frame: int, x: int, y: int, layer: int = 0, head: int = 0) -> dict:
        """Trace pixel (x, y) of `frame` to its Query's top-1 cached source, exact vs stored keys."""
        if run_id in self._loaded:
            return self._loaded[run_id].pixel_trace(frame, x, y, layer, head)
        rec = self.record(run_id)
        t = self.check_frame(rec, frame)
        c = self.cfg
        if not 0 <= layer < c.layers or not 0 <= head < c.heads:
            raise ValueError(f"layer/head ({layer}, {head}) out of range: {c.layers} layers, {c.heads} heads")
        size = tuple(rec.frames.shape[1:3])
        row, col = D.pixel_to_patch(int(x), int(y), size, (c.view, c.view))
        if t < c.context_frames:
            raise ValueError(f"frame {t} is a context frame (given, not generated): its queries were not "
                             f"probed; pick a frame >= {c.context_frames}")
        probe = next(p for p in rec.probes if p.chunk == t // c.chunk_frames)
        qi = (t - probe.chunk * c.chunk_frames) * c.tokens_per_frame + row * c.view + col
        le, lq = self.probe_logits(rec, probe, layer, head, queries=[qi])  # the clicked query only
        exact, stored = (x[0].reshape(-1, c.tokens_per_frame) for x in (le, lq))
        src_e, src_q = int(probe.top1_exact[layer][head, qi]), int(probe.top1_quant[layer][head, qi])
        return {"query": (t, row, col), "layer": layer, "head": head,
                "source_bf16": D.token_coords(src_e, (c.view, c.view)),
                "source_method": D.token_coords(src_q, (c.view, c.view)), "jumped": src_e != src_q,
                "logits_bf16": exact.numpy(), "logits_method": stored.numpy(), "frames": self.frames_uint8(rec),
                "method": rec.key.method, "grid": (c.view, c.view)}

    def probe_logits(self, rec: Record, probe, layer: int, head: int,
                     queries=slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """(n_queries, n_cached) attention logits of a probed chunk's queries (`queries`: an index or slice of the
        chunk's N; default all) in (layer, head) over the cache that chunk saw, under exact and under stored keys
        (with the +jensen bias where the method applies it)."""
        c = self.cfg
        chunk_tokens = c.chunk_frames * c.tokens_per_frame
        k_seen = D.seen_by_chunk(rec.k_exact[layer], rec.k_stored[layer], probe.chunk, chunk_tokens, 1)
        q = probe.q[layer][head][queries].cpu()
        bias = None
        if rec.k_steps is not None:  # +jensen: the logits the method compares carry its bias
            steps = D.seen_by_chunk(torch.zeros_like(rec.k_steps[layer]), rec.k_steps[layer], probe.chunk,
                                    chunk_tokens, 1)
            bias = jensen_bias(q, steps[head], 1.0)
        exact = q @ rec.k_exact[layer][head, :k_seen.shape[1]].float().T
        stored = q @ k_seen[head].float().T
        return exact, stored if bias is None else stored + bias

    def energy(self, run_id: str, rank: int = 8) -> list[dict]:
        """Per layer: the history-Query spectrum the method's cache accumulated (energy_spectrum as numpy)."""
        if run_id in self._loaded:
            return self._loaded[run_id].energy(rank)
        rec = self.record(run_id)
        return [{k: v.numpy() for k, v in D.energy_spectrum(S, rank).items()} for S in rec.stats]

    # ---- run files ----------------------------------------------------------------------------
    def make_run(self, key: RunKey, logit_layers=(1,), logit_heads=(0,), source: dict | None = None,
                 progress: Callable | None = None):
        """The run file contents (`runfile.Run`) of `key` against BF16, from the same rollouts the app shows."""
        from .runfile import Run, RunFacts

        c = self.cfg
        for name, vals, n in (("logit layer", logit_layers, c.layers), ("logit head", logit_heads, c.heads)):
            bad = [v for v in vals if not 0 <= v < n]
            if bad:
                raise ValueError(f"{name} {bad[0]} out of range: the model has {n}")
        ref, rec = self.pair(key, progress)
        shown = self.compare(key)  # the numbers the app shows for this run, from the float frames
        facts = RunFacts("quantwm built-in world model", c.layers, c.heads, c.head_dim, (c.view, c.view),
                         c.chunk_frames, c.context_frames, vae_spatial=1, patch=c.patch, vae_temporal=1)
        top1, logits = {}, {}
        for p in rec.probes:
            top1[p.chunk] = (torch.stack(p.top1_exact).int(), torch.stack(p.top1_quant).int())
            if logit_layers and logit_heads:
                pairs = [[self.probe_logits(rec, p, l, h) for h in logit_heads] for l in logit_layers]
                logits[p.chunk] = tuple(torch.stack([torch.stack([hh[i] for hh in row]) for row in pairs]) for i in (0, 1))
        meta = {"method": key.method, "target": key.target, "bits": key.bits, "bits_per_element": rec.bits_per_element,
                "memory_mb": rec.memory_mb, "logit_layers": list(logit_layers), "logit_heads": list(logit_heads),
                "summary": shown["summary"], "series": shown["series"],
                "source": {"seed": key.seed, "trajectory": key.trajectory, "frames": key.frames, **(source or {})}}
        return Run(facts, meta, torch.from_numpy(self.frames_uint8(ref)), torch.from_numpy(self.frames_uint8(rec)),
                   torch.stack(rec.stats).float(), top1, logits)

    def open_run(self, path: str) -> str:
        """Open a run file (validated by `runfile.read_run`); returns the run id its views answer to."""
        import os

        from .runfile import read_run

        run = read_run(path)
        m = run.meta
        return self.add_run(run, f"file={os.path.basename(str(path))} {m['method']} {m['target']} {m['bits']}-bit")

    def add_run(self, run, run_id: str) -> str:
        """Serve the views of `run` (a `runfile.Run`, e.g. generated live) under `run_id`; the oldest of more
        than `max_opened` opened runs is dropped."""
        with self._cache_lock:
            self._loaded.pop(run_id, None)
            self._loaded[run_id] = LoadedRun(run, run_id)
            while len(self._loaded) > self.max_opened:  # the oldest opened run goes (and its videos)
                gone = next(iter(self._loaded))
                del self._loaded[gone]
                for callback in self.on_evict:
                    callback(gone)
        return run_id

    def frame_size(self, run_id: str) -> tuple[int, int]:
        """(H, W) of a run's output frames (an opened run's, else the built-in model's)."""
        lr = self._loaded.get(run_id)
        if lr is not None:
            return tuple(lr.run.bf16.shape[1:3])
        size = self.cfg.view * self.cfg.patch
        return size, size

    def opened_runs(self) -> list[str]:
        return list(self._loaded)

    def loaded(self, run_id: str) -> LoadedRun | None:
        return self._loaded.get(str(run_id))

    # ---- studies over several runs ------------------------------------------------------------
    def attention_error(self, rec: Record) -> float:
        """Relative error of the attention output over the cache, stored vs exact K/V, every probed chunk."""
        return D.probed_attention_error(rec.probes, rec.k_exact, rec.k_stored, rec.v_exact, rec.v_stored,
                                        self.cfg.chunk_frames * self.cfg.tokens_per_frame)

    def key_vs_value(self, key: RunKey, progress: Callable | None = None) -> list[dict]:
        """The method with Keys only and Values only quantized: errors of K and V beside what they cause."""
        rows = []
        keys = [replace(key, target="k"), replace(key, target="v")]
        for i, k in enumerate(keys):
            ref, rec = self.pair(k, (lambda a, n, i=i: progress(i * n + a, 2 * n)) if progress else None)
            ke = sum(M.rel_err(s, e) for s, e in zip(rec.k_stored, rec.k_exact)) / len(rec.k_exact)
            ve = sum(M.rel_err(s, e) for s, e in zip(rec.v_stored, rec.v_exact)) / len(rec.v_exact)
            rows.append({"target": k.target, "k_rel_err": ke, "v_rel_err": ve, "attn_out_rel_err": self.attention_error(rec),
                         **self.summary(ref, rec)})
        return rows

    def methods_table(self, key: RunKey, methods: list[str], progress: Callable | None = None,
                      left_out: dict | None = None) -> list[dict]:
        """Every method in `methods` on key's world, trajectory, target and bits, or, when the key carries a
        budget, each method configured within it (its "configuration" column says how; a method that cannot
        fit is skipped and its one-line reason put in `left_out`). Rows come in order of bits per element."""
        if not methods:
            raise ValueError("choose at least one method")
        keys = [replace(key, method=m) for m in methods]  # validates every name before any work
        self.check_frames(key.frames)
        if key.budget is not None:
            from ..core.budget import fit_methods

            span = self.cfg.chunk_frames * self.cfg.tokens_per_frame
            fitting, out = fit_methods(list(methods), key.budget, key.budget, self.cfg.head_dim, span, key.target)
            (left_out if left_out is not None else {}).update(out)
            keys = [k for k in keys if k.method in fitting]
        self.limits.check_methods(len(keys), key.frames)
        rows = []
        for i, k in enumerate(keys):
            ref, rec = self.pair(k, (lambda a, n, i=i: progress(i * n + a, len(keys) * n)) if progress else None)
            rows.append({"method": k.method, **self.summary(ref, rec), "configuration": self.configuration(k)})
        return sorted(rows, key=lambda r: r["bits_per_element"]) if key.budget is not None else rows

    def configuration(self, key: RunKey) -> str:
        """What the key's method runs as: its grid at `bits`, or what its budget rule chose for each half."""
        if key.method == "bf16":
            return "bf16"
        if key.budget is None:
            return f"{key.bits}-bit"
        from ..core.budget import configure, describe

        span = self.cfg.chunk_frames * self.cfg.tokens_per_frame
        return "; ".join(f"{kind}: {describe(configure(key.method, key.budget, self.cfg.head_dim, span, kind)[0])}"
                         for kind in "kv" if kind in key.target)


# ---- trace files ------------------------------------------------------------------------------------

def trace_query_view(path: str, method: str, target: str, bits: int, layer: int, head: int, query: int) -> dict:
    """One traced query under exact and `method`'s stored keys: logits (frames x positions), top-1 sources,
    the jump map of every query of the layer, and the trace's frames (uint8) when it holds them."""
    from .trace import read_trace

    trace = read_trace(path)
    r = D.trace_keys(trace, int(layer), method, target, int(bits))
    H, Nq, _ = r["q"].shape
    if not 0 <= head < H:
        raise ValueError(f"head {head} out of range: the trace has {H} heads")
    if not 0 <= query < Nq:
        raise ValueError(f"query {query} out of range: layer {layer} has {Nq} queries")
    tpf, grid = trace.tokens_per_frame, trace.frame_grid
    whole = r["k"].shape[1] % tpf == 0
    exact, stored = D.query_logits(r["q"][head, query], r["k"][head], r["k_hat"][head],
                                   tokens_per_frame=tpf if whole else None,
                                   bias=None if r["bias"] is None else r["bias"][head, query])
    if not whole:
        exact, stored = exact[None], stored[None]
    moved = (r["top1_exact"] != r["top1_quant"]).float()  # (H, Nq)
    e, q = int(r["top1_exact"][head, query]), int(r["top1_quant"][head, query])
    return {"logits_bf16": exact.numpy(), "logits_method": stored.numpy(),
            "source_bf16": D.token_coords(e, grid), "source_method": D.token_coords(q, grid), "jumped": e != q,
            "query_coords": D.token_coords(r["k"].shape[1] + query, grid),
            "jumps": moved.mean(0).numpy(), "shift_rate": float(moved.mean()), "heads": H, "queries": Nq,
            "layers": list(trace.layers), "grid": grid, "tokens_per_frame": tpf,
            "frames": None if trace.frames is None else trace.frames.numpy()}


def trace_energy(path: str, rank: int = 8) -> list[dict]:
    """Per traced layer: the spectrum of S from its history queries (q_hist, else q)."""
    from .trace import read_trace

    trace = read_trace(path)
    return [{k: v.numpy() for k, v in D.energy_spectrum(M.second_moment(t.get("q_hist", t["q"]).float()), rank).items()}
            for t in trace.layers.values()]


# ---- run files: any model's generation, opened in the app ---------------------------------------------

class LoadedRun:
    """The app's views (compare, frame_view, pixel_trace, energy) of a run file (`runfile.Run`), with the
    same return values as the Workbench's for a built-in run. Frames are output frames; probes, sources and
    logits live on latent frames (`RunFacts` maps between them)."""

    def __init__(self, run, run_id: str):
        from ..world.generate import ChunkProbe

        self.run, self.id, f = run, run_id, run.facts
        self.facts = f
        self.frames_bf16 = run.bf16.float() / 255
        self.frames_method = run.method.float() / 255
        self.probes = [ChunkProbe(c, top1_exact=list(e), top1_quant=list(q)) for c, (e, q) in sorted(run.top1.items())]
        self.flow = M.reference_flow(self.frames_bf16)
        self.context_frames = f.first_output_frame(f.context_frames) if f.context_frames else 0

    def model_facts(self) -> dict:
        f = self.facts
        return {"layers": f.layers, "heads": f.heads, "head_dim": f.head_dim, "frame_size": self.run.bf16.shape[1],
                "grid": f.latent_grid, "chunk_frames": f.chunk_frames, "context_frames": self.context_frames}

    def _latent_jumps(self, t: int, layer, head):
        f = self.facts
        lat = f.latent_frame(t)
        if f.chunk_of(lat) is None:
            return None  # a sink frame: never generated
        return D.frame_jumps(self.probes, lat - f.chunk_start, f.chunk_frames, f.tokens_per_frame, layer, head)

    def _cached(self, chunk: int, logits: torch.Tensor, src: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """One query's logits over the cache as (cached frames, tokens per frame), and a source's (frame, row,
        col). A cache with positions (a sink plus a window) is laid out by latent frame, NaN where it held none."""
        f = self.facts
        pos = self.run.positions.get(chunk)
        if pos is None:
            return logits.reshape(-1, f.tokens_per_frame), D.token_coords(src, f.latent_grid)
        grid = torch.full(((int(pos.max()) // f.tokens_per_frame + 1) * f.tokens_per_frame,), float("nan"))
        grid[pos] = logits.float()
        return grid.reshape(-1, f.tokens_per_frame), D.token_coords(int(pos[src]), f.latent_grid)

    def compare(self) -> dict:
        """The Generate tab's numbers: as recorded when the file carries them (`summary`, `series`: computed
        from the frames before they were stored as uint8, so they match the app's own run), else from the
        stored frames."""
        ctx, T = self.context_frames, self.run.bf16.shape[0]
        meta = self.run.meta
        if isinstance(meta.get("summary"), dict) and isinstance(meta.get("series"), dict) and all(
                isinstance(v, list) and len(v) == T for v in meta["series"].values()):
            series, summary = meta["series"], meta["summary"]
        else:
            series = D.frame_series(self.frames_method, self.frames_bf16, ctx, self.flow)
            series["shift_rate"] = [None if (j := self._latent_jumps(t, None, None)) is None else float(j.mean())
                                    for t in range(T)]
            moved = [(e != q).float().mean() for e, q in self.run.top1.values()]
            bpe, mem = meta["bits_per_element"], meta["memory_mb"]
            summary = {**D.clip_metrics(self.frames_method, self.frames_bf16, ctx, self.flow),
                       "shift_rate": float(torch.stack(moved).mean()) if moved else float("nan"),
                       "bits_per_element": bpe, "compression": 16 / bpe if bpe == bpe and bpe else 1.0,
                       "memory_bf16_mb": mem["bf16"], "memory_mb": mem["stored"]}
        return {"key": self.id, "bf16": self.run.bf16.numpy(), "method": self.run.method.numpy(), "series": series,
                "summary": summary, "worst": D.worst_frames(series["tdiff"][ctx:], 3), "seconds": 0.0}

    def check_frame(self, frame: int) -> int:
        T = self.run.bf16.shape[0]
        if not 0 <= int(frame) < T:
            raise ValueError(f"frame {frame} out of range: the run has frames 0..{T - 1}")
        return int(frame)

    def frame_view(self, frame: int, layer: int | None = None, head: int | None = None) -> dict:
        t = self.check_frame(frame)
        flick, warp = D.frame_maps(self.frames_method, self.frames_bf16, self.flow, t)
        jumps = self._latent_jumps(t, layer, head)
        return {"frame": t, "bf16": self.run.bf16[t].numpy(), "method": self.run.method[t].numpy(),
                "flicker": flick.numpy(), "warp": warp.numpy(),
                "jumps": None if jumps is None else jumps.reshape(*self.facts.latent_grid).numpy(),
                "context": t < self.context_frames}

    def pixel_trace(self, frame: int, x: int, y: int, layer: int = 0, head: int = 0) -> dict:
        f, meta = self.facts, self.run.meta
        t = self.check_frame(frame)
        if not 0 <= layer < f.layers or not 0 <= head < f.heads:
            raise ValueError(f"layer/head ({layer}, {head}) out of range: {f.layers} layers, {f.heads} heads")
        row, col = f.pixel_to_token(int(x), int(y))
        lat = f.latent_frame(t)
        chunk = f.chunk_of(lat)
        if chunk not in self.run.top1:
            raise ValueError(f"frame {t} (latent frame {lat}) was not generated with probes (context or unprobed); "
                             f"probed chunks: {sorted(self.run.top1)}")
        if layer not in meta["logit_layers"] or head not in meta["logit_heads"]:
            raise ValueError(f"the run holds attention logits for layers {meta['logit_layers']} and heads "
                             f"{meta['logit_heads']} only (record with --logit-layers / --logit-heads)")
        qi = (lat - f.chunk_start - chunk * f.chunk_frames) * f.tokens_per_frame + row * f.latent_grid[1] + col
        e, q = self.run.top1[chunk]
        le, lq = self.run.logits[chunk]
        li, hi = meta["logit_layers"].index(layer), meta["logit_heads"].index(head)
        src_e, src_q = int(e[layer, head, qi]), int(q[layer, head, qi])
        exact, source_e = self._cached(chunk, le[li, hi, qi], src_e)
        stored, source_q = self._cached(chunk, lq[li, hi, qi], src_q)
        n_lat = f.latent_frame(self.run.method.shape[0] - 1) + 1
        thumbs = self.run.method[[f.first_output_frame(i) for i in range(n_lat)]].numpy()
        return {"query": (lat, row, col), "layer": layer, "head": head, "method": meta["method"],
                "source_bf16": source_e, "source_method": source_q,
                "jumped": src_e != src_q, "logits_bf16": exact.numpy(), "logits_method": stored.numpy(),
                "frames": thumbs, "grid": f.latent_grid}

    def energy(self, rank: int = 8) -> list[dict]:
        return [{k: v.numpy() for k, v in D.energy_spectrum(S, rank).items()} for S in self.run.stats]
