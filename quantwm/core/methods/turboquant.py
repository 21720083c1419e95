"""TurboQuant-MSE (Zandieh, Daliri, Hadian, Mirrokni, "TurboQuant: Online Vector Quantization with Near-optimal
Distortion Rate", arXiv 2504.19874, ICLR 2026) as the `turboquant` preset.

Per token vector x (D channels): its L2 norm is stored (fp16) and the unit vector x / ‖x‖ is rotated by a seeded
random rotation (a randomized Hadamard transform, random ±1 signs then the normalized Walsh-Hadamard transform,
where D is a power of two; else a seeded random orthogonal matrix, QR of a Gaussian); every rotated coordinate,
≈ N(0, 1/D), is coded with the `bits`-bit Lloyd-Max quantizer of a Gaussian of that variance
(core/lloyd_max.py). Keys and Values alike; the layout is `Rotated` (core/layouts/rotated.py).

Options: `bits` 1-4; `values="channels"` (Values in span-rtn's per-channel span grids at `bits`, core/methods/
span_rtn.py; Keys as above); `seed` (the rotations'; every span, stream and layer shares them, so they cost no bytes);
`outlier_channels` k and `outlier_bits` for the paper's non-integer budgets ("2.5 bits": 32 of 128 channels at
3 bits, the rest at 2; "3.5 bits": 3 and 4), coded as the paper codes them, by two independent instances (each
with its own rotation and norm). Which channels are outliers the paper does not fix: here, per stream and span,
the k channels of largest mean square over the span, stored as a channel list. Measured bits per element count
every norm and list: the paper's "2.5 bits" stores 2.5 + 256 / (N·D) at D = 128 (two norms per token, the list).

Deviations, named: the paper's codebook is Lloyd-Max for the exact distribution of a coordinate of a random unit
vector (a scaled Beta, ≈ N(0, 1/d) in high dimension); here the Gaussian's, as the paper's analysis uses for
large d. The inner-product variant (TurboQuant-prod: `bits − 1` bits of this code plus a 1-bit QJL sketch of
the residual, `qjl=True`) is not built yet. The fused kernel does not read the form: spans take the reference
path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layouts import Layout, Rotated
from ..layouts.rotated import part_channels, part_rotation
from ..lloyd_max import LLOYD_MAX_BITS, lloyd_max_codes
from ..quant import pack_bits_ref, to_storage
from .base import Method, SpanContext, register
from .span_rtn import channel_values, check_values


def _check_width(name: str, bits) -> None:
    if bits not in LLOYD_MAX_BITS:
        raise ValueError(f"turboquant: unsupported {name}={bits!r}; allowed: {', '.join(map(str, LLOYD_MAX_BITS))}")


@register("turboquant")
@dataclass(frozen=True)
class TurboQuant(Method):
    name = "turboquant"
    source = "arXiv 2504.19874 (ICLR 2026); no released code read, built from the paper"
    sweep = ({}, {"outlier_channels": 32})  # plain, and the paper's split (32 channels one bit wider)
    bits: int = 2
    outlier_channels: int = 0
    outlier_bits: int | None = None  # None: bits + 1
    seed: int = 0
    values: str = "own"

    def __post_init__(self):
        _check_width("bits", self.bits)
        check_values(self.values, self.bits)
        if isinstance(self.outlier_channels, bool) or not isinstance(self.outlier_channels, int) \
                or self.outlier_channels < 0:
            raise ValueError(f"outlier_channels must be an integer >= 0, got {self.outlier_channels!r}")
        if self.outlier_bits is not None or self.outlier_channels:
            _check_width("outlier_bits", self.widths[0] if self.outlier_channels else self.outlier_bits)
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {self.seed!r}")

    @classmethod
    def budget_candidates(cls, head_dim: int, kind: str) -> list[dict]:
        """TurboQuant's widths, richest first: 4 bits, its "3.5-bit" split (a quarter of the channels, 32 of 128, at
        4 bits, the rest at 3), 3 bits, its "2.5-bit" split (3 and 2), 2 bits, 1 bit. A split stores a second norm per
        token and its channel list, which the measured bits count (2.5 + 256 / (N·D) at D = 128)."""
        k = head_dim // 4  # the paper's 32 outlier channels of 128

        def split(b):
            return [{"bits": b, "outlier_channels": k, "outlier_bits": b + 1}] if k else []
        return [{"bits": 4}, *split(3), {"bits": 3}, *split(2), {"bits": 2}, {"bits": 1}]

    @property
    def widths(self) -> tuple[int, ...]:
        """Bits of each part: (outliers, rest) with a split, else (bits,)."""
        if not self.outlier_channels:
            return (self.bits,)
        return (self.outlier_bits if self.outlier_bits is not None else self.bits + 1, self.bits)

    def grid(self) -> str:
        split = (f"; the {self.outlier_channels} channels of largest mean square at {self.widths[0]} bits, a second "
                 "instance" if self.outlier_channels else "")
        own = (f"TurboQuant-MSE: {self.bits}-bit Lloyd-Max codes ({2 ** self.bits} levels) of randomly rotated unit "
               f"vectors (seed {self.seed}){split}; an fp16 norm per token and instance")
        return own if self.values == "own" else f"Keys {own}; Values span-rtn's per-channel grids at {self.bits} bits"

    def outliers(self, x: torch.Tensor) -> torch.Tensor | None:
        """Each stream's outlier channels (S, k), ascending, as stored (uint8; int16 past 256 channels), or None."""
        k, D = self.outlier_channels, x.shape[-1]
        if not k:
            return None
        if k >= D:
            raise ValueError(f"outlier_channels={k} must be below the head dim {D}")
        top = x.square().mean(1).topk(k, dim=1).indices.sort(1).values  # (S, D) mean squares -> (S, k)
        return top.to(torch.uint8 if D <= 256 else torch.int16)

    def encode(self, x: torch.Tensor, kind: str, ctx: SpanContext) -> Layout:
        self.validate(x, kind)
        if (values := channel_values(self.values, self.bits, x, kind)) is not None:
            return values
        S, N, D = x.shape
        xf = x.float()
        channels = self.outliers(xf)
        codes, norms, dims = [], [], []
        for p, (idx, b) in enumerate(zip(part_channels(channels, D), self.widths)):
            xp = xf if idx is None else torch.gather(xf, 2, idx[:, None, :].expand(S, N, -1))  # (S, N, d)
            d = xp.shape[-1]
            n = xp.norm(dim=-1)  # (S, N)
            u = xp / torch.where(n > 0, n, 1.0)[..., None]
            z = (u @ part_rotation(d, self.seed, p, x.device).T) * d ** 0.5  # rotated, unit variance
            codes.append(pack_bits_ref(lloyd_max_codes(z, b), b))  # (S, N, ceil(d b / 8))
            norms.append(n)
            dims.append(d)
        stored = to_storage(torch.stack(norms, -1), torch.float16)  # (S, N, P)
        return Rotated(tuple(codes), stored, channels, self.widths, tuple(dims), D, self.seed)
