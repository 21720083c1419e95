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
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..allocate import encode_channels, error_tables
from ..layouts import Layout
from ..quant import check_bits
from .base import Method, SpanContext, register


@register("span-rtn")
@dataclass(frozen=True)
class SpanRTN(Method):
    name = "span-rtn"
    bits: int = 2

    def __post_init__(self):
        check_bits(self.bits)

    def grid(self) -> str:
        return (f"{self.bits}-bit asymmetric ({2 ** self.bits} levels) per channel over the span, every channel "
                "alike, clip by least squared error; fp16 low ends and steps")

    def encode(self, x: torch.Tensor, kind: str, ctx: SpanContext) -> Layout:
        self.validate(x, kind)
        S, _, D = x.shape
        _, alpha = error_tables(x, (self.bits,))  # (S, D, 1): each channel's best clip at this width
        bits = torch.full((S, D), self.bits, dtype=torch.long)
        return encode_channels(x.float(), bits, alpha[..., 0])
