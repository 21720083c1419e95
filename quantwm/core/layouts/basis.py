"""A span coded in another orthogonal basis: QuantWM's allocator's Keys in the history Queries' basis
(quantwm/core/query_basis.py, docs/method.md §2.7).

The span stores the coordinates y = k U of its keys as any layout (`inner`, the allocator's Codebook + Channels);
the basis U = H_1 ⋯ H_R is shared with other spans as R INT8 Householder reflectors and their fp16 scales (counted
once by the cache). Decoding is k̂ = ŷ Uᵀ. The read path never decodes: `coded()` hands it U and the inner layout,
and it attends with the queries rotated once per basis, (q U)·ŷ = q·k̂; the kernel reads the inner layout's side.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ...kernels.span_args import SideArgs
from ..query_basis import basis_matrix
from .base import Layout


@dataclass(frozen=True, eq=False)
class InBasis(Layout):
    """inner: the coded coordinates (S, N, D); reflectors (S, R, D) int8 and scales (S, R) fp16: the basis."""

    inner: Layout
    reflectors: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.inner.shape

    @cached_property
    def basis(self) -> torch.Tensor:
        """U (S, D, D) float32: column i is coordinate i's direction in the model's space (one object for every
        span sharing the reflectors)."""
        return basis_matrix(self.reflectors, self.scales)

    def components(self) -> dict[str, torch.Tensor]:
        return self.inner.components()

    def shared(self) -> dict[str, torch.Tensor]:
        return {**self.inner.shared(), "basis_reflectors": self.reflectors, "basis_scales": self.scales}

    def roles(self) -> dict[str, str]:
        return {**self.inner.roles(), "basis_reflectors": "basis", "basis_scales": "basis"}

    def channel_bits(self) -> torch.Tensor | None:
        """Bits per coded coordinate (S, D), coordinates in the basis' order (top Query directions first)."""
        return self.inner.channel_bits()

    def coded(self) -> tuple[torch.Tensor | None, Layout]:
        return self.basis, self.inner

    def decode(self) -> torch.Tensor:
        return torch.bmm(self.inner.decode(), self.basis.transpose(1, 2))

    def step(self) -> torch.Tensor | None:
        """The per-channel step of the same error variance, Δ_j² = Σ_i U_ji² Δ_i² (what the reference path's +jensen
        reads; the fused path applies +jensen in the coded coordinates, where it is exact)."""
        inner = self.inner.step()
        if inner is None:
            return None
        return torch.bmm(inner.square(), self.basis.square().transpose(1, 2)).sqrt()

    def describe(self) -> str:
        return (f"in the history Queries' basis ({self.reflectors.shape[1]} Householder reflectors); coordinates: "
                f"{self.inner.describe()}")

    # The read path works on the coordinates: the kernel's view, the 8-bit path's codes and centre are the inner's.
    @property
    def kernel_side(self) -> SideArgs | None:
        return self.inner.kernel_side

    def view_tensors(self) -> list[torch.Tensor]:
        """The inner layout's, and the fp32 basis once built (runtime state; the same object in every span sharing
        it, which the cache counts once)."""
        return self.inner.view_tensors() + ([self.__dict__["basis"]] if "basis" in self.__dict__ else [])

    def prepare(self, lowp: str | None = None) -> None:
        self.inner.prepare(lowp)
        _ = self.basis
