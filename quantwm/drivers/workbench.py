"""The built-in world model loaded once, and its results cache: rollouts kept by settings.

    wb = Workbench()                                  # loads assets/world_model.safetensors
    key = RunKey(seed=0, trajectory="loop", method="quantwm", target="kv", bits=2, frames=32, world="place")
    ref, rec = wb.pair(key)                           # BF16 and the method, same world, trajectory and noise
    wb.record(key.id)                                 # the cached record, or ValueError saying why not

Each rollout is kept as a compact record (`runs.Record`: frames, probes, exact and stored K/V, query statistics,
memory) in a results cache shared by every user, bounded in bytes (`cache_mb`) and evicted least recently used
first. A run is never kept without its BF16 reference: using a run also uses its reference, and evicting a
reference evicts the runs compared against it; `on_evict` callbacks hear of every eviction (the app deletes the
run's videos). One generation runs at a time: a second waits for the first (the app's queue shows its users their
position). Within one, the rollouts it needs (BF16 and the method; every run of a study: `prefetch`) run `workers`
at a time on the CPU, each on its own thread: they are independent (each draws its own noise), so the records are
those made one by one, and two free cores make a pair in about the time of one rollout. `limits`
(`quantwm.evaluation.limits.Limits`) bounds what a request may ask for; `calibrate()` measures this machine's
speed for it. On CUDA the model runs there; on CPU torch uses `threads` intra-op threads
(1 by default: these are small matrices, and more threads only spin against other work on the machine).

What is shown of a run lives elsewhere in quantwm/drivers/: `views.RunView` (one run's views, built-in or
opened), `registry.RunRegistry` (run ids to views, the run files opened) and `studies` (a run against BF16,
Keys vs Values, the methods at one budget).
"""
from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from contextlib import contextmanager

import torch

from ..core.cache import CacheConfig
from ..core.methods import get_method, known_methods
from ..evaluation.limits import Limits, fit_chunk_seconds, generated_chunk_tokens, release_memory, request_bytes
from ..world.evaluate import place_shift_rate
from ..world.generate import generate, load_world_model
from ..world.scene import TRAIN_SEED_BASE
from .runs import MiB, Record, RunKey, denormals_flushed

__all__ = ["Record", "RunKey", "Workbench", "release_memory"]


class Workbench:
    def __init__(self, weights: str | None = None, device: str | None = None, threads: int = 1,
                 cache_mb: float | None = None, limits: Limits | None = None, model=None, workers: int | None = None):
        """`model`: an already loaded world model to share (instead of loading `weights`); `limits`: the
        request limits (default: this machine's, without a speed calibration); `cache_mb` overrides the
        results cache's budget; `workers`: rollouts run at once within a generation (default: on the CPU, as many
        as the cores hold at `threads` torch threads each, at most 2; 1 on a GPU)."""
        self.model = model if model is not None else load_world_model(weights) if weights else load_world_model()
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cpu":
            torch.set_num_threads(max(1, int(threads)))
        self.model.to(self.device)
        self.cfg = self.model.cfg
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self.workers = int(workers or (1 if self.device != "cpu" else max(1, min(2, cores // max(1, int(threads))))))
        self.limits = limits or Limits.from_machine(self.cfg, len(self.methods()), cache_mb=cache_mb)
        self.cache_bytes = int((cache_mb or self.limits.cache_mb) * MiB)
        self._records: OrderedDict[RunKey, Record] = OrderedDict()
        self._lock = threading.Lock()  # one generation at a time
        self._cache_lock = threading.RLock()  # the records table
        self._evicted: set[RunKey] = set()
        self.on_evict: list[Callable[[RunKey], None]] = []
        self.running: str | None = None

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
            first, step, top = c.context_frames + c.chunk_frames, c.chunk_frames, self.limits.max_frames
            top -= (top - c.context_frames) % step
            raise ValueError(f"frames must exceed {c.context_frames} by a multiple of {step}: {first}, {first + step}, "
                             f"{first + 2 * step}, ... up to {top} on this server; got {n}")
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
        self._store(key, rec, {key, *keep})
        return rec

    def _store(self, key: RunKey, rec: Record, spare: set) -> None:
        """Keep a generated record, then evict to the budget, sparing the keys in `spare` (and their references)."""
        with self._cache_lock:
            self._records[key] = rec
            self._evicted.discard(key)
            self._evict(spare)

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
        with denormals_flushed():  # the softmax's sub-1e-38 probabilities slow a CPU's matmuls; results unchanged
            run = generate(self.model, key.seed, key.trajectory, key.frames, key.cache_config(), progress=progress,
                           world=key.world)
        c, L = run.cache, self.cfg.layers
        k_exact = [c.keys(l, exact=True)[0].cpu() for l in range(L)]
        v_exact = [c.values(l, exact=True)[0].cpu() for l in range(L)]
        steps = [c.key_steps(l)[0].cpu() for l in range(L)] if c.config.jensen else None
        return Record(key, run.frames.cpu(), run.probes, k_exact, [c.keys(l)[0].cpu() for l in range(L)],
                      v_exact, [c.values(l)[0].cpu() for l in range(L)],
                      [c.query_stats(l).cpu() for l in range(L)], steps, c.memory(), time.time() - t0,
                      budget_choice=c.budget_choice, coverage=run.coverage(),
                      channel_bits={kind: c.channel_bits(kind) for kind in "kv"},
                      place_shift_rate=place_shift_rate(run)[0])

    def pair(self, key: RunKey, progress: Callable | None = None) -> tuple[Record, Record]:
        """(BF16 record, method record) with the same world, trajectory and noise (generated side by side)."""
        failed = self.prefetch([key], progress)
        if failed:
            raise next(iter(failed.values()))
        ref_key = key.reference()
        return self.run(ref_key, keep=(key,)), self.run(key, keep=(ref_key,))

    def prefetch(self, keys: list[RunKey], progress: Callable | None = None) -> dict:
        """Generate every run of `keys` and its BF16 reference that the cache lacks, `workers` at a time (one at a
        time where two would not fit the memory planned for a request); progress(done, total) counts their chunks
        together and is called from this thread. Returns {key: exception} of the runs that failed (a method that
        cannot fit its budget on this world's data, non-finite output); the others are cached."""
        wanted = list(dict.fromkeys(k for key in keys for k in (key.reference(), key)))
        for k in wanted:
            self.check_frames(k.frames)
        failed: dict = {}
        if all(self._touch(k) is not None for k in wanted):  # cached: no wait for a generation that is running
            return failed
        with self._lock:
            todo = [k for k in wanted if self._touch(k) is None]  # made by a generation this one waited for?
            if not todo:
                return failed
            fits_two = 2 * request_bytes(self.cfg, max(k.frames for k in todo)) <= self.limits.memory_mb / 2 * MiB
            chunks = {k: k.frames // self.cfg.chunk_frames for k in todo}
            done = dict.fromkeys(todo, 0)
            self.running = ", ".join(k.id for k in todo)
            try:
                with ThreadPoolExecutor(self.workers if fits_two else 1) as pool:
                    pending = {pool.submit(self._generate, k, lambda i, n, k=k: done.__setitem__(k, i)): k
                               for k in todo}
                    while pending:
                        finished, _ = wait(pending, timeout=0.25, return_when=FIRST_COMPLETED)
                        for f in finished:
                            k = pending.pop(f)
                            if f.exception() is not None:
                                failed[k] = f.exception()
                                continue
                            self._store(k, f.result(), set(wanted))
                        if progress:
                            progress(sum(done.values()), sum(chunks.values()))
            finally:
                self.running = None
        return failed

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
