"""Fixed formats that deployed systems store their KV caches in (docs/method.md §3.1), as presets.

* `nvfp4`: NVIDIA's 4-bit float, which LongLive-2.0 uses for its KV cache on Blackwell GPUs. Per token, blocks
  of 16 consecutive channels; each element an FP4 e2m1 value ({0, 0.5, 1, 1.5, 2, 3, 4, 6} with a sign),
  one fp8-e4m3 scale per block, and one fp32 scale per tensor (here: per stream, one (batch, head) of a span)
  chosen so that the block scales fit e4m3: `global = amax / (6 · 448)`. Elements round to the nearest e2m1
  value, ties to the even code, saturating at ±6; block scales round to nearest e4m3. 4 + 8/16 = 4.5 bits
  per element, plus 32 bits per stream.
* `int8k-fp8v`: LightX2V's quantized KV cache for LingBot and Self-Forcing. Keys symmetric INT8 with one fp32
  scale per block of 64 tokens × the head's channels (`amax / 127`, SageAttention's per-block layout for K);
  Values fp8-e4m3 with one fp32 scale per channel (`amax / 448`). About 8 bits per element. Deviations, named:
  LightX2V calibrates its scales once per denoising step and layer; here each span computes its own when it is
  committed (the cache quantizes a span once), and SageAttention's smoothing of K (subtracting the mean key)
  is not applied, since the mean would have to be stored for the span to be read back alone.

Both formats fix their own bits: like `bf16`, they take no `bits` option, and the cache's k_bits/v_bits do
not apply to them (their bits per element are counted from the stored bytes, like every method's). Neither
has a fused-kernel format here: the cache reads them through the reference path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layouts import ChannelFP8, E2M1Blocks, Layout, TokenBlockInt8
from ..layouts.floats import E2M1, NVFP4_BLOCK, e2m1_values
from ..quant import pack_bits_ref
from ..tables import on_device
from .base import Method, SpanContext, register

__all__ = ["E2M1", "NVFP4", "Int8KFP8V", "e2m1_codes", "e2m1_values", "e4m3"]
# Rounding to e2m1: the midpoints between neighbours; a value exactly on one goes to the even code, which is
# the upper neighbour at 0.75, 1.75 and 3.5 and the lower one at 0.25, 1.25, 2.5 and 5.
E2M1_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], device="cpu")
E2M1_TIES_UP = torch.tensor([0.75, 1.75, 3.5], device="cpu")
E4M3_MAX = 448.0
INT8_BLOCK_TOKENS = 64


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to fp8-e4m3 (nearest, ties to even), saturating at ±448: returns float8_e4m3fn."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """4-bit codes (sign << 3 | magnitude code) of y rounded to e2m1, saturating at ±6: (...) -> uint8 (...)."""
    a = y.abs().clamp(max=6.0)
    mag = torch.bucketize(a, on_device(E2M1_MIDPOINTS, a.device))  # a on a midpoint goes to the lower code...
    mag = mag + torch.isin(a, on_device(E2M1_TIES_UP, a.device)).long()  # ...unless the upper one is even
    return (mag | ((y < 0).long() << 3)).to(torch.uint8)


@register("nvfp4")
@dataclass(frozen=True)
class NVFP4(Method):
    name = "nvfp4"
    source = "NVIDIA NVFP4, the KV-cache format of LongLive-2.0"
    takes_bits = False
    sweep = ({},)  # its bits are fixed: one point whatever --bits says

    def validate(self, x: torch.Tensor, kind: str) -> None:
        super().validate(x, kind)
        if x.shape[-1] % NVFP4_BLOCK:
            raise ValueError(f"nvfp4 needs a head dim divisible by {NVFP4_BLOCK}, got {x.shape[-1]}")

    def grid(self) -> str:
        return "FP4 e2m1 values, one fp8-e4m3 scale per 16 channels, one fp32 scale per stream (4.5 bits)"

    def encode(self, x: torch.Tensor, kind: str, ctx: SpanContext) -> Layout:
        self.validate(x, kind)
        S, N, D = x.shape
        xf = x.float()
        amax = xf.abs().amax((1, 2))
        tensor_scale = torch.where(amax > 0, amax / (6 * E4M3_MAX), torch.ones_like(amax))  # (S,)
        blocks = xf.reshape(S, N, D // NVFP4_BLOCK, NVFP4_BLOCK)  # (S, N, D) -> (S, N, D/16, 16)
        block_scale = e4m3(blocks.abs().amax(-1) / 6 / tensor_scale[:, None, None])  # (S, N, D/16) fp8
        denom = block_scale.float() * tensor_scale[:, None, None]
        y = torch.where(denom[..., None] > 0, blocks / denom[..., None].clamp_min(1e-38), torch.zeros_like(blocks))
        codes = e2m1_codes(y).reshape(S, N, D)
        return E2M1Blocks(pack_bits_ref(codes, 4), block_scale, tensor_scale.float(), D)


@register("int8k-fp8v")
@dataclass(frozen=True)
class Int8KFP8V(Method):
    name = "int8k-fp8v"
    source = "LightX2V's quantized KV cache (code github.com/ModelTC/LightX2V)"
    takes_bits = False
    sweep = ({},)  # its bits are fixed: one point whatever --bits says

    def grid(self) -> str:
        return ("Keys symmetric INT8, one fp32 scale per 64 tokens x channels; Values fp8-e4m3, one fp32 scale "
                "per channel (about 8 bits)")

    def encode(self, x: torch.Tensor, kind: str, ctx: SpanContext) -> Layout:
        self.validate(x, kind)
        S, N, D = x.shape
        xf = x.float()
        if kind == "k":
            nb = -(-N // INT8_BLOCK_TOKENS)
            pad = torch.nn.functional.pad(xf, (0, 0, 0, nb * INT8_BLOCK_TOKENS - N))
            blocks = pad.reshape(S, nb, INT8_BLOCK_TOKENS, D)  # (S, N, D) -> (S, N/64, 64, D), zero-padded
            amax = blocks.abs().amax((2, 3))
            scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))  # (S, N/64)
            codes = torch.round(blocks / scale[..., None, None]).clamp(-127, 127).to(torch.int8)
            return TokenBlockInt8(codes.reshape(S, -1, D)[:, :N].contiguous(), scale, INT8_BLOCK_TOKENS)
        amax = xf.abs().amax(1)  # per channel over the span's tokens: (S, D)
        scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        return ChannelFP8(e4m3(xf / scale[:, None, :]), scale)
