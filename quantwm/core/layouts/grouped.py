"""Full-precision spans, group-quantized spans and k-means codebook stages over a residual layout.

`Grouped` is `quant.GroupQuant`'s codes, scales and zeros as a span: per token in groups of G channels
(axis "channel") or per channel in groups of G tokens (axis "token", KIVI's keys). `Codebook` adds one or more
k-means stages in front of any residual layout (QVG's smoothing; QuantWM's centroids; a single mean row per
stream, with no ids, for the allocator's spans that keep one).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kernels.span_args import BLOCK_N, CHANNELS, FULL, GROUPED, TRELLIS, SideArgs
from ..quant import GroupQuant, dequantize_groups, group_step, unpack_bits_ref
from .base import CodeForm, Layout
from .channels import Channels


def gather_rows(c: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """c (S, K, D), ids (S, N) -> (S, N, D)."""
    return torch.gather(c, 1, ids[..., None].long().expand(*ids.shape, c.shape[-1]))


@dataclass(frozen=True, eq=False)
class Full(Layout):
    """A span kept as it is (BF16 for the `bf16` method): data (S, N, D)."""

    data: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.data.shape)

    @property
    def quantized(self) -> bool:
        return False

    def components(self) -> dict[str, torch.Tensor]:
        return {"bf16": self.data}

    def decode(self) -> torch.Tensor:
        return self.data.float()

    def describe(self) -> str:
        return f"full precision ({str(self.data.dtype).removeprefix('torch.')})"

    def make_kernel_side(self) -> SideArgs:
        return SideArgs(FULL, self.data, self.data.shape[1])

    def make_center(self) -> torch.Tensor:
        return self.data.float().mean(1)


@dataclass(frozen=True, eq=False)
class Grouped(Layout):
    """Packed b-bit codes with per-group scales (and zeros on an asymmetric grid); see `quant.GroupQuant`."""

    q: GroupQuant

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.q.shape)

    def components(self) -> dict[str, torch.Tensor]:
        return self.q.tensors()

    def decode(self) -> torch.Tensor:
        return dequantize_groups(self.q)

    def step(self) -> torch.Tensor:
        return group_step(self.q)

    def describe(self) -> str:
        q = self.q
        return f"{q.bits}-bit {'symmetric' if q.symmetric else 'asymmetric'} groups of {q.group_size} along {q.axis}s"

    def make_kernel_side(self) -> SideArgs | None:
        q, D = self.q, self.shape[-1]
        G = q.group_size
        if q.bits not in (2, 4, 8) or (q.axis == "channel" and (D % G or G & (G - 1))):
            return None
        return SideArgs(GROUPED, q.codes, self.shape[1], q.scale, q.zero, bits=q.bits, group_size=G,
                        axis_token=q.axis == "token", symmetric=q.symmetric)

    def reads_codes(self, qk: str) -> bool:
        """Codes that fit the format (any width in INT8, up to 4 bits in e4m3), grouped along channels in groups of
        at least 16 (a tensor-core dot per group) or along tokens in whole key tiles (one group per tile)."""
        q, D = self.q, self.shape[-1]
        if self.make_kernel_side() is None or (qk == "e4m3" and q.bits > 4):
            return False
        return q.group_size >= 16 and D % q.group_size == 0 if q.axis == "channel" else q.group_size % BLOCK_N == 0

    def code_form(self) -> CodeForm:
        q = self.q
        half = 2 ** (q.bits - 1)
        u = unpack_bits_ref(q.codes, q.bits, self.shape[-1]).float() - half  # (S, N, D)
        sc = q.scale.float()
        zp = sc if q.symmetric else q.zero.float() + sc * half
        return CodeForm(u, sc, zp, q.group_size, q.axis == "token")

    def make_center(self) -> torch.Tensor:
        """The mid-grid value of every group (its zero plus half the grid; 0 on a symmetric grid), averaged over
        the span."""
        q = self.q
        sc = q.scale.float()
        mid = 0 * sc if q.symmetric else q.zero.float() + sc * ((2 ** q.bits - 1) / 2)
        c = mid.mean(1)  # token groups (S, D), or per-token channel groups (S, D / G)
        return c if q.axis == "token" else c.repeat_interleave(q.group_size, -1)


@dataclass(frozen=True, eq=False)
class Codebook(Layout):
    """k-means stages in front of a residual: stages ((codebook (S, K, D), ids (S, N) or None), ...); a stage
    without ids is one row per stream added to every token. The value is residual + Σ_stages codebook[id]."""

    stages: tuple
    residual: Layout

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.residual.shape

    def components(self) -> dict[str, torch.Tensor]:
        out = {}
        for s, (codebook, ids) in enumerate(self.stages):
            out[f"codebook{s}"] = codebook
            if ids is not None:
                out[f"centroid_ids{s}"] = ids
        return {**out, **self.residual.components()}

    def shared(self) -> dict[str, torch.Tensor]:
        return self.residual.shared()

    def roles(self) -> dict[str, str]:
        """The codebooks and centroid ids are side tables; the residual says what its own tensors are."""
        return {**dict.fromkeys(self.components(), "tables"), **self.residual.roles()}

    def channel_bits(self) -> torch.Tensor | None:
        return self.residual.channel_bits()

    def rows(self) -> torch.Tensor:
        """Σ over stages of every token's codebook row, (S, N, D) float32."""
        out = torch.zeros(self.shape, device=self.stages[0][0].device)
        for codebook, ids in self.stages:
            out = out + (codebook.float().expand(self.shape) if ids is None else gather_rows(codebook.float(), ids))
        return out

    def decode(self) -> torch.Tensor:
        return self.residual.decode() + self.rows()

    def step(self) -> torch.Tensor | None:
        return self.residual.step()

    def describe(self) -> str:
        K = self.stages[0][0].shape[1]
        return f"{len(self.stages)} codebook stage(s) of {K} rows; residual: {self.residual.describe()}"

    def make_kernel_side(self) -> SideArgs | None:
        side = self.residual.make_kernel_side()
        if side is None or len(self.stages) != 1:
            return None
        codebook, ids = self.stages[0]
        if ids is None:  # one row per stream: part of every channel's low end (the allocator's grids)
            # one add where the row is fp16 (widened exactly as it is added); fp8 does not promote: widened first
            row = codebook[:, 0].float() if codebook.element_size() == 1 else codebook[:, 0]
            return side._replace(zeros=torch.add(side.zeros, row)) if side.form in (CHANNELS, TRELLIS) else None
        return side._replace(codebook=codebook, ids=ids)

    def reads_codes(self, qk: str) -> bool:
        return self.kernel_side is not None and self.residual.reads_codes(qk)

    def prepare(self, lowp: str | None = None) -> None:
        if isinstance(self.residual, Channels):  # its widest channel where needed, before the view is built from it
            self.residual.settle_widest(lowp)
        super().prepare(lowp)

    def code_form(self) -> CodeForm:
        form = self.residual.code_form()
        codebook, ids = self.stages[0]
        if ids is None:
            return form._replace(offsets=form.offsets + codebook.float())
        return form._replace(codebook=codebook, ids=ids)

    def make_center(self) -> torch.Tensor:
        return self.residual.make_center() + sum(codebook.float().mean(1) for codebook, _ in self.stages)
