"""`span-rtn`: one uniform grid per channel over the span, every channel at the same width (issue 33's baseline).

Not from a paper: the plain coder that stores QuantWM's allocator's format (docs/method.md §2.6), so that a
comparison with the allocator credits the allocation and not the format. Per stream and channel, a `bits`-bit
asymmetric grid (2^b levels) over the span's tokens, its range shrunk about its middle by the clip α that
minimises the channel's squared error (the allocator's search: `allocate.error_tables`, α ∈ CLIPS, on at most
1024 strided tokens), low end and step in fp16, codes packed channel after channel: the `Channels` layout, which
the fused kernel reads as it reads the allocator's spans. The residual is the span itself: no mean row is
subtracted (the allocator's one-mean option), since a per-channel grid over the span already takes its channel's
offset in its low end; one would add D stored values and change nothing but rounding. Keys and Values alike;
no query statistics.

`values="channels"`: the option by which the other baselines (rtn, kivi, kivi-pre, turboquant, oscar) code their
Values in this format at their own `bits` (`channel_values`), so that their Key method is compared apart from their
Value format. Their default, `values="own"`, is the method's own Value format.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..allocate import encode_channels, error_tables
from ..layouts import Layout
from ..layouts.channels import channel_bytes
from ..quant import SUPPORTED_BITS, check_bits
from .base import Method, SpanContext, register

VALUE_FORMATS = ("own", "channels")  # a baseline's `values` option: its own Value format, or span-rtn's


@register("span-rtn")
@dataclass(frozen=True)
class SpanRTN(Method):
    name = "span-rtn"
    source = "this project (issue 33): the allocator's format at one width, no paper"
    sweep = ({},)
    bits: int = 2

    def __post_init__(self):
        check_bits(self.bits)

    @classmethod
    def budget_candidates(cls, head_dim: int, kind: str) -> list[dict]:
        """Bits 8, 4, 3, 2 (every channel alike)."""
        return [{"bits": b} for b in (8, 4, 3, 2)]

    def grid(self) -> str:
        return (f"{self.bits}-bit asymmetric ({2 ** self.bits} levels) per channel over the span, every channel "
                "alike, clip by least squared error; fp16 low ends and steps")

    def encode(self, x: torch.Tensor, kind: str, ctx: SpanContext) -> Layout:
        self.validate(x, kind)
        S, _, D = x.shape
        _, alpha = error_tables(x, (self.bits,))  # (S, D, 1): each channel's best clip at this width
        bits = torch.full((S, D), self.bits, dtype=torch.long, device=x.device)
        capacity = S * D * channel_bytes(x.shape[1], self.bits)  # every channel alike: the size is known here
        return encode_channels(x.float(), bits, alpha[..., 0], capacity)


def check_values(values: str, bits: int) -> None:
    """A baseline's `values` option: one of VALUE_FORMATS; "channels" needs a width span-rtn codes."""
    if values not in VALUE_FORMATS:
        raise ValueError(f"values must be one of {', '.join(VALUE_FORMATS)}, got {values!r}")
    if values == "channels" and bits not in SUPPORTED_BITS:
        raise ValueError(f"values='channels' codes Values at the method's bits, one of "
                         f"{', '.join(map(str, SUPPORTED_BITS))}; got bits={bits!r}")


def channel_values(values: str, bits: int, x: torch.Tensor, kind: str) -> Layout | None:
    """Values (S, N, D) in span-rtn's format at `bits` where `values="channels"` asks for it; else None (the
    method codes the span itself)."""
    if kind != "v" or values != "channels":
        return None
    return SpanRTN(bits=bits).encode(x, kind, SpanContext())
