"""Per-channel grids over a span with 0-8 bits each: the form QuantWM's allocator stores (core/allocate.py).

Per stream s and channel i: a width b_si (0-8 bits), the grid's low end and step (fp16), and the channel's N
codes packed along the span. Every stream's channels lie in one uint8 buffer, stream after stream, channel
after channel (0-bit channels take no bytes): code j of a b-bit channel sits at bits [j b, j b + b) from the
channel's first byte, little-endian, so codes of 3, 5, 6 or 7 bits straddle bytes. A value is
low + code * step; a 0-bit channel decodes to 0 (its centroid alone).

Worked example, N = 5 tokens, one stream, widths (2, 0, 3): channel 0 takes ceil(5·2/8) = 2 bytes at offset 0,
channel 1 none (its offset is 2, where the next channel starts), channel 2 takes ceil(5·3/8) = 2 bytes at offset
2; its code 3 sits at bits 9-11 of those two bytes: bits 1-3 of byte 3. The kernel's table holds offset * 16 +
bits: (0·16+2, 2·16+0, 2·16+3) = (2, 32, 35).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from ...kernels.span_args import CHANNELS, TRELLIS_STATE_BITS, SideArgs
from ..backend import kernel, use_kernels
from ..quant import deferring
from .base import CodeForm, Layout

UNBIAS_FLOOR = 0.5  # `Channels.unbiased` undoes a channel's shrinkage down to this slope, no further


def channel_bytes(n_tokens, bits):
    """Bytes one channel's codes take: its N codes of `bits` bits, packed (ints or tensors)."""
    return (n_tokens * bits + 7) // 8


def table_bytes(n_streams: int, head_dim: int) -> int:
    """Bytes of the per-channel tables `Channels` stores beside its codes: bits (uint8), low end and step (fp16)."""
    return n_streams * head_dim * (1 + 2 + 2)


def channel_offsets(bits: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """Each channel's first byte in the buffer, (S, D) int64, from the widths (S, D)."""
    return _byte_layout(bits, n_tokens)[0]


def _byte_layout(bits: torch.Tensor, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(each channel's first byte (S, D) int64, the bytes every channel takes (0-dim)) from the widths (S, D)."""
    nbytes = channel_bytes(n_tokens, bits.long()).flatten()
    ends = nbytes.cumsum(0)
    return (ends - nbytes).reshape(bits.shape), (ends[-1] if len(ends) else ends.new_zeros(()))


def channel_grid(lo: torch.Tensor, hi: torch.Tensor, bits: torch.Tensor, alpha: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(low, step) of a `bits` grid over [lo, hi] with its range shrunk by alpha about the middle, both already
    rounded to their fp16 storage; every argument broadcasts (e.g. lo (S, D), bits and alpha (C, 1, 1))."""
    mid, half = (hi + lo) / 2, (hi - lo) / 2 * alpha
    low = (mid - half).half().float()
    step = torch.where(half > 0, 2 * half / (2.0 ** bits - 1), 1.0).half().float()
    return low, step.clamp_min(torch.finfo(torch.float16).tiny)


def _buffer_size(needed: torch.Tensor, capacity: int | None) -> int:
    """The code buffer's bytes: `capacity` (checked to hold the `needed` bytes: a deferred flag under the cache's
    checks, else one host read), or exactly what is needed (one host read)."""
    if capacity is None:
        return int(needed)  # host read: only without a bound
    checks = deferring()
    if checks is not None:
        checks.record(needed <= capacity)
    elif bool(needed > capacity):
        raise ValueError(f"channel widths need {int(needed)} bytes, more than the buffer's {capacity}")
    return capacity


def _scatter_codes(codes: torch.Tensor, b: torch.Tensor, start: torch.Tensor, total: int) -> torch.Tensor:
    """Integer codes (S, N, D) of widths b (S, D) from byte offsets start (S, D) into a uint8 buffer (total,), in a
    fixed number of tensor ops: every code's bits shifted into place and added (they are disjoint: adding is or-ing)."""
    S, N, D = codes.shape
    pos = start[:, None, :] * 8 + torch.arange(N, device=codes.device)[None, :, None] * b[:, None, :]  # first bits
    val = torch.where(b[:, None, :] > 0, codes.clamp(0).minimum((1 << b[:, None, :]) - 1), 0) << (pos & 7)
    byte = torch.where(b[:, None, :] > 0, pos >> 3, 0).flatten()
    buf = torch.zeros(total + 2, dtype=torch.int32, device=codes.device)  # + 2: 0-bit channels' (empty) writes
    buf.index_add_(0, byte, (val & 255).flatten().int())
    buf.index_add_(0, byte + 1, (val >> 8).flatten().int())
    return buf[:total].to(torch.uint8)


def grid_codes(r: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, alpha: torch.Tensor,
               bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(low (S, D), step (S, D), codes (S, N, D) float32): each channel of r (S, N, D, float32) on its grid
    (`channel_grid` of its range lo/hi, clip alpha and width bits; low 0 and step 1 on 0-bit channels) and its
    codes round((r − low) / step), half to even, clamped to [0, 2^b − 1]: what `Channels.code` stores."""
    low, step = channel_grid(lo, hi, bits, alpha)
    coded = bits > 0
    low, step = torch.where(coded, low, 0.0), torch.where(coded, step, 1.0)
    codes = torch.round((r - low[:, None]) / step[:, None]).clamp_min(0).minimum(((1 << bits.long()) - 1)[:, None])
    return low, step, codes


PACK_BLOCK_BYTES = 32  # kernels/pack_channels.py's bytes of a channel a program codes: one partial sum each


def pack_channels_ref(r: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, alpha: torch.Tensor, bits: torch.Tensor,
                      offsets: torch.Tensor, total: int, sums: bool = False, states: torch.Tensor | None = None,
                      grid: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """(buffer (total,), low (S, D) fp16, step (S, D) fp16, low (S, D) float32 as the kernel view reads it): each
    channel of r (S, N, D) on its grid (`channel_grid` of its range lo/hi, clip alpha and width bits; 0 and 1 on
    0-bit channels), coded round((r − low) / step), clamped to its width and packed from `offsets`; with `sums` also
    the partial sums (4, S·D, ceil(N / 32)) over each block of 32 bytes of a channel, of u = r − (lo + hi) / 2, u²,
    c = code − (2^b − 1) / 2 and c·u, every code counted in the block that holds its first bit (what
    `unshrink_channels_ref` adds up). Given a trellis's `states` (S, D, N) uint8 and `grid` (S, D) bool, the channels
    not on their grid store their states' top bits instead (quantwm-trellis). The twin of kernels/pack_channels.py."""
    low, step, codes = grid_codes(r.float(), lo, hi, alpha, bits)
    if states is not None:
        on_trellis = states.permute(0, 2, 1).long() >> (TRELLIS_STATE_BITS - bits.long()[:, None])
        codes = torch.where(grid[:, None], codes.long(), on_trellis)
    out = (_scatter_codes(codes.long(), bits.long(), offsets, total), low.half(), step.half(), low)
    if not sums:
        return out
    S, N, D = r.shape
    b = bits.long()[:, None, :]
    c = codes - ((1 << b) - 1) / 2
    u = r.float() - ((hi + lo) / 2)[:, None]
    n_blocks = -(-N // PACK_BLOCK_BYTES)
    block = torch.arange(N, device=r.device)[None, :, None] * b // (8 * PACK_BLOCK_BYTES)  # of each code's first bit
    terms = torch.stack([u, u * u, c, c * u]) * (b > 0)  # (4, S, N, D); 0-bit channels hold no code
    partial = torch.zeros(4, S * D, n_blocks, device=r.device)
    index = block.expand(S, N, D).permute(0, 2, 1).reshape(1, S * D, N).expand(4, -1, -1)
    return (*out, partial.scatter_add_(2, index, terms.permute(0, 1, 3, 2).reshape(4, S * D, N)))


def _stretched(low: torch.Tensor, step: torch.Tensor, bits: torch.Tensor, mean: torch.Tensor, cov: torch.Tensor,
               var: torch.Tensor, floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(low, step) float32 (S, D) of grids decoding to low + step · v, stretched about the decode's mean `mean` so
    that its slope on the coded values, cov / var (the decode's covariance with them and their variance), becomes 1;
    a slope kept in [floor, 1] (only shrinkage is undone); a channel without width, spread or positive covariance,
    or at slope 1, keeps its grid (§2.6 step 5)."""
    low, step = low.float(), step.float()
    live = (bits > 0) & (var > 0) & (cov > 0)
    s = torch.where(live, cov / torch.where(live, var, 1.0), 1.0).clamp(floor, 1.0)
    shrunk = live & (s < 1)
    return torch.where(shrunk, mean + (low - mean) / s, low), torch.where(shrunk, step / s, step)


def stretched_from(low: torch.Tensor, step: torch.Tensor, bits: torch.Tensor, decoded: torch.Tensor, r: torch.Tensor,
                   floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(low, step) float32 (S, D) stretched (`_stretched`) so that the slope of `decoded` (S, N, D), the grids'
    decode, on r (S, N, D), the values coded, becomes 1, both measured on every token."""
    rf = r.float()
    dm, rm = decoded.mean(1), rf.mean(1)  # (S, D)
    cov = ((decoded - dm[:, None]) * (rf - rm[:, None])).mean(1)
    return _stretched(low, step, bits, dm, cov, (rf - rm[:, None]).square().mean(1), floor)


def unshrink_channels_ref(sums: torch.Tensor, bits: torch.Tensor, low: torch.Tensor, step: torch.Tensor,
                          n_tokens: int, floor: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(low, step (S, D) fp16, low float32 as the kernel view reads it): the grids low + code · step (fp16, widths
    bits (S, D)) stretched to a slope of 1 from `pack_channels_ref`'s partial sums over the span's n_tokens tokens,
    the slope no lower than floor: the twin of kernels/unshrink_channels.py."""
    S, D = bits.shape
    if not (S * D and n_tokens):
        return low.half(), step.half(), torch.where(bits > 0, low.float(), 0.0)
    mean_u, mean_uu, mean_c, mean_cu = (sums.sum(2) / n_tokens).reshape(4, S, D)
    step32 = step.float()
    mean = low.float() + step32 * (mean_c + ((1 << bits.long()) - 1) / 2)
    new_low, new_step = _stretched(low, step, bits, mean, step32 * (mean_cu - mean_c * mean_u),
                                   mean_uu - mean_u * mean_u, floor)
    new_low = new_low.half()
    return new_low, new_step.half(), torch.where(bits > 0, new_low.float(), 0.0)


@dataclass(frozen=True, eq=False)
class Channels(Layout):
    """codes: the uint8 buffer; bits (S, D) uint8; low, step (S, D) fp16; n_tokens: N."""

    codes: torch.Tensor
    bits: torch.Tensor
    low: torch.Tensor
    step_: torch.Tensor
    n_tokens: int

    @classmethod
    def pack(cls, codes: torch.Tensor, bits: torch.Tensor, low: torch.Tensor, step: torch.Tensor,
             capacity: int | None = None) -> Channels:
        """Lay out integer codes (S, N, D) of channels of widths bits (S, D) in one buffer (see the module).
        `capacity`: the buffer's size in bytes, at least what the widths need (bytes past the last channel stay 0
        and are counted); None: exactly what they need, read on the host (one sync)."""
        S, N, D = codes.shape
        offsets, needed = _byte_layout(bits, N)
        buf = _scatter_codes(codes, bits.long(), offsets, _buffer_size(needed, capacity))
        return cls(buf, bits.to(torch.uint8), low.half(), step.half(), N)

    @classmethod
    def code(cls, r: torch.Tensor, bits: torch.Tensor, alpha: torch.Tensor, capacity: int | None = None,
             unbias: bool = False) -> Channels:
        """r (S, N, D) coded channel by channel on a grid over its range shrunk by alpha (S, D) with bits (S, D)
        (low end and step stored in fp16) and packed: kernels/pack_channels.py on the fast path (one launch), else
        `pack_channels_ref`. `capacity` as in `pack`. `unbias`: the grids stretched as `unbiased(r)` stretches them,
        from sums the packing gathers (one launch more, kernels/unshrink_channels.py; the span is not read again)."""
        S, N, D = r.shape
        rf = r.float()
        offsets, needed = _byte_layout(bits, N)
        b = bits.long()
        args = (rf, *torch.aminmax(rf, dim=1), alpha.to(rf), b, offsets, _buffer_size(needed, capacity))  # one read
        fast = use_kernels(r)
        packed = kernel("pack_channels")(*args, sums=unbias) if fast else pack_channels_ref(*args, sums=unbias)
        buf, low, step, low_read = packed[:4]
        if unbias:
            unshrink = kernel("unshrink_channels") if fast else unshrink_channels_ref
            low, step, low_read = unshrink(packed[4], b, low, step, N, UNBIAS_FLOOR)
        out = cls(buf, bits.to(torch.uint8), low, step, N)
        out.__dict__["offsets"] = offsets  # the cached properties, already computed (low is 0 on 0-bit channels)
        out.__dict__["low_read"] = low_read  # fp16 values in fp32 already
        return out

    @functools.cached_property
    def offsets(self) -> torch.Tensor:
        """Each channel's first byte (S, D) int64 (`channel_offsets`), computed once."""
        return channel_offsets(self.bits, self.n_tokens)

    @functools.cached_property
    def max_bits(self) -> int:
        """The widest channel (one host read, kept: the e4m3 path's `prepare` asks for it before the kernel view is
        built, which then carries it, and `reads_codes` answers from it; elsewhere both take 8)."""
        return int(self.bits.max()) if self.bits.numel() else 0

    @property
    def shape(self) -> tuple[int, int, int]:
        return (*self.bits.shape[:1], self.n_tokens, self.bits.shape[1])

    def channel_bits(self) -> torch.Tensor:
        return self.bits

    def components(self) -> dict[str, torch.Tensor]:
        return {"alloc_bits": self.bits, "alloc_low": self.low, "alloc_step": self.step_, "alloc_codes": self.codes}

    def roles(self) -> dict[str, str]:
        return {"alloc_bits": "tables", "alloc_low": "tables", "alloc_step": "tables", "alloc_codes": "payload"}

    def int_codes(self) -> torch.Tensor:
        """The codes (S, N, D) int64, read from the buffer as the kernel reads them (0 on 0-bit channels)."""
        bits = self.bits.long()
        off = self.offsets
        pos = torch.arange(self.n_tokens, device=bits.device)[None, :, None] * bits[:, None, :]  # bit positions
        buf = torch.nn.functional.pad(self.codes.long(), (0, 2))  # a code's second byte; an empty buffer reads 0
        byte = torch.where(bits[:, None, :] > 0, off[:, None, :] + pos // 8, 0)
        return ((buf[byte] | (buf[byte + 1] << 8)) >> (pos % 8)) & ((1 << bits[:, None, :]) - 1)

    def decode(self) -> torch.Tensor:
        x = self.low.float()[:, None, :] + self.int_codes().float() * self.step_.float()[:, None, :]
        return torch.where(self.bits[:, None, :] > 0, x, 0.0)

    def unbiased(self, r: torch.Tensor, floor: float = UNBIAS_FLOOR, decoded: torch.Tensor | None = None) -> Channels:
        """This layout with each coded channel's decode stretched about its mean over the span so that the
        least-squares slope of its decoded values on r's (S, N, D, the values it coded) is 1: its low end and step
        (its two fp16 numbers, whatever they mean) rewritten, nothing else. A clipped grid or a code that decodes to
        its cell's mean (the trellis) shrinks each channel toward its mean by a factor s ≤ 1 that depends on its
        width, so the output attention reads from a span's values carries a bias that its averaging over tokens
        does not remove, where it removes the codes' noise; dividing the deviation by s removes the bias (s kept in
        [floor, 1]: only shrinkage is undone), measured on every token. `decoded`: this layout's decode (S, N, D)
        where the caller already has it (then nothing is decoded again). Batched tensor ops on r's device, no host
        read (docs/method.md §2.6). `Channels.code(..., unbias=True)` does the same while it packs."""
        x = self.decode() if decoded is None else decoded
        low, step = stretched_from(self.low, self.step_, self.bits, x, r, floor)
        out = dataclasses.replace(self, low=low.half(), step_=step.half())
        out.__dict__["offsets"] = self.offsets  # the byte layout is unchanged
        return out

    def step(self) -> torch.Tensor:
        """Each coded channel's grid step for every token; 0-bit channels, which have no grid, count as exact."""
        step = torch.where(self.bits > 0, self.step_.float(), 0.0)
        return step[:, None, :].expand(self.shape).contiguous()

    def describe(self) -> str:
        widest = self.__dict__.get("max_bits") or int(self.bits.max())  # a report: its host read is not kept
        return f"per-channel grids over the span, 0-{widest} bits per channel"

    @functools.cached_property
    def low_read(self) -> torch.Tensor:
        """The low ends (S, D) float32 as the kernel reads them: 0 on 0-bit channels (code 0 there); computed once."""
        return torch.where(self.bits > 0, self.low.float(), 0.0)

    def make_kernel_side(self) -> SideArgs:
        meta = torch.add(self.bits.long(), self.offsets, alpha=16)  # offset * 16 + bits
        # the widest channel, where the 8-bit path asked for it (`prepare`); else 8, a bound read by nothing
        widest = self.__dict__.get("max_bits", 8)
        return SideArgs(CHANNELS, self.codes, self.n_tokens, self.step_, self.low_read, meta, max_bits=widest)

    def settle_widest(self, lowp: str | None) -> None:
        """Read the widest channel where the 8-bit path's rule will ask for it (e4m3), before the kernel view is
        built from it: one host read, at commit, on this path only."""
        if lowp == "e4m3":
            _ = self.max_bits

    def prepare(self, lowp: str | None = None) -> None:
        self.settle_widest(lowp)
        super().prepare(lowp)

    def reads_codes(self, qk: str) -> bool:
        """Any width in INT8; e4m3 holds codes of at most 4 bits exactly."""
        # the widest channel where the e4m3 path settled it at commit (`prepare`), else 8: the kernel view's rule
        return qk == "int8" or self.__dict__.get("max_bits", 8) <= 4

    def code_form(self) -> CodeForm:
        bits = self.bits.long()
        half = torch.where(bits > 0, 2.0 ** (bits - 1).clamp_min(0), 0.0)[:, None, :]  # (S, 1, D)
        sc = self.step_.float()[:, None, :]
        return CodeForm(self.int_codes().float() - half, sc, self.low_read[:, None, :] + half * sc, self.n_tokens,
                        True, two_term=True)

    def make_center(self) -> torch.Tensor:
        """Low end plus half the grid."""
        return self.low_read + self.step_.float() * (2.0 ** self.bits.float() - 1) / 2
