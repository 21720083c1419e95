"""Plain group quantizers: bf16 (the reference, no quantization), rtn and kivi (docs/method.md §3).

* rtn: per-token groups of `group_size` channels, asymmetric min/max (or the symmetric grid), 2 bits.
* kivi (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache"): Keys
  per-channel (groups of `group_size` tokens), Values per-token. KIVI's full-precision recent window is
  the cache's BF16 recent chunk. A span shorter than `group_size` tokens forms one shorter group.
* kivi-pre: the same quantizer on keys stored *before* RoPE (rotated at read), the variant a third-party
  reproduction found to beat QVG on LongCat-Video (docs/method.md §3). It needs a cache with rope="pre" and
  the model's RoPE; `quantwm analyze` builds one for any trace (post-RoPE traces are un-rotated with the
  trace's 3-D RoPE). The built-in world model's RoPE runs over world coordinates the cache does not know, so
  it cannot run kivi-pre.

rtn, kivi and kivi-pre take `values="channels"`: Values in span-rtn's per-channel span grids at the method's bits
(core/methods/span_rtn.py), Keys as the method codes them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layouts import Full, Grouped, Layout
from ..quant import ROUNDINGS, SCALE_DTYPES, GroupQuant, check_bits, quantize_groups
from .base import Method, SpanContext, register
from .span_rtn import channel_values, check_values

GROUPS = (32, 64, 128)  # the group sizes a budget rule turns, finest first


@register("bf16")
@dataclass(frozen=True)
class BF16(Method):
    name = "bf16"
    source = "the reference: no quantization"
    quantized = False
    takes_bits = False

    def encode(self, x: torch.Tensor, kind: str, ctx: SpanContext) -> Layout:
        self.validate(x, kind)
        return Full(x.to(torch.bfloat16))


@dataclass(frozen=True)
class GroupMethod(Method):
    """Shared fields and the residual coder for every method that ends in group quantization."""

    bits: int = 2
    group_size: int = 64
    symmetric: bool = False
    scale_dtype: str = "fp16"
    scale_rounding: str = "up"

    def __post_init__(self):
        check_bits(self.bits)
        if self.scale_rounding not in ROUNDINGS:
            raise ValueError(f"scale_rounding must be one of {', '.join(ROUNDINGS)}, got {self.scale_rounding!r}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype must be one of {', '.join(SCALE_DTYPES)}, got {self.scale_dtype!r}")

    def axis(self, kind: str) -> str:
        return "channel"

    def validate(self, x: torch.Tensor, kind: str) -> None:
        super().validate(x, kind)
        if self.axis(kind) == "channel" and x.shape[-1] % self.group_size:
            raise ValueError(f"head dim {x.shape[-1]} does not divide by group_size={self.group_size} (per-token groups)")

    def grid(self) -> str:
        levels = 2 ** self.bits - 1 if self.symmetric else 2 ** self.bits
        kind = "symmetric" if self.symmetric else "asymmetric"
        meta = f"{self.scale_dtype} scales" + ("" if self.symmetric else " and zeros")
        return f"{self.bits}-bit {kind} ({levels} levels), groups of {self.group_size}, {meta} ({self.scale_rounding})"

    def quantize_residual(self, r: torch.Tensor, kind: str) -> GroupQuant:
        return quantize_groups(r, self.bits, self.group_size, self.axis(kind), self.symmetric, self.scale_dtype,
                               self.scale_rounding)

    def encode(self, x: torch.Tensor, kind: str, ctx: SpanContext) -> Layout:
        self.validate(x, kind)
        return Grouped(self.quantize_residual(x, kind))


@dataclass(frozen=True)
class ValuesOption(GroupMethod):
    """A group method whose Values may take span-rtn's format instead (`values="channels"`)."""

    values: str = "own"

    def __post_init__(self):
        super().__post_init__()
        check_values(self.values, self.bits)

    def grid(self) -> str:
        own = super().grid()
        return own if self.values == "own" else f"Keys {own}; Values span-rtn's per-channel grids at {self.bits} bits"

    def encode(self, x: torch.Tensor, kind: str, ctx: SpanContext) -> Layout:
        values = channel_values(self.values, self.bits, x, kind)
        return values if values is not None else super().encode(x, kind, ctx)


@register("rtn")
@dataclass(frozen=True)
class RTN(ValuesOption):
    name = "rtn"
    source = "round-to-nearest, no paper"
    sweep = tuple({"group_size": g} for g in GROUPS)
    quick_sweep = ({},)

    @classmethod
    def budget_candidates(cls, head_dim: int, kind: str) -> list[dict]:
        """Bits 8, 4, 3, 2, each with the groups of 32, 64, 128 channels the head allows (more bits before finer
        groups)."""
        return [{"bits": b, "group_size": g} for b in (8, 4, 3, 2) for g in GROUPS if head_dim % g == 0]


@register("kivi")
@dataclass(frozen=True)
class KIVI(ValuesOption):
    name = "kivi"
    source = "arXiv 2402.02750; code github.com/jy-yuan/KIVI"
    sweep = tuple({"group_size": g} for g in GROUPS)

    @classmethod
    def budget_candidates(cls, head_dim: int, kind: str) -> list[dict]:
        """KIVI's 4 and 2 bits, each with groups of 32, 64, 128 (KIVI's group-size knob)."""
        return [{"bits": b, "group_size": g} for b in (4, 2) for g in GROUPS]

    def axis(self, kind: str) -> str:
        return "token" if kind == "k" else "channel"


@register("kivi-pre")
@dataclass(frozen=True)
class KIVIPre(KIVI):
    name = "kivi-pre"
    source = "KIVI (arXiv 2402.02750) on pre-RoPE keys, after a third-party LongCat-Video reproduction"
    sweep = KIVI.sweep  # traces only: the built-in model cannot run pre-RoPE keys
    pre_rope = True
