"""Affine group quantization and bit packing: the primitives every method builds on.

* `quantize_groups` / `dequantize_groups`: asymmetric (min/max, 2^b levels) or symmetric
  (absmax, 2^b - 1 levels centred on zero; at 2 bits that is QVG's ternary grid {-1, 0, +1}) affine
  quantization in groups of `group_size` elements, along the channel axis (per token, axis="channel")
  or along the token axis (per channel, axis="token", KIVI's Key layout).
* bits in {2, 3, 4, 8}; codes are bit-packed (on CUDA by kernels/quantize_pack.py for 2, 4 and 8 bits;
  `quantize_pack_ref` is its twin) little-endian into uint8 rows (`pack_bits_ref`):
  element i of a row lives in bits [i*b, (i+1)*b) of the row's byte stream, so for 2 bits element i sits
  in byte i // 4 at bit 2 * (i % 4). The round trip is exact.
* scales and zeros are stored in fp16 or fp8-e4m3. Codes are computed against the *stored* (rounded)
  scale and zero, so the error bound |x - x̂| <= step / 2 holds for the stored step (fp8 zeros add their own
  rounding, which the clamp absorbs at the grid's ends). A tensor that the requested dtype cannot hold
  (fp8 saturates at ±448 and underflows below 2^-6) is stored one step wider (`storage_dtype`: fp8 ->
  fp16 -> fp32), never silently clipped; the wider bytes are counted.

Deliberate edge cases: a group whose values are all equal gets step 1 and code 0 (exact); NaN/Inf input
raises ValueError; per-token groups need D % group_size == 0 (ValueError otherwise); per-channel groups
along a token count that does not divide by group_size get a shorter last group (documented padding: the
last group's scale and zero come from its real members only, and padded codes are never stored).
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch

from .backend import use_kernels
from .selfcheck import checked_exact

SUPPORTED_BITS = (2, 3, 4, 8)
PACK_BITS = tuple(range(1, 9))
SCALE_DTYPES = {"fp16": torch.float16, "fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16}
ROUNDINGS = ("up", "nearest")  # how a step is rounded to its storage dtype (QVG's released code: nearest)
AXES = ("channel", "token")


def check_bits(bits: int) -> int:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"unsupported bits={bits!r}; allowed: {', '.join(map(str, SUPPORTED_BITS))}")
    return bits


class BudgetError(ValueError):
    """A method that cannot store a span within the bits-per-element budget it was given (core/budget.py, the
    allocator): callers that compare methods at a budget leave that method out with this one-line reason."""


def check_budget(value, shown=None) -> float:
    """A method's budget: a real number of bits per element in (0, 16]; `shown` is what the error quotes (the
    request's own spelling, when the caller parsed it)."""
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 16):
        quoted = value if shown is None else shown
        raise ValueError(f"budget must be a number of bits per element in (0, 16], got {quoted!r}")
    return float(value)


def check_pack_bits(bits: int) -> int:
    """Packing takes any width from 1 to 8 bits (the allocator's mixed channels); quantizers take SUPPORTED_BITS."""
    if bits not in PACK_BITS:
        raise ValueError(f"cannot pack {bits!r}-bit codes; allowed: 1 to 8 bits")
    return bits


class DeferredChecks:
    """The value checks of one span's quantization, kept on the device instead of read one by one: each records a
    0-dim bool; `passed()` reads them all with one host read. What is checked: the span is finite
    (`check_finite`), each stored tensor fits the dtype asked for (`storage_dtype`, assumed), a code buffer is
    as large as its widths need (layouts/channels.py `_buffer_size`). Where one fails the cache quantizes the span again with every
    check immediate: the clear error, or the wider dtype, comes from there."""

    def __init__(self):
        self.flags: list[torch.Tensor] = []

    def record(self, ok: torch.Tensor) -> None:
        self.flags.append(ok.reshape(()))

    def passed(self) -> bool:
        """True when every recorded check holds: one host read for all of them (none when nothing was recorded)."""
        if not self.flags:
            return True
        return bool(torch.stack([f.to(self.flags[0].device) for f in self.flags]).all())  # the span's one host read


_DEFERRED: contextvars.ContextVar[DeferredChecks | None] = contextvars.ContextVar("quantwm_deferred", default=None)
_WIDENED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("quantwm_widened", default=None)


@contextlib.contextmanager
def deferred_checks(widened: dict | None = None):
    """Within: value checks are recorded on the device (`DeferredChecks`), not read on the host one by one.
    `widened` (a cache's, kept across spans): the storage dtypes earlier spans had to widen to, by (dtype asked
    for, shape), which a deferred `storage_dtype` starts from, so a widening costs one repeated span, not one each."""
    checks = DeferredChecks()
    token = _DEFERRED.set(checks)
    try:
        with remembering(widened):
            yield checks
    finally:
        _DEFERRED.reset(token)


@contextlib.contextmanager
def remembering(widened: dict | None):
    """Within: the widenings `storage_dtype` decides (checks immediate) are remembered in `widened`, and a deferred
    check starts from them."""
    memory = _WIDENED.set(widened)
    try:
        yield
    finally:
        _WIDENED.reset(memory)


def deferring() -> DeferredChecks | None:
    """The checks being deferred, if any (the quantization of a span under `deferred_checks`)."""
    return _DEFERRED.get()


def defers_checks(x: torch.Tensor) -> bool:
    """Whether a check of a tensor on x's device is kept as a device flag rather than read at once: on an
    accelerator (a read is a host sync there); on the CPU a read costs nothing."""
    return x.device.type != "cpu"


def check_finite(x: torch.Tensor, what: str = "input") -> None:
    """A clear error naming `what` when x holds NaN/Inf (one host read); under `deferred_checks`, a recorded flag."""
    if not torch.is_floating_point(x):
        raise ValueError(f"{what} must be a floating-point tensor, got dtype {x.dtype}")
    if not x.numel():
        return
    checks = deferring()
    if checks is not None:  # one reduction: NaN and Inf reach the sum (so may a finite overflow: then checked again)
        checks.record(torch.isfinite(x.sum(dtype=torch.float32)))
        return
    if not torch.isfinite(x).all():
        bad = (~torch.isfinite(x)).sum().item()
        raise ValueError(f"{what} contains {bad} NaN/Inf value(s)")


def pack_bits_ref(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes (..., n) in [0, 2^bits) into uint8 (..., ceil(n * bits / 8)): a little-endian bit
    stream, code i at bits [i·bits, (i+1)·bits)."""
    check_pack_bits(bits)
    *lead, n = codes.shape
    if 8 % bits == 0:  # whole codes per byte: byte m = Σ_j code[m·per + j] << (j·bits)
        per = 8 // bits
        c = codes.to(torch.uint8)
        if n % per:
            c = torch.nn.functional.pad(c, (0, per - n % per))
        c = c.reshape(*lead, -1, per)  # (..., n) -> (..., n/per, per)
        packed = c[..., 0].clone()
        for j in range(1, per):
            packed |= c[..., j] << (j * bits)
        return packed
    pad = (-n) % 8
    c = codes.to(torch.int32)
    if pad:
        c = torch.nn.functional.pad(c, (0, pad))
    # (..., n8) -> (..., n8 // 8, 8) -> bit planes (..., n8 // 8, 8, bits) -> (..., n8 // 8, bits, 8)
    c = c.reshape(*lead, -1, 8)
    shifts = torch.arange(bits, device=c.device, dtype=torch.int32)
    bitplanes = (c.unsqueeze(-1) >> shifts) & 1
    stream = bitplanes.reshape(*lead, -1, bits, 8)  # 8 codes * bits -> bits bytes of 8 bits each
    weights = (1 << torch.arange(8, device=c.device, dtype=torch.int32))
    packed = (stream * weights).sum(-1).to(torch.uint8).reshape(*lead, -1)
    return packed[..., : (n * bits + 7) // 8]


def unpack_bits_ref(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of `pack_bits_ref`: uint8 (..., ceil(n*bits/8)) -> int64 codes (..., n)."""
    check_pack_bits(bits)
    *lead, nbytes = packed.shape
    if nbytes != (n * bits + 7) // 8:
        raise ValueError(f"packed row has {nbytes} bytes, expected {(n * bits + 7) // 8} for n={n}, bits={bits}")
    if 8 % bits == 0:  # whole codes per byte
        per, mask = 8 // bits, (1 << bits) - 1
        p = packed.to(torch.uint8)
        codes = torch.stack([(p >> (j * bits)) & mask for j in range(per)], dim=-1)  # (..., nbytes, per)
        return codes.reshape(*lead, -1)[..., :n].to(torch.int64)
    full = ((n + 7) // 8) * bits
    p = packed.to(torch.int32)
    if full > nbytes:
        p = torch.nn.functional.pad(p, (0, full - nbytes))
    bitstream = (p.unsqueeze(-1) >> torch.arange(8, device=p.device, dtype=torch.int32)) & 1
    bitplanes = bitstream.reshape(*lead, -1, 8, bits)
    codes = (bitplanes << torch.arange(bits, device=p.device, dtype=torch.int32)).sum(-1)
    return codes.reshape(*lead, -1)[..., :n].to(torch.int64)


@dataclass
class GroupQuant:
    """A quantized tensor: packed codes plus per-group scale (and zero for asymmetric grids).

    Layout for x of shape (..., T, D):
      axis="channel": codes (..., T, D*bits/8), scale/zero (..., T, D // G)
      axis="token":   codes (..., T, D*bits/8), scale/zero (..., ceil(T / G), D)
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    shape: tuple[int, ...]
    bits: int
    group_size: int
    axis: str
    symmetric: bool

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"codes": self.codes, "scales": self.scale} | ({} if self.zero is None else {"zeros": self.zero})

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


STORAGE_LADDER = (torch.float8_e4m3fn, torch.float16, torch.float32)
# A tensor is stored in the requested dtype only if every element survives the cast to within
# 2^-3 |x_i| + 2^-4 rms(x): one fp8 ulp of itself, or a sixteenth of the tensor's typical magnitude.
# Otherwise (fp8 saturates at ±448 and loses precision below 2^-6) it widens to the next dtype of the ladder.
STORAGE_REL_TOL, STORAGE_RMS_TOL = 2.0 ** -3, 2.0 ** -4


def _fits(x: torch.Tensor, ax: torch.Tensor, rms: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """0-dim bool: x survives the cast to dt: every element within STORAGE_REL_TOL |x_i| + STORAGE_RMS_TOL rms(x)
    of itself and none past dt's largest value (fp8 clamps there, fp16 overflows)."""
    return _cast_fits(x, x.to(dt), ax, rms, torch.finfo(dt).max)


def _cast_fits(x: torch.Tensor, s: torch.Tensor, ax: torch.Tensor, rms: torch.Tensor, largest: float,
               rel: float = STORAGE_REL_TOL, rms_tol: float = STORAGE_RMS_TOL) -> torch.Tensor:
    """`_fits` given the cast s and the dtype's largest value."""
    excess = torch.add((s.float() - x).abs(), ax, alpha=-rel)  # error beyond the relative part
    return (excess <= torch.where(ax <= largest, rms_tol * rms, -1.0)).all()


def storage_check_ref(x: torch.Tensor, s: torch.Tensor, rms: torch.Tensor, largest: float,
                      rel: float = STORAGE_REL_TOL, rms_tol: float = STORAGE_RMS_TOL) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin of kernels/storage_check.py: s = x.to(dt) (x float32, rms = ‖x‖ / √n) with its negative zeros made
    positive, and 0-dim bool: every element of x survives the cast (`_fits`, with the tolerances rel and rms_tol)."""
    return torch.where(s.float() == 0, torch.zeros_like(s), s), _cast_fits(x, s, x.abs(), rms, largest, rel, rms_tol)


def _rms(x: torch.Tensor) -> torch.Tensor:
    """0-dim: the root mean square of float32 x, ‖x‖ / √n, as the storage check's tolerance reads it."""
    return torch.linalg.vector_norm(x) * x.numel() ** -0.5


def _start_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """The dtype a storage check starts from: `dtype`, or the wider one an earlier span of x's shape had to take
    (the `remembering` dict)."""
    widened = _WIDENED.get()
    return dtype if widened is None else widened.get((dtype, tuple(x.shape)), dtype)


def storage_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """The narrowest dtype at or above `dtype` on STORAGE_LADDER (fp8-e4m3 -> fp16 -> fp32) that stores x
    without saturating or underflowing (the tolerance above). Widening is counted in the stored bytes. Under
    `deferred_checks` the dtype asked for is assumed and the check recorded (the span is quantized again if not)."""
    if not x.numel() or dtype not in STORAGE_LADDER:  # bf16 has fp32's range: nothing to widen
        return dtype
    x = x.float()
    ax = x.abs()
    rms = _rms(x)
    widened, start = _WIDENED.get(), _start_dtype(x, dtype)
    checks = deferring()
    if checks is not None:
        if start != torch.float32:
            checks.record(_fits(x, ax, rms, start))
        return start
    chosen = next(dt for dt in STORAGE_LADDER[STORAGE_LADDER.index(start):] if dt == torch.float32 or
                  _fits(x, ax, rms, dt))
    if widened is not None and chosen != start:
        widened[(dtype, tuple(x.shape))] = chosen
    return chosen


def to_storage(x: torch.Tensor, dtype: torch.dtype, toward: str | None = None) -> torch.Tensor:
    """Cast to the storage dtype (widened by `storage_dtype` where the requested one cannot hold x),
    optionally never rounding "up"-wards values down (or "down" values up). With the checks deferred and the
    kernels on (an accelerator's commit), a cast without `toward` is checked by kernels/storage_check.py in one
    launch: the same dtype, bytes and recorded check as the steps below."""
    fused = _fused_storage(x, dtype) if toward is None else None
    if fused is not None:
        return fused
    dtype = storage_dtype(x, dtype)
    if dtype == torch.float32:
        return x.float().clone()
    info = torch.finfo(dtype)
    s = x.to(dtype)
    s = torch.where(s.float() == 0, torch.zeros_like(s), s)  # no negative zero
    if toward is None:
        return s
    wrong = s.float() < x if toward == "up" else s.float() > x  # stepped where wrong, by tensor ops (no host read)
    # Neighbouring floats differ by one in the magnitude bits (sign-magnitude layout).
    int_t = torch.uint8 if info.bits == 8 else torch.int16
    bits = s.view(int_t).to(torch.int32)
    sf = s.float()
    away_from_zero = sf >= 0 if toward == "up" else sf < 0
    stepped = torch.where(away_from_zero, bits + 1, bits - 1)
    if toward == "down":  # +0 stepping down becomes the smallest negative subnormal
        sign = 0x80 if info.bits == 8 else -0x8000
        stepped = torch.where(sf == 0, torch.full_like(bits, sign + 1), stepped)
    stepped = stepped.to(int_t).view(dtype)
    return torch.where(wrong, stepped, s)


def _fused_storage(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """`to_storage(x, dtype)` through kernels/storage_check.py where the checks are deferred and the kernels on (the
    dtype `storage_dtype` would assume, the cast, its check recorded); None elsewhere (the steps of `to_storage`)."""
    from .backend import kernel

    checks = deferring()
    if checks is None or not x.numel() or dtype not in STORAGE_LADDER or not use_kernels(x):
        return None
    start = _start_dtype(x, dtype)
    if start == torch.float32:
        return None
    xf = x.float()
    stored, ok = kernel("storage_check")(xf.contiguous(), xf.to(start), _rms(xf), torch.finfo(start).max,
                                         STORAGE_REL_TOL, STORAGE_RMS_TOL)
    checks.record(ok)
    return stored


def _group_view(x: torch.Tensor, group_size: int, axis: str) -> torch.Tensor:
    """(..., T, D) -> grouped view with the group on the last axis (token axis: T padded to a multiple of G)."""
    *lead, T, D = x.shape
    if axis == "channel":
        if D % group_size:
            raise ValueError(f"head dim {D} does not divide by group_size={group_size} (per-token groups)")
        return x.reshape(*lead, T, D // group_size, group_size)
    pad = (-T) % group_size
    if pad:  # repeat the last token so padded slots do not widen the group's range
        x = torch.cat([x, x[..., -1:, :].expand(*lead, pad, D)], dim=-2)
    # (..., Tp, D) -> (..., Tp//G, G, D) -> (..., Tp//G, D, G)
    return x.reshape(*lead, (T + pad) // group_size, group_size, D).transpose(-1, -2)


def _ungroup(g: torch.Tensor, shape: tuple[int, ...], axis: str) -> torch.Tensor:
    *lead, T, D = shape
    if axis == "channel":
        return g.reshape(*lead, T, D)
    return g.transpose(-1, -2).reshape(*lead, -1, D)[..., :T, :]


def quantize_groups(x: torch.Tensor, bits: int = 2, group_size: int = 64, axis: str = "channel",
                    symmetric: bool = False, scale_dtype: str = "fp16", rounding: str = "up") -> GroupQuant:
    """Quantize x (..., T, D) in groups of `group_size` along `axis`; see the module docstring.

    rounding="up" stores steps rounded up (and zeros down), so the stored grid covers every value;
    "nearest" rounds both to nearest (QVG's released code) and lets the codes' clamp absorb the ends."""
    check_bits(bits)
    check_finite(x, "tensor to quantize")
    if axis not in AXES:
        raise ValueError(f"unknown axis {axis!r}; allowed: {', '.join(AXES)}")
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"unknown scale_dtype {scale_dtype!r}; allowed: {', '.join(SCALE_DTYPES)}")
    if x.dim() < 2 or x.shape[-1] == 0 or x.shape[-2] == 0:
        raise ValueError(f"expected a non-empty (..., T, D) tensor, got shape {tuple(x.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"unknown rounding {rounding!r}; allowed: {', '.join(ROUNDINGS)}")
    up, down = ("up", "down") if rounding == "up" else (None, None)
    sdt = SCALE_DTYPES[scale_dtype]
    g = _group_view(x.float(), group_size, axis)
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        absmax = g.abs().amax(-1, keepdim=True)
        step = torch.where(absmax > 0, absmax / qmax, torch.ones_like(absmax))
        scale = to_storage(step, sdt, toward=up)
        zero = None
    else:
        qmax = 2 ** bits - 1
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        zero = to_storage(lo, sdt, toward=down)  # rounding "up": zero <= lo and zero + qmax * scale >= hi
        width = hi - zero.float()
        step = torch.where(width > 0, width / qmax, torch.ones_like(lo))
        scale = to_storage(step, sdt, toward=up)
        zero = zero.squeeze(-1)
    scale = scale.squeeze(-1)
    if bits in (2, 4, 8) and use_kernels(x):
        *lead, T, D = x.shape
        layout = f"{bits}-bit {'symmetric' if symmetric else 'asymmetric'} groups of {group_size} along {axis}s"
        packed = checked_exact("quantize_pack", layout, quantize_pack_ref, x.reshape(-1, T, D),
                               scale.reshape(-1, *scale.shape[-2:]),
                               None if zero is None else zero.reshape(-1, *zero.shape[-2:]),
                               bits, group_size, axis, symmetric).reshape(*lead, T, -1)
    else:
        packed = quantize_pack_ref(x, scale, zero, bits, group_size, axis, symmetric)
    return GroupQuant(packed, scale, zero, tuple(x.shape), bits, group_size, axis, symmetric)


def quantize_pack_ref(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int, group_size: int,
                      axis: str = "channel", symmetric: bool = False) -> torch.Tensor:
    """Codes of x (..., T, D) against stored scale/zero (layout of `axis`, see GroupQuant), packed."""
    g = _group_view(x.float(), group_size, axis)
    s = scale.float().unsqueeze(-1)
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        codes = torch.round(g / s).clamp(-qmax, qmax) + qmax
    else:
        codes = torch.round((g - zero.float().unsqueeze(-1)) / s).clamp(0, 2 ** bits - 1)
    return pack_bits_ref(_ungroup(codes.to(torch.uint8), tuple(x.shape), axis), bits)


def dequantize_groups(q: GroupQuant, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rebuild (..., T, D) from a GroupQuant."""
    *lead, T, D = q.shape
    if q.bits in (2, 4, 8) and use_kernels(q.codes):
        rows = q.codes.reshape(-1, q.codes.shape[-1])  # (rows, bytes): the kernel's view
        codes = checked_exact("unpack_bits", f"{q.bits}-bit", unpack_bits_ref, rows, q.bits, D).reshape(
            *q.codes.shape[:-1], D).float()
    else:
        codes = unpack_bits_ref(q.codes, q.bits, D).float()
    g = _group_view(codes, q.group_size, q.axis)
    s = q.scale.float().unsqueeze(-1)
    if q.symmetric:
        x = (g - (2 ** (q.bits - 1) - 1)) * s
    else:
        x = g * s + q.zero.float().unsqueeze(-1)
    return _ungroup(x, q.shape, q.axis).to(dtype)


def group_step(q: GroupQuant) -> torch.Tensor:
    """Per-element quantization step (..., T, D): the Δ that the Jensen correction uses."""
    *lead, T, D = q.shape
    s = q.scale.float()
    if q.axis == "channel":
        return s.repeat_interleave(q.group_size, dim=-1)
    return s.repeat_interleave(q.group_size, dim=-2)[..., :T, :]
