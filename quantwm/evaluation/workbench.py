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
from dataclasses import replace

import numpy as np
import torch

from ..core.cache import CacheConfig, jensen_bias
from ..core.methods import get_method, known_methods
from ..core.quant import BudgetError
from ..world.evaluate import shift_rate
from ..world.generate import generate, load_world_model
from ..world.scene import TRAIN_SEED_BASE
from . import diagnostics as D
from . import metrics as M
from .limits import Limits, fit_chunk_seconds, generated_chunk_tokens
from .loaded import LoadedRun
from .runs import MiB, Record, RunKey, cache_memory_mb

__all__ = ["LoadedRun", "Record", "RunKey", "Workbench", "release_memory"]



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
                      [c.query_stats(l).cpu() for l in range(L)], steps, bpe, memory, time.time() - t0,
                      budget_choice=c.budget_choice, coverage=run.coverage())

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
        if rec.coverage is not None:
            series["seen_by_context"] = list(rec.coverage)
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
        return M.probe_logits(q, rec.k_exact[layer][head, :k_seen.shape[1]], k_seen[head], 1.0, bias)

    def energy(self, run_id: str, rank: int = 8) -> list[dict]:
        """Per layer: the history-Query spectrum the method's cache accumulated (energy_spectrum as numpy)."""
        if run_id in self._loaded:
            return self._loaded[run_id].energy(rank)
        rec = self.record(run_id)
        return [{k: v.numpy() for k, v in D.energy_spectrum(S, rank).items()} for S in rec.stats]

    # ---- run files ----------------------------------------------------------------------------
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
            try:
                ref, rec = self.pair(k, (lambda a, n, i=i: progress(i * n + a, len(keys) * n)) if progress else None)
            except BudgetError as e:  # fits a Gaussian span of the shape, not this world's data
                (left_out if left_out is not None else {})[k.method] = str(e).splitlines()[0]
                continue
            rows.append({"method": k.method, **self.summary(ref, rec), "configuration": self.configuration(k)})
        return sorted(rows, key=lambda r: r["bits_per_element"]) if key.budget is not None else rows

    def configuration(self, key: RunKey) -> str:
        """What the key's generated run ran as: its grid at `bits`, or what its cache chose within the budget for
        each quantized half (read from the run's record: the choice the cache made on its first span)."""
        if key.method == "bf16":
            return "bf16"
        if key.budget is None:
            return f"{key.bits}-bit"
        chosen = self.record(key.id).budget_choice or {}
        return "; ".join(f"{kind}: {chosen.get(kind, '?')}" for kind in "kv" if kind in key.target)
