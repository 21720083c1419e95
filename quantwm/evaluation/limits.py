"""What one request to the app may ask for, derived from the machine it runs on.

    limits = Limits.from_machine(model.cfg, seconds_per_frame=...)   # the app does this at start-up
    limits.check_frames(100000)   # ValueError naming the limit, before any work

Two resources bound a generation request (BF16 and the method over `frames` frames):

* **memory**: `request_bytes` estimates, from the model's shapes, the peak a request adds (its two
  records plus the cache and the probes' logits while it runs); `run_bytes` is one record as the shared
  results cache keeps it. The plan uses `memory_fraction` of the memory this process may use (the smaller
  of what /proc/meminfo reports available and the cgroup's limit); half of the plan is the results cache,
  the other half bounds one request.
* **time**: one generation holds the queue, so it may take at most `max_seconds`. The start-up
  calibration times each generated chunk of a short BF16 rollout on this machine and fits
  seconds per chunk = a + b x cached tokens (`chunk_seconds` = (a, b)); a request (BF16, then the method,
  whose quantization costs more) is estimated at `REQUEST_TIME_FACTOR` BF16 rollouts.

`max_frames` is the largest valid frame count both allow; methods per comparison are bounded by the cache
(every method's run and the reference must fit at once); uploads by `max_upload_mb` (a trace is read
whole into memory and analysed in a few copies). Every figure can be overridden for a bigger machine.
"""
from __future__ import annotations

import ctypes
import gc
import os
from dataclasses import dataclass

MiB = 2 ** 20
F32, I64 = 4, 8
TRIM_EVERY = 8  # chunks between `release_memory(collect=False)` calls in a rolling-window rollout (world.generate.rollout)


def release_memory(collect: bool = True) -> None:
    """Give freed memory back to the OS: glibc keeps freed heap pages otherwise, so a long-running server's or a
    long rollout's resident size creeps up as its allocations fragment the heap. `collect`: run the garbage
    collector first (a server after an eviction; a rollout loop has no cycles to free and skips it)."""
    if collect:
        gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def machine_memory() -> tuple[int, int]:
    """(total, available) bytes this process may use: /proc/meminfo, capped by a cgroup (v2 or v1) limit."""
    total = available = None
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if ":" in line}
        total, available = info.get("MemTotal"), info.get("MemAvailable", info.get("MemFree"))
    except (OSError, ValueError, IndexError):
        pass
    if total is None:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = 8 * 2 ** 30  # no way to ask: plan for a small laptop
    available = available or total
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                raw = f.read().strip()
            if raw.isdigit() and int(raw) < total:
                total = int(raw)
        except OSError:
            continue
    return total, min(available, total)


def run_bytes(cfg, frames: int) -> int:
    """Upper estimate of one rollout record (`drivers.runs.Record`) of the built-in model over `frames`."""
    n, L, H, D = cfg.tokens_per_frame, cfg.layers, cfg.heads, cfg.head_dim
    size = cfg.view * cfg.patch
    tokens = frames * n
    kv = L * H * tokens * D * F32  # one of K or V, every layer
    generated = frames - cfg.context_frames
    probes = generated * n * L * H * (D * F32 + 2 * I64 + 2 * F32)  # q, top-1 exact/quant, mass, top-1 prob
    pixels = frames * size * size
    return (pixels * 3 * F32 + pixels * 2 * F32  # frames, the reference's optical flow
            + 5 * kv  # exact and stored K and V, the +jensen key steps
            + probes + L * H * D * D * F32)  # query statistics


def request_bytes(cfg, frames: int) -> int:
    """Upper estimate of the peak memory one generation request adds: both records (BF16, method), the
    running cache (exact, stored, decoded copies, codes) and the probe's logits over the cache."""
    n, L, H, D = cfg.tokens_per_frame, cfg.layers, cfg.heads, cfg.head_dim
    tokens = frames * n
    cache = 6 * L * H * tokens * D * F32
    logits = 4 * H * cfg.chunk_frames * n * tokens * F32  # exact and stored logits, probabilities, a temporary
    return 2 * run_bytes(cfg, frames) + cache + logits


REQUEST_TIME_FACTOR = 2.5  # BF16 + the method (measured 1.25x BF16 for quantwm on the built-in model), rounded up


def generated_chunk_tokens(cfg, frames: int) -> list[int]:
    """Tokens each generated chunk of a `frames` rollout attends to (cache and itself)."""
    F, n = cfg.chunk_frames, cfg.tokens_per_frame
    return [(c + 1) * F * n for c in range(cfg.context_frames // F, frames // F)]


def fit_chunk_seconds(tokens: list[int], seconds: list[float]) -> tuple[float, float]:
    """Least-squares (a, b) of seconds = a + b * tokens, both kept >= 0."""
    n = len(tokens)
    if n == 0:
        raise ValueError("no chunk timings to fit")
    mt, ms = sum(tokens) / n, sum(seconds) / n
    var = sum((t - mt) ** 2 for t in tokens)
    b = max(0.0, sum((t - mt) * (s - ms) for t, s in zip(tokens, seconds)) / var) if var > 0 else 0.0
    a = max(0.0, ms - b * mt)
    if a == 0.0 and b == 0.0:
        b = ms / mt
    return a, b


def request_seconds(cfg, frames: int, chunk_seconds: tuple[float, float]) -> float:
    """Estimated seconds of one generation request (BF16 and a method) over `frames`."""
    a, b = chunk_seconds
    return REQUEST_TIME_FACTOR * sum(a + b * t for t in generated_chunk_tokens(cfg, frames))


@dataclass(frozen=True)
class Limits:
    max_frames: int
    max_methods: int  # methods in one comparison (also bounded per request by the cache, `check_methods`)
    max_upload_mb: float
    cache_mb: float  # the shared results cache
    max_seconds: float  # one generation request
    memory_mb: float  # the memory planned with
    chunk_seconds: tuple[float, float] | None  # measured: seconds per generated chunk = a + b * cached tokens
    cfg: object = None  # the model's WorldConfig (shapes for the estimates)
    frames_reason: str = "the server's settings"  # what bounds max_frames, for the refusal message

    @classmethod
    def from_machine(cls, cfg, n_methods: int, chunk_seconds: tuple[float, float] | None = None, *,
                     memory_mb: float | None = None, memory_fraction: float = 0.6, max_seconds: float = 120.0,
                     max_frames: int | None = None, max_methods: int | None = None,
                     max_upload_mb: float | None = None, cache_mb: float | None = None) -> Limits:
        """The limits of this machine; any keyword given replaces the derived figure."""
        for name, v in (("memory_mb", memory_mb), ("max_seconds", max_seconds), ("max_frames", max_frames),
                        ("max_methods", max_methods), ("max_upload_mb", max_upload_mb), ("cache_mb", cache_mb)):
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be positive, got {v}")
        if memory_mb is None:
            total, available = machine_memory()
            memory_mb = memory_fraction * min(total, available) / MiB
        cache_mb = cache_mb if cache_mb is not None else memory_mb / 2
        derived, reason = cls._frames_allowed(cfg, memory_mb / 2, cache_mb, max_seconds, chunk_seconds)
        frames = derived
        if max_frames is not None and max_frames < derived:
            frames, reason = max_frames, "--max-frames"
        if frames <= cfg.context_frames:
            raise ValueError(f"the machine's limits ({memory_mb:.0f} MB to plan with, {max_seconds:g} s per request) "
                             f"leave no room for one generated chunk; give more memory or time")
        upload = max_upload_mb if max_upload_mb is not None else min(1024.0, cache_mb / 8)
        return cls(frames, int(max_methods or n_methods), float(upload), float(cache_mb), float(max_seconds),
                   float(memory_mb), chunk_seconds, cfg, reason)

    @staticmethod
    def _frames_allowed(cfg, request_mb, cache_mb, max_seconds, chunk_seconds) -> tuple[int, str]:
        """The largest valid frame count all three bounds allow, and which bound stops the next one."""
        F, ctx = cfg.chunk_frames, cfg.context_frames
        best, frames = ctx, ctx + F
        while frames < 10 ** 6:
            if request_bytes(cfg, frames) > request_mb * MiB:
                return best, (f"memory: one request may use {request_mb:.0f} MB, half of the {2 * request_mb:.0f} MB "
                              "planned with (--memory-mb)")
            if 3 * run_bytes(cfg, frames) > cache_mb * MiB:
                return best, f"the shared results cache of {cache_mb:.0f} MB must hold a run and its reference (--cache-mb)"
            if chunk_seconds is not None and request_seconds(cfg, frames, chunk_seconds) > max_seconds:
                return best, (f"time: one generation may hold the queue {max_seconds:g} s at this machine's measured "
                              "speed (--max-seconds)")
            best, frames = frames, frames + F
        return best, "the largest size considered"

    # ---- checks (ValueError naming the limit) -------------------------------------------------------
    def check_frames(self, frames: int) -> None:
        if frames > self.max_frames:
            raise ValueError(f"frames={frames} is over this server's limit of {self.max_frames} frames per "
                             f"generation, set by {self.frames_reason}; start the app with --max-frames, "
                             "--memory-mb, --cache-mb or --max-seconds to change it")

    def check_methods(self, n: int, frames: int) -> None:
        """`n` methods in one comparison at `frames`: within max_methods, and all their runs (plus the
        reference) fit in the results cache at once."""
        if n > self.max_methods:
            raise ValueError(f"{n} methods in one comparison is over this server's limit of {self.max_methods} "
                             "(--max-methods)")
        if self.cfg is not None and (n + 1) * run_bytes(self.cfg, frames) > self.cache_mb * MiB:
            fit = max(1, int(self.cache_mb * MiB // run_bytes(self.cfg, frames)) - 1)
            raise ValueError(f"{n} methods at {frames} frames do not fit in the results cache "
                             f"({self.cache_mb:.0f} MB, --cache-mb): at most {fit} at once")

    def check_upload(self, path: str, what: str = "file") -> None:
        size = os.path.getsize(path)
        if size > self.max_upload_mb * MiB:
            raise ValueError(f"the {what} is {size / MiB:.1f} MB, over this server's limit of "
                             f"{self.max_upload_mb:.0f} MB (--max-upload-mb)")

    def describe(self) -> str:
        speed = ""
        if self.chunk_seconds:
            a, b = self.chunk_seconds
            speed = f" (measured here: a chunk takes {a * 1e3:.0f} ms + {b * 1e6:.1f} µs per cached token)"
        return (f"Limits per request: {self.max_frames} frames, {self.max_methods} methods per comparison, "
                f"uploads up to {self.max_upload_mb:.0f} MB; results cache {self.cache_mb:.0f} MB; at most "
                f"{self.max_seconds:g} s per generation{speed}.")
