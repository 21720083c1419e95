"""Per-channel trellis codes over a span: the `Channels` buffer and tables read through a bitshift trellis
(quantwm/core/trellis.py; `quantwm-trellis`, docs/method.md §2.10).

Stored exactly as `Channels` stores it: per stream and channel a width b (uint8, 0-8), two fp16 numbers and the
channel's N codes of b bits packed along the span in one uint8 buffer. The two numbers are the channel's mean
and scale over the span (not a grid's low end and step), and sample t decodes to mean + scale · CODEBOOK[s_t],
s_t the 12 bits of the channel's stream that end where code t ends (tail-biting: those before the stream's first
are its last). A 0-bit channel decodes to 0 (its centroid alone). The fused kernel reads it as its TRELLIS form
(kernels/span_args.py), window by window; the 8-bit path's QKᵀ takes its rebuilt keys (it has no integer-code
form).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kernels.span_args import TRELLIS, TRELLIS_ERROR_STEP, SideArgs
from .. import trellis
from ..quant import deferring
from ..tables import on_device
from .channels import Channels, _buffer_size, _byte_layout, _scatter_codes

_ERROR_STEP = torch.tensor(TRELLIS_ERROR_STEP, device="cpu")


def _check_widths(b: torch.Tensor) -> None:
    """Widths in 0-8: a deferred flag under the cache's checks, else read at once (one host read)."""
    ok = ((b >= 0) & (b <= 8)).all()
    checks = deferring()
    if checks is not None:
        checks.record(ok)
    elif not bool(ok):
        raise ValueError(f"trellis widths are 0-8 bits a channel, got {int(b.min())}..{int(b.max())}")


@dataclass(frozen=True, eq=False)
class TrellisChannels(Channels):
    """codes: the uint8 buffer; bits (S, D) uint8; low: each channel's mean, step_: its scale (S, D) fp16; N."""

    @classmethod
    def code(cls, r: torch.Tensor, bits: torch.Tensor, alpha: torch.Tensor | None = None,
             capacity: int | None = None) -> TrellisChannels:
        """r (S, N, D) coded channel by channel by the trellis with widths bits (S, D) against its mean and scale
        (fp16) over the span; `capacity` as in `Channels.pack`. `alpha` (a grid's clip) has no meaning here."""
        S, N, D = r.shape
        if tuple(bits.shape) != (S, D):
            raise ValueError(f"trellis widths must be (streams, channels) = {(S, D)}, got {tuple(bits.shape)}")
        rf = r.float()
        b = bits.to(r.device).long()
        _check_widths(b)
        coded = b > 0
        std = rf.std(1, correction=0) if N > 1 else torch.zeros(S, D, device=r.device)
        tiny = torch.finfo(torch.float16).tiny
        low = torch.where(coded, rf.mean(1), 0.0).half()
        step = torch.where(coded, trellis.scale_of(std, b).clamp_min(tiny), 1.0).half()
        codes = trellis.encode(rf, b, low.float(), step.float())
        offsets, needed = _byte_layout(b, N)
        out = cls(_scatter_codes(codes, b, offsets, _buffer_size(needed, capacity)), b.to(torch.uint8), low, step, N)
        out.__dict__["offsets"] = offsets
        return out

    def decode(self) -> torch.Tensor:
        state = trellis.states(self.codes, self.offsets, self.bits, self.n_tokens)
        x = self.low.float()[:, None, :] + trellis.values(state, self.bits) * self.step_.float()[:, None, :]
        return torch.where(self.bits[:, None, :] > 0, x, 0.0)

    def step(self) -> torch.Tensor:
        """Each coded channel's equivalent grid step, √12 times the error's standard deviation the width gives a
        Gaussian channel (span_args.TRELLIS_ERROR_STEP times the stored scale); 0-bit channels count as exact."""
        factor = on_device(_ERROR_STEP, self.bits.device)[self.bits.long()]
        step = self.step_.float() * factor
        return step[:, None, :].expand(self.shape).contiguous()

    def components(self) -> dict[str, torch.Tensor]:
        return {"alloc_bits": self.bits, "trellis_mean": self.low, "trellis_scale": self.step_,
                "trellis_codes": self.codes}

    def roles(self) -> dict[str, str]:
        return {"alloc_bits": "tables", "trellis_mean": "tables", "trellis_scale": "tables",
                "trellis_codes": "payload"}

    def describe(self) -> str:
        widest = self.__dict__.get("max_bits") or int(self.bits.max())  # a report: its host read is not kept
        return f"per-channel trellis codes over the span ({trellis.STATE_BITS}-bit states), 0-{widest} bits per channel"

    def make_kernel_side(self) -> SideArgs:
        meta = torch.add(self.bits.long(), self.offsets, alpha=16)  # offset * 16 + bits, as Channels'
        return SideArgs(TRELLIS, self.codes, self.n_tokens, self.step_, self.low_read, meta,
                        max_bits=self.__dict__.get("max_bits", 8))

    def settle_widest(self, lowp: str | None) -> None:
        """Nothing: no 8-bit rule reads a trellis span's widest channel (it has no integer-code form)."""

    def reads_codes(self, qk: str) -> bool:
        return False

    def code_form(self):
        raise ValueError(f"{self.describe()} has no integer-code form")

    def make_center(self) -> torch.Tensor:
        """Each channel's mean (0 on 0-bit channels)."""
        return self.low_read

