"""Per-channel trellis codes over a span: the `Channels` buffer and tables read through a bitshift trellis
(quantwm/core/trellis.py; `quantwm-trellis`, docs/method.md §2.10).

Stored exactly as `Channels` stores it: per stream and channel a width b (uint8, 0-8; 16 added where the channel
is on its grid), two fp16 numbers and the channel's N codes of b bits packed along the span in one uint8 buffer.
A grid channel is a `Channels` one (its low end and step, code t at bits [t b, t b + b)); on a trellis channel the
two numbers are the channel's mean and scale over the span, and sample t decodes to mean + scale · T_b[w_t], w_t
the 8 bits of the channel's stream that end where code t ends (tail-biting: those before the stream's first are its
last) and T_b its width's row of `trellis.tables()`. A 0-bit channel decodes to 0 (its centroid alone). The fused
kernel reads it as its TRELLIS form (kernels/span_args.py), window by window; the 8-bit path's QKᵀ takes its rebuilt
keys (it has no integer-code form).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ...kernels.span_args import TRELLIS, TRELLIS_ERROR_STEP, SideArgs
from .. import trellis
from ..backend import kernel, use_kernels
from ..quant import deferring
from ..tables import on_device
from .channels import (
    UNBIAS_FLOOR,
    Channels,
    _buffer_size,
    _byte_layout,
    _scatter_codes,
    grid_codes,
    pack_channels_ref,
    stretched_from,
)

_ERROR_STEP = torch.tensor(TRELLIS_ERROR_STEP, device="cpu")


def _check_widths(b: torch.Tensor) -> None:
    """Widths in 0-8: a deferred flag under the cache's checks, else read at once (one host read)."""
    ok = ((b >= 0) & (b <= 8)).all()
    checks = deferring()
    if checks is not None:
        checks.record(ok)
    elif not bool(ok):
        raise ValueError(f"trellis widths are 0-8 bits a channel, got {int(b.min())}..{int(b.max())}")


def trellis_choice_ref(r: torch.Tensor, states: torch.Tensor, table: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                       alpha: torch.Tensor, bits: torch.Tensor, low: torch.Tensor, step: torch.Tensor, unbias: bool,
                       floor: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grid (S, D) bool, low, step (S, D) fp16, low float32 as the kernel view reads it): each coded channel of r
    (S, N, D) kept on whichever code errs less over the span, its uniform grid (`grid_codes` of its range lo/hi, clip
    alpha and width bits) or the trellis as its search's states (S, D, N) uint8 decode (table[bits, state], the
    (9, 2^L) `trellis.tables()`; its mean low
    and scale step, fp16 values), with that code's two numbers; `unbias`: stretched to a slope of 1 on r from the
    chosen decode (`Channels.unbiased`'s rule, the slope no lower than floor). The twin of kernels/trellis_choice.py."""
    rf, b = r.float(), bits.long()
    g_low, g_step, g_codes = grid_codes(rf, lo, hi, alpha.to(rf), b)
    # both decodes are 0 on 0-bit channels as they stand (low 0, code and value 0): no mask needed
    on_plain = g_low[:, None] + g_codes * g_step[:, None]
    value = table.reshape(-1)[b[:, None, :] * table.shape[1] + states.permute(0, 2, 1).long()]  # row 0: zeros
    on_trellis = low[:, None] + value * step[:, None]
    grid = (b > 0) & ((on_plain - rf).square().sum(1) < (on_trellis - rf).square().sum(1))
    low, step = torch.where(grid, g_low, low), torch.where(grid, g_step, step)
    if unbias:
        low, step = stretched_from(low, step, b, torch.where(grid[:, None], on_plain, on_trellis), rf, floor)
    low = low.half()
    return grid, low, step.half(), torch.where(b > 0, low.float(), 0.0)


@dataclass(frozen=True, eq=False)
class TrellisChannels(Channels):
    """codes: the uint8 buffer; bits (S, D) uint8; low, step_ (S, D) fp16: a trellis channel's mean and scale, a grid
    channel's low end and step; N; grid (S, D) bool: the channels on their uniform grid (None: none)."""

    grid: torch.Tensor | None = None

    @classmethod
    def code(cls, r: torch.Tensor, bits: torch.Tensor, alpha: torch.Tensor | None = None,
             capacity: int | None = None, unbias: bool = False) -> TrellisChannels:
        """r (S, N, D) coded channel by channel by the trellis with widths bits (S, D) against its mean and scale
        (fp16) over the span; `capacity` as in `Channels.pack`. Given `alpha` (S, D), each channel's clip for its
        uniform grid at that width (as `Channels.code` takes it), a channel whose grid codes it with less squared
        error than the trellis is stored on the grid instead, in the same bits (the better of the two, measured).
        `unbias`: the result's `unbiased(r)`, from the decodes the choice already made (none made again)."""
        S, N, D = r.shape
        if tuple(bits.shape) != (S, D):
            raise ValueError(f"trellis widths must be (streams, channels) = {(S, D)}, got {tuple(bits.shape)}")
        if alpha is not None and tuple(alpha.shape) != (S, D):
            raise ValueError(f"grid clips must be (streams, channels) = {(S, D)}, got {tuple(alpha.shape)}")
        rf = r.float()
        b = bits.to(r.device).long()
        _check_widths(b)
        coded = b > 0
        std = rf.std(1, correction=0) if N > 1 else torch.zeros(S, D, device=r.device)
        tiny = torch.finfo(torch.float16).tiny
        low = torch.where(coded, rf.mean(1), 0.0).half().float()
        step = torch.where(coded, trellis.scale_of(std, b).clamp_min(tiny), 1.0).half().float()
        # the search's path (S, N, D): its states' top bits are the codes, their lookup the decodes
        path = trellis.encode(rf, b, low, step, states=True)
        offsets, needed = _byte_layout(b, N)
        size = _buffer_size(needed, capacity)
        if alpha is None:
            codes = path.long() >> (trellis.STATE_BITS - b[:, None])  # 0 on 0-bit channels
            out = cls(_scatter_codes(codes, b, offsets, size), b.to(torch.uint8), low.half(), step.half(), N)
            out.__dict__["offsets"] = offsets
            return out.unbiased(r) if unbias else out
        # the span on its grids as quantwm-alloc stores it, beside the trellis as its states decode (no buffer read):
        # per channel the better is kept (kernels/trellis_choice.py), then packed once (kernels/pack_channels.py)
        state = path.permute(0, 2, 1)  # row by row (S, D, N), as the search wrote it: what both kernels read
        fast = use_kernels(r)
        grid_args = (rf, *torch.aminmax(rf, dim=1), alpha.to(rf), b)
        choose = kernel("trellis_choice") if fast else trellis_choice_ref
        table = on_device(trellis.tables(), r.device)
        grid, low16, step16, low_read = choose(rf, state, table, *grid_args[1:], low, step, unbias, UNBIAS_FLOOR)
        pack = kernel("pack_channels") if fast else pack_channels_ref
        buf = pack(*grid_args, offsets, size, states=state, grid=grid)[0]
        out = cls(buf, b.to(torch.uint8), low16, step16, N, grid)
        out.__dict__["offsets"] = offsets
        out.__dict__["low_read"] = low_read  # fp16 values in fp32 already, 0 on 0-bit channels
        return out

    @functools.cached_property
    def on_grid(self) -> torch.Tensor:
        """The grid channels (S, D) bool (none where `grid` is None)."""
        return torch.zeros_like(self.bits, dtype=torch.bool) if self.grid is None else self.grid

    def decode(self) -> torch.Tensor:
        state = trellis.states(self.codes, self.offsets, self.bits, self.n_tokens)
        value = torch.where(self.on_grid[:, None], self.int_codes().float(), trellis.values(state, self.bits))
        x = self.low.float()[:, None, :] + value * self.step_.float()[:, None, :]
        return torch.where(self.bits[:, None, :] > 0, x, 0.0)

    def step(self) -> torch.Tensor:
        """Each coded channel's equivalent grid step: a grid channel's own step; a trellis channel's √12 times the
        error's standard deviation the width gives a Gaussian channel (span_args.TRELLIS_ERROR_STEP times the stored
        scale); 0-bit channels count as exact."""
        factor = torch.where(self.on_grid, 1.0, on_device(_ERROR_STEP, self.bits.device)[self.bits.long()])
        step = torch.where(self.bits > 0, self.step_.float() * factor, 0.0)
        return step[:, None, :].expand(self.shape).contiguous()

    @functools.cached_property
    def width_byte(self) -> torch.Tensor:
        """What each channel's byte stores (S, D) uint8: its width, and 16 where it is on its grid."""
        bits = self.bits.to(torch.uint8)  # 0-8: no overflow
        return bits if self.grid is None else torch.where(self.grid, bits + 16, bits)

    def components(self) -> dict[str, torch.Tensor]:
        return {"alloc_bits": self.width_byte, "trellis_mean": self.low, "trellis_scale": self.step_,
                "trellis_codes": self.codes}

    def roles(self) -> dict[str, str]:
        return {"alloc_bits": "tables", "trellis_mean": "tables", "trellis_scale": "tables",
                "trellis_codes": "payload"}

    def describe(self) -> str:
        widest = self.__dict__.get("max_bits") or int(self.bits.max())  # a report: its host read is not kept
        return (f"per-channel trellis codes over the span ({trellis.STATE_BITS}-bit windows, stored tables at 1-4 bits), "
                f"0-{widest} bits per channel")

    def make_kernel_side(self) -> SideArgs:
        meta = self.width_byte.long() + 32 * self.offsets  # offset * 32 + 16 on a grid channel + bits
        return SideArgs(TRELLIS, self.codes, self.n_tokens, self.step_, self.low_read, meta,
                        table=on_device(trellis.tables(), self.codes.device), max_bits=self.__dict__.get("max_bits", 8))

    def settle_widest(self, lowp: str | None) -> None:
        """Nothing: no 8-bit rule reads a trellis span's widest channel (it has no integer-code form)."""

    def reads_codes(self, qk: str) -> bool:
        return False

    def code_form(self):
        raise ValueError(f"{self.describe()} has no integer-code form")

    def make_center(self) -> torch.Tensor:
        """Each channel's mean (0 on 0-bit channels): a trellis channel stores it; a grid channel's, of its decoded
        samples."""
        if self.grid is None:
            return self.low_read
        return torch.where(self.on_grid, self.decode().mean(1), self.low_read)

