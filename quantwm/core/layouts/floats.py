"""The deployed formats' spans (quantwm/core/methods/formats.py encodes them; docs/method.md §3.1).

* `E2M1Blocks` (nvfp4): 4-bit e2m1 codes (sign << 3 | magnitude code) packed two a byte, one fp8-e4m3 scale per
  block of 16 channels of a token, one fp32 scale per stream.
* `TokenBlockInt8` (int8k-fp8v's keys): symmetric INT8 codes with one fp32 scale per block of `block` tokens x
  the head's channels.
* `ChannelFP8` (int8k-fp8v's values): fp8-e4m3 values with one fp32 scale per channel.

None has a fused-kernel view: the cache reads them through the reference path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..quant import unpack_bits_ref
from ..tables import on_device
from .base import Layout

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], device="cpu")  # the FP4 e2m1 magnitudes, code 0..7
E2M1_CELLS = torch.tensor([0.5, 0.5, 0.5, 0.5, 0.75, 1.0, 1.5, 1.0], device="cpu")  # each code's rounding cell
NVFP4_BLOCK = 16


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """4-bit e2m1 codes (sign << 3 | magnitude code) -> float32 values."""
    c = codes.long()
    mag = on_device(E2M1, codes.device)[c & 7]
    return torch.where((c >> 3) == 1, -mag, mag)


def e4m3_cell(y: torch.Tensor) -> torch.Tensor:
    """The spacing of fp8-e4m3 around each (already rounded) value: 2^(exponent - 3), 2^-9 below the normals."""
    a = y.abs().clamp_min(2.0 ** -6)
    return torch.exp2(torch.floor(torch.log2(a)) - 3)


@dataclass(frozen=True, eq=False)
class E2M1Blocks(Layout):
    """codes uint8 (S, N, D / 2), block_scales fp8 (S, N, D / 16), tensor_scales fp32 (S,)."""

    codes: torch.Tensor
    block_scales: torch.Tensor
    tensor_scales: torch.Tensor
    head_dim: int

    @property
    def shape(self) -> tuple[int, int, int]:
        return (*self.codes.shape[:2], self.head_dim)

    def components(self) -> dict[str, torch.Tensor]:
        return {"codes": self.codes, "block_scales": self.block_scales, "tensor_scales": self.tensor_scales}

    def _parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(e2m1 codes (S, N, D/16, 16), the scale of each block (S, N, D/16, 1))."""
        S, N, D = self.shape
        codes = unpack_bits_ref(self.codes, 4, D).reshape(S, N, D // NVFP4_BLOCK, NVFP4_BLOCK)
        scale = self.block_scales.float() * self.tensor_scales[:, None, None]
        return codes, scale[..., None]

    def decode(self) -> torch.Tensor:
        codes, scale = self._parts()
        return (e2m1_values(codes) * scale).reshape(self.shape)

    def step(self) -> torch.Tensor:
        """The width of each element's rounding cell, scaled: e2m1's spacing grows with the magnitude."""
        codes, scale = self._parts()
        return (on_device(E2M1_CELLS, codes.device)[codes.long() & 7] * scale).reshape(self.shape)

    def describe(self) -> str:
        return "FP4 e2m1 values, one fp8-e4m3 scale per 16 channels, one fp32 scale per stream"


@dataclass(frozen=True, eq=False)
class TokenBlockInt8(Layout):
    """codes int8 (S, N, D), scales fp32 (S, ceil(N / block)): value = code * its block's scale."""

    codes: torch.Tensor
    scales: torch.Tensor
    block: int

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.codes.shape)

    def components(self) -> dict[str, torch.Tensor]:
        return {"codes": self.codes, "scales": self.scales}

    def _scale(self) -> torch.Tensor:
        S, N, D = self.shape
        return self.scales.repeat_interleave(self.block, dim=1)[:, :N, None].expand(S, N, D)

    def decode(self) -> torch.Tensor:
        return self.codes.float() * self._scale()

    def step(self) -> torch.Tensor:
        return self._scale().clone()  # INT8: a uniform grid of step `scale`

    def describe(self) -> str:
        return f"symmetric INT8, one fp32 scale per {self.block} tokens x channels"


@dataclass(frozen=True, eq=False)
class ChannelFP8(Layout):
    """values fp8-e4m3 (S, N, D), scales fp32 (S, D): value = fp8 value * its channel's scale."""

    values: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.values.shape)

    def components(self) -> dict[str, torch.Tensor]:
        return {"fp8_values": self.values, "scales": self.scales}

    def decode(self) -> torch.Tensor:
        return self.values.float() * self.scales[:, None, :]

    def step(self) -> torch.Tensor:
        return e4m3_cell(self.values.float()) * self.scales[:, None, :]

    def describe(self) -> str:
        return "fp8-e4m3 values, one fp32 scale per channel"
