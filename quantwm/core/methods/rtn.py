"""Plain group quantizers: bf16 (the reference, no quantization), rtn and kivi (SPEC.md §3).

* rtn: per-token groups of `group_size` channels, asymmetric min/max (or the symmetric grid), 2 bits.
* kivi (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache"): Keys
  per-channel (groups of `group_size` tokens), Values per-token. KIVI's full-precision recent window is
  the cache's BF16 recent chunk. A span shorter than `group_size` tokens forms one shorter group.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..quant import SCALE_DTYPES, GroupQuant, check_bits, dequantize_groups, group_step, quantize_groups
from .base import Encoded, Method, SpanContext, register


@register("bf16")
@dataclass(frozen=True)
class BF16(Method):
    name = "bf16"
    quantized = False

    def encode(self, x: torch.Tensor, kind: str, ctx: SpanContext) -> Encoded:
        self.validate(x, kind)
        return Encoded({"bf16": x.to(torch.bfloat16)}, tuple(x.shape))

    def decode(self, enc: Encoded) -> torch.Tensor:
        return enc.tensors["bf16"].float()


@dataclass(frozen=True)
class GroupMethod(Method):
    """Shared fields and the residual coder for every method that ends in group quantization."""

    bits: int = 2
    group_size: int = 64
    symmetric: bool = False
    scale_dtype: str = "fp16"

    def __post_init__(self):
        check_bits(self.bits)
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
        return f"{self.bits}-bit {kind} ({levels} levels), groups of {self.group_size}, {self.scale_dtype} scales"

    def quantize_residual(self, r: torch.Tensor, kind: str) -> GroupQuant:
        return quantize_groups(r, self.bits, self.group_size, self.axis(kind), self.symmetric, self.scale_dtype)

    def residual(self, enc: Encoded) -> GroupQuant:
        t = enc.tensors
        return GroupQuant(t["codes"], t["scales"], t.get("zeros"), enc.shape, self.bits, self.group_size,
                          enc.meta["axis"], self.symmetric)

    def encode(self, x: torch.Tensor, kind: str, ctx: SpanContext) -> Encoded:
        self.validate(x, kind)
        q = self.quantize_residual(x, kind)
        return Encoded(q.tensors(), tuple(x.shape), {"axis": q.axis})

    def decode(self, enc: Encoded) -> torch.Tensor:
        return dequantize_groups(self.residual(enc))

    def step(self, enc: Encoded) -> torch.Tensor:
        return group_step(self.residual(enc))


@register("rtn")
@dataclass(frozen=True)
class RTN(GroupMethod):
    name = "rtn"


@register("kivi")
@dataclass(frozen=True)
class KIVI(GroupMethod):
    name = "kivi"

    def axis(self, kind: str) -> str:
        return "token" if kind == "k" else "channel"
