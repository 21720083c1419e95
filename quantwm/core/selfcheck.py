"""First-use self-check of the Triton kernels: a wrong kernel never silently corrupts a video.

The first time a kernel runs for a given (kernel, layout, dtype, device) in a process, the dispatcher also runs
its PyTorch reference on the same call's data (on a sample of it when the call is large: the first two streams
of a packing or assignment call, the first 64 queries of an attention call) and compares them by the rule the
tests use:

* codes and cluster ids (pack_bits, unpack_bits, quantize_pack, kmeans_assign, qsac_assign) must be equal;
* attention (span_attention over one span's layouts): the kernel's error against the reference in fp32 must be
  at most twice the reference's own error in the input dtype (its output and queries rounded to that dtype),
  plus 1e-4 of the output's magnitude for fp32 summation order; with the 8-bit path (`lowp`) the kernel is held
  to its emulation (quantwm/core/fp8.py) within 2e-3 of the output's magnitude (e4m3 rounding of a probability
  near a boundary may land one step away on a GPU).

On a mismatch it warns once (`QuantWMKernelWarning`, naming the kernel, layout, shapes and both errors) and that
(kernel, layout, dtype, device) takes the reference for the rest of the process. `verdicts()` and `fallbacks()`
report every check; `KVCache.memory()` carries the fallbacks, and so do the app's status line and run files.

Cost: one extra reference computation per (kernel, layout, dtype, device) per process, bounded by the sampling.
Switches: `QUANTWM_KERNELS=trust` (the kernels as `auto` picks them, never checked), `CacheConfig(selfcheck=False)`
(that cache's calls unchecked), `QUANTWM_SELFCHECK=always` (every call checked: for debugging, slow).
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

MODES = ("first", "always")
SAMPLE_STREAMS = 2
SAMPLE_QUERIES = 64
ATTENTION_FLOOR = 1e-4
LOWP_TOLERANCE = 2e-3


class QuantWMKernelWarning(RuntimeWarning):
    """A kernel disagreed with its reference; the reference runs instead."""


@dataclass(frozen=True)
class Verdict:
    """One self-check: the kernel, the layout it read, its dtype and device, whether it passed, the kernel's error
    and the error allowed (both 0 for exact comparisons), the shapes checked, and how many calls were checked."""

    kernel: str
    layout: str
    dtype: str
    device: str
    ok: bool
    kernel_error: float
    allowed_error: float
    shapes: str
    checks: int = 1

    def line(self) -> str:
        state = "ok" if self.ok else "FAILED, reference used"
        errs = f"kernel error {self.kernel_error:.3g}, allowed {self.allowed_error:.3g}"
        return f"{self.kernel} [{self.layout}] {self.dtype} on {self.device}: {state} ({errs}; {self.shapes})"


_VERDICTS: dict[tuple[str, str, str, str], Verdict] = {}
_LOCK = threading.Lock()
_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("quantwm_selfcheck", default=True)


def mode() -> str | None:
    """"first" (default), "always" (QUANTWM_SELFCHECK=always), or None (QUANTWM_KERNELS=trust: no checks)."""
    if os.environ.get("QUANTWM_KERNELS", "").strip().lower() == "trust":
        return None
    m = os.environ.get("QUANTWM_SELFCHECK", "first").strip().lower() or "first"
    if m not in MODES:
        raise ValueError(f"QUANTWM_SELFCHECK must be one of {', '.join(MODES)}, got {m!r}")
    return m


@contextlib.contextmanager
def enabled(on: bool):
    """Within the block, checks run only if `on` (a cache's `selfcheck` field, around its own calls)."""
    token = _ENABLED.set(on and _ENABLED.get())
    try:
        yield
    finally:
        _ENABLED.reset(token)


def verdicts() -> list[Verdict]:
    """Every check this process ran, in order."""
    with _LOCK:
        return list(_VERDICTS.values())


def fallbacks() -> list[Verdict]:
    """The checks that failed: those (kernel, layout, dtype, device) run their reference."""
    return [v for v in verdicts() if not v.ok]


def reset() -> None:
    """Forget every verdict (tests; a process that swapped its kernels)."""
    with _LOCK:
        _VERDICTS.clear()


Check = Callable[[], tuple[float, float, str]]  # -> (kernel error, allowed error, shapes)


def run(kernel: str, layout: str, sample: torch.Tensor, fast: Callable, ref: Callable, check: Check):
    """fast() unless this (kernel, layout, dtype, device) failed its check; on its first use (every use with
    QUANTWM_SELFCHECK=always) `check` runs first and decides. `sample` is a tensor of the call (dtype, device)."""
    key = (kernel, layout, str(sample.dtype).removeprefix("torch."), str(sample.device))
    with _LOCK:
        known = _VERDICTS.get(key)
    if known is not None and not known.ok:
        return ref()
    m = mode()
    if m is None or not _ENABLED.get() or (known is not None and m == "first"):
        return fast()
    err, allowed, shapes = check()
    ok = err <= allowed
    verdict = Verdict(*key, ok, err, allowed, shapes, (known.checks + 1) if known else 1)
    with _LOCK:
        _VERDICTS[key] = verdict
    if not ok:
        warnings.warn(f"QuantWM kernel self-check failed, switching to the PyTorch reference: {verdict.line()}",
                      QuantWMKernelWarning, stacklevel=3)
        return ref()
    return fast()


def exact(fast: Callable, ref: Callable, shapes: str) -> Check:
    """A check for kernels whose outputs must equal the reference's (codes, ids): error 1 on any difference."""
    def check() -> tuple[float, float, str]:
        a, b = fast(), ref()
        same = a.shape == b.shape and torch.equal(a.cpu().long(), b.cpu().long())
        return (0.0 if same else 1.0), 0.0, shapes
    return check


def checked_exact(name: str, layout: str, ref: Callable, *args, **options):
    """kernels/<name>.py on `args` (the first a tensor of streams on its leading axis), its first use checked
    against `ref` on the first SAMPLE_STREAMS streams of every tensor argument; the reference after a failure."""
    from .backend import kernel

    sample = tuple(a[:SAMPLE_STREAMS] if isinstance(a, torch.Tensor) and a.dim() > 1 else a for a in args)
    shapes = "x".join(map(str, sample[0].shape))
    return run(name, layout, args[0], lambda: kernel(name)(*args, **options), lambda: ref(*args, **options),
               exact(lambda: kernel(name)(*sample, **options), lambda: ref(*sample, **options), shapes))
