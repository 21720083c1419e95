"""Transform-coded spans: each token's vector rotated at random and coded with Lloyd-Max levels, TurboQuant-MSE's
form (arXiv 2504.19874; the `turboquant` method).

A span's channels form one part, or two (the `outlier_channels` split): part 0 the listed channels, part 1 the
rest, each coded alone, as the paper codes its outlier and regular channels by two independent instances. For
part p of d_p channels and width b_p, token t's sub-vector x_t (d_p) is stored as its norm n_t = ‖x_t‖ (fp16,
widened to fp32 only where fp16 cannot hold it) and the b_p-bit Lloyd-Max codes of the rotated unit vector's
coordinates scaled to unit variance, z = √d_p · R_p x_t / n_t (each ≈ N(0, 1)), packed along the channels
(`quant.pack_bits_ref`). Decoding is x̂_t = n_t · R_pᵀ ẑ / √d_p, ẑ the codes' levels.

Stored per span, and counted: the codes of every part (S, N, ceil(d_p b_p / 8)) uint8, the norms (S, N, P) and,
with a split, each stream's outlier channels (S, k) uint8 (int16 past 256 channels), ascending. Regenerated,
not stored: the rotations R_p (`random_rotation(d_p, 2 · seed + p)`, a randomized Hadamard transform where d_p
is a power of two, else a seeded random orthogonal matrix) and the Lloyd-Max tables (`lloyd_max`). The seed is
the method's, the same for every span, stream and layer: one integer per cache, no bytes per span.

Worked example: D = 128, bits 2, 32 outlier channels at 3 bits. Part 0: 32 channels, 3-bit codes, 12 bytes a
token; part 1: 96 channels, 2-bit codes, 24 bytes a token; two fp16 norms a token, 4 bytes; 32 channel indices
a stream. On a span of N tokens: (40 N + 32) bytes a stream, (2.5 + 2 / N) bits per element.

The grid is not uniform: `step` gives the uniform step of equal error variance (Δ²/12 = n_t² · mse(b_p) / d_p
per channel of part p, the rotation spreading the error evenly over the part), what `+jensen` needs. The fused
kernel does not read this form (`kernel_side` is None): spans are read through the reference path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..lloyd_max import lloyd_max, lloyd_max_values
from ..quant import unpack_bits_ref
from ..random_rotation import random_rotation
from ..tables import on_device
from .base import Layout


def part_channels(channels: torch.Tensor | None, head_dim: int) -> list[torch.Tensor | None]:
    """Each part's channels (S, d_p) int64: [outliers, the rest in order] from the outlier list (S, k), or [None]
    (every channel, in order) without one."""
    if channels is None:
        return [None]
    idx = channels.long()
    listed = torch.zeros(idx.shape[0], head_dim, dtype=torch.bool, device=idx.device).scatter(1, idx, True)
    rest = torch.sort(listed.to(torch.uint8), dim=1, stable=True).indices[:, : head_dim - idx.shape[1]]  # unlisted first
    return [idx, rest]


def part_rotation(d: int, seed: int, part: int, device: torch.device) -> torch.Tensor:
    """Part `part`'s rotation (d, d) float32 on `device` (copied there once)."""
    return on_device(random_rotation(d, 2 * seed + part), device)


@dataclass(frozen=True, eq=False)
class Rotated(Layout):
    """codes: per part, packed (S, N, ceil(d_p b_p / 8)) uint8; norms (S, N, P) fp16; channels (S, k) or None;
    bits and dims per part; head_dim D; seed: the rotations' (see the module)."""

    codes: tuple[torch.Tensor, ...]
    norms: torch.Tensor
    channels: torch.Tensor | None
    bits: tuple[int, ...]
    dims: tuple[int, ...]
    head_dim: int
    seed: int

    @property
    def shape(self) -> tuple[int, int, int]:
        return (*self.norms.shape[:2], self.head_dim)

    def components(self) -> dict[str, torch.Tensor]:
        out = {f"rot_codes{p}": c for p, c in enumerate(self.codes)}
        out["rot_norms"] = self.norms
        if self.channels is not None:
            out["rot_channels"] = self.channels
        return out

    def _scatter(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Per-part tensors (S, N, d_p) laid back on their channels: (S, N, D)."""
        idx = part_channels(self.channels, self.head_dim)
        if idx[0] is None:
            return parts[0]
        S, N, D = self.shape
        out = torch.empty(S, N, D, device=parts[0].device)
        for i, t in zip(idx, parts):
            out.scatter_(2, i[:, None, :].expand(S, N, -1), t)
        return out

    def decode(self) -> torch.Tensor:
        parts = []
        for p, (codes, b, d) in enumerate(zip(self.codes, self.bits, self.dims)):
            z = lloyd_max_values(unpack_bits_ref(codes, b, d), b)  # (S, N, d) unit-variance levels
            u = (z / d ** 0.5) @ part_rotation(d, self.seed, p, z.device)  # rotated back: y @ R
            parts.append(u * self.norms[..., p: p + 1].float())
        return self._scatter(parts)

    def step(self) -> torch.Tensor:
        """The uniform step of the same error variance per element (see the module): not a grid step."""
        parts = []
        for p, (b, d) in enumerate(zip(self.bits, self.dims)):
            delta = self.norms[..., p].float() * (12 * lloyd_max(b).mse / d) ** 0.5  # (S, N)
            parts.append(delta[..., None].expand(*delta.shape, d))
        return self._scatter(parts).contiguous()

    def describe(self) -> str:
        widths = " + ".join(f"{d} channels at {b} bits" for d, b in zip(self.dims, self.bits))
        return f"randomly rotated unit vectors, Lloyd-Max codes ({widths}), a norm per token and part"
