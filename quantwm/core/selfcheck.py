"""First-use self-check of the Triton kernels: a wrong kernel never silently corrupts a video.

The first time a kernel runs for a given key in a process, the dispatcher also runs its PyTorch reference on the
same call's data (on a sample of it when the call is large, see below) and compares them by the rule the tests use:

* codes and cluster ids (pack_bits, unpack_bits, quantize_pack, kmeans_assign, qsac_assign) must be equal;
* attention (span_attention over one span's layouts): the kernel's error against the reference in fp32 must be
  at most twice the reference's own error in the input dtype (its output and queries rounded to that dtype),
  plus 1e-4 of the output's magnitude for fp32 summation order; with the 8-bit path (`lowp`) the kernel is held
  to its emulation (quantwm/core/fp8.py) within 2e-3 of the output's magnitude (e4m3 rounding of a probability
  near a boundary may land one step away on a GPU).

The key is (kernel, layout, dtype, device, shape class). The shape class (`shape_class`) names the sizes that
decide which code the launcher runs: every length it tiles (TILES) by its class against that tile, `=1`, `<t`
(under one tile), `=tn` (a multiple of it) or `=tn+r` (ragged), and every other keyed size exactly (head dim,
packed row width); streams, one program each, are not keyed. quantize_pack over 97 tokens of 64 channels is
`T=16n+r, D=64`; span_attention with 1 query over 1025 keys of 128 channels is `Nq=1, N=32n+r, D=128`. So a
kernel checked at one class is checked again when a new class appears (a decode step after a prefill, a ragged
span after whole tiles), and not again within a class. Samples keep the call's class: the first SAMPLE_STREAMS
streams of a packing or assignment call (of a tiled leading axis, as unpack_bits' rows, one tile plus the call's
remainder), one tile of queries plus the call's remainder of an attention call (at most 2 x 64).

On a mismatch it warns once (`QuantWMKernelWarning`, naming the kernel, layout, shape class, shapes and both
errors) and that (kernel, layout, dtype, device) takes the reference for the rest of the process, at every shape
class: a kernel shown wrong once is not trusted on the strength of a sample elsewhere. `verdicts()` and
`fallbacks()` report every check; `KVCache.memory()` carries the fallbacks, and so do the app's status line and
run files; `quantwm selfcheck` exits 1 naming them.

Cost: one extra reference computation per key per process, bounded by the sampling. Not covered: the attention
check folds its span as one split (the call may use several), and sizes outside the key (the streams, a
centroid count qsac_assign walks one at a time) are trusted from the class's first call.
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
ATTENTION_FLOOR = 1e-4
LOWP_TOLERANCE = 2e-3


def query_tile(n: int) -> int:
    """span_attention's BLOCK_M for `n` queries."""
    return 64 if n > 32 else 16


# The tile each launcher (kernels/<name>.py) walks a length with (tests/test_selfcheck.py pins them to the launchers).
TILES: dict[str, dict[str, int | Callable[[int], int]]] = {
    "pack_bits": {"R": 16},                           # BLOCK_R rows
    "quantize_pack": {"T": 16},                       # BLOCK_T tokens
    "unpack_bits": {"R": 16},                         # BLOCK_R rows
    "kmeans_assign": {"N": 32, "K": 16},              # BLOCK_N tokens, BLOCK_K centroids
    "qsac_assign": {"N": 32},                         # BLOCK_N tokens (the centroids one at a time)
    "span_attention": {"Nq": query_tile, "N": 32},    # BLOCK_M queries, BLOCK_N keys
}
# A packing or assignment kernel's leading arguments, axis by axis (an int argument: one name): S (streams: sampled,
# not keyed), _ (not keyed), a length of TILES (keyed by its class) or any other name (keyed by its exact size).
# A kernel not listed is keyed by its first argument's sizes past the streams on its leading axis.
AXES: dict[str, tuple[str, ...]] = {
    "pack_bits": ("R n",),                            # codes (R, n)
    "quantize_pack": ("S T D",),                      # x (S, T, D)
    "unpack_bits": ("R bytes", "_", "n"),             # packed (R, ceil(n * bits / 8)), bits, n
    "kmeans_assign": ("S N D", "S K D"),              # x, centroids
    "qsac_assign": ("S N D", "S _ D"),                # x, centroids
}


class QuantWMKernelWarning(RuntimeWarning):
    """A kernel disagreed with its reference; the reference runs instead."""


@dataclass(frozen=True)
class Verdict:
    """One self-check: the kernel, the layout it read, its dtype and device, whether it passed, the kernel's error
    and the error allowed (both 0 for exact comparisons), the shapes checked, how many calls were checked, and the
    shape class of the key (the module docstring)."""

    kernel: str
    layout: str
    dtype: str
    device: str
    ok: bool
    kernel_error: float
    allowed_error: float
    shapes: str
    checks: int = 1
    shape_class: str = ""

    def line(self) -> str:
        state = "ok" if self.ok else "FAILED, reference used"
        errs = f"kernel error {self.kernel_error:.3g}, allowed {self.allowed_error:.3g}"
        at = f" at {self.shape_class}" if self.shape_class else ""
        return f"{self.kernel} [{self.layout}] {self.dtype} on {self.device}{at}: {state} ({errs}; {self.shapes})"


_VERDICTS: dict[tuple[str, str, str, str, str], Verdict] = {}
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
    """The checks that failed: those (kernel, layout, dtype, device) run their reference, at every shape class."""
    return [v for v in verdicts() if not v.ok]


def reset() -> None:
    """Forget every verdict (tests; a process that swapped its kernels)."""
    with _LOCK:
        _VERDICTS.clear()


def length_class(n: int, tile: int) -> str:
    """A length's class against the tile that walks it: "=1", "<t", "=tn" (whole tiles) or "=tn+r" (ragged)."""
    if n <= 1:
        return f"={n}"
    if n < tile:
        return f"<{tile}"
    return f"={tile}n" if n % tile == 0 else f"={tile}n+r"


def shape_class(kernel: str, **sizes: int) -> str:
    """The shape class of a call (the key's last part): each of TILES[kernel]'s lengths by its class, every other
    size exactly; e.g. shape_class("quantize_pack", T=97, D=64) == "T=16n+r, D=64"."""
    tiles = TILES.get(kernel, {})
    parts = []
    for name, n in sizes.items():
        tile = tiles.get(name)
        if tile is None:
            parts.append(f"{name}={n}")
        else:
            parts.append(name + length_class(n, tile(n) if callable(tile) else tile))
    return ", ".join(parts)


def sample_length(kernel: str, name: str, n: int) -> int:
    """How much of length `name` (n long) a check samples: all of it up to one tile, else one tile plus n's
    remainder, so the sample has the call's class."""
    tile = TILES[kernel][name]
    tile = tile(n) if callable(tile) else tile
    return n if n <= tile else tile + n % tile


Check = Callable[[], tuple[float, float, str]]  # -> (kernel error, allowed error, shapes)


def run(kernel: str, layout: str, sample: torch.Tensor, fast: Callable, ref: Callable, check: Check, *,
        shape: str):
    """fast() unless this (kernel, layout, dtype, device) failed a check; on its first use at shape class `shape`
    (every use with QUANTWM_SELFCHECK=always) `check` runs first and decides. `sample` is a tensor of the call
    (dtype, device)."""
    unit = (kernel, layout, str(sample.dtype).removeprefix("torch."), str(sample.device))
    key = (*unit, shape)
    with _LOCK:
        known = _VERDICTS.get(key)
        failed = any(not v.ok and (v.kernel, v.layout, v.dtype, v.device) == unit for v in _VERDICTS.values())
    if failed:
        return ref()
    m = mode()
    if m is None or not _ENABLED.get() or (known is not None and m == "first"):
        return fast()
    err, allowed, shapes = check()
    ok = err <= allowed
    verdict = Verdict(*unit, ok, err, allowed, shapes, (known.checks + 1) if known else 1, shape)
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


def _axes(name: str, first: torch.Tensor) -> tuple[str, ...]:
    return AXES.get(name) or (" ".join(["S", *(f"d{i}" for i in range(1, first.dim()))]),)


def _sizes(name: str, args: tuple) -> dict[str, int]:
    """The keyed sizes of a call to kernel `name` (AXES: S and _ dropped)."""
    sizes = {}
    for spec, a in zip(_axes(name, args[0]), args):
        dims = a.shape if isinstance(a, torch.Tensor) else (a,)
        sizes.update((axis, int(n)) for axis, n in zip(spec.split(), dims) if axis not in ("S", "_"))
    return sizes


def checked_exact(name: str, layout: str, ref: Callable, *args, **options):
    """kernels/<name>.py on `args` (the first a tensor of streams on its leading axis), its first use per shape class
    checked against `ref` on a sample of every tensor argument's leading axis (SAMPLE_STREAMS streams, or, when the
    kernel tiles that axis, one tile plus the call's remainder); the reference after a failure."""
    from .backend import kernel

    lead = _axes(name, args[0])[0].split()[0]
    n = args[0].shape[0]
    keep = SAMPLE_STREAMS if lead == "S" else sample_length(name, lead, n)
    sample = tuple(a[:keep] if isinstance(a, torch.Tensor) and a.dim() > 1 else a for a in args)
    shapes = "x".join(map(str, sample[0].shape))
    return run(name, layout, args[0], lambda: kernel(name)(*args, **options), lambda: ref(*args, **options),
               exact(lambda: kernel(name)(*sample, **options), lambda: ref(*sample, **options), shapes),
               shape=shape_class(name, **_sizes(name, args)))
