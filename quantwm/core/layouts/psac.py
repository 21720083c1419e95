"""PSAC coefficients on top of a key layout (docs/method.md §2.2): k̂ = base + U â.

`basis` U (S, D, R) is shared with the spans that reuse it (counted once by the cache); the coefficients a = Uᵀ e
of the base's error are stored quantized as a `GroupQuant` of shape (S, N, R): one scale (and zero) per
direction over the span, or per token (the paper's INT8 coefficients). `RankCompensated` keeps r_s ≤ R
directions for stream s (adaptive rank), one `GroupQuant` (1, N, r_s) per stream.

The fused kernel reads the base's codes and adds (Uᵀq)·â per key: R MACs on the coefficient codes, with (Uᵀq)
times each direction's scale and zero computed once per query (`psac_args`). It takes per-direction asymmetric
coefficients of 2, 4 or 8 bits and R ≤ 16; other forms are read by the reference path.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import cached_property

import torch

from ...kernels.span_args import PsacArgs, SideArgs
from ..psac import psac_correction
from ..quant import GroupQuant, dequantize_groups
from .base import CodeForm, Layout

MAX_FUSED_RANK = 16
_FP32_BASES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def fp32_basis(U: torch.Tensor) -> torch.Tensor:
    """U in fp32, one copy per stored basis however many spans share it (alive while a span holds it)."""
    key = (id(U), U.data_ptr())
    wide = _FP32_BASES.get(key)
    if wide is None:
        wide = _FP32_BASES[key] = U.float()
    return wide


@dataclass(frozen=True, eq=False)
class Compensated(Layout):
    base: Layout
    basis: torch.Tensor
    coeffs: GroupQuant

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.base.shape

    def components(self) -> dict[str, torch.Tensor]:
        c = self.coeffs
        out = {"psac_codes": c.codes, "psac_scales": c.scale}
        if c.zero is not None:
            out["psac_zeros"] = c.zero
        return {**self.base.components(), **out}

    def shared(self) -> dict[str, torch.Tensor]:
        return {**self.base.shared(), "psac_basis": self.basis}

    def correction(self) -> torch.Tensor:
        """U â for every token, (S, N, D)."""
        return psac_correction(self.coeffs, self.basis)

    def decode(self) -> torch.Tensor:
        return self.base.decode() + self.correction()

    def step(self) -> torch.Tensor | None:
        return self.base.step()

    def describe(self) -> str:
        c = self.coeffs
        per = "per-token" if c.axis == "channel" else "per-direction"
        return f"{self.base.describe()}; PSAC rank {self.basis.shape[-1]}, {c.bits}-bit {per} coefficients"

    def _fused_coeffs(self) -> bool:
        c = self.coeffs
        return c.axis == "token" and not c.symmetric and c.bits in (2, 4, 8) and self.basis.shape[-1] <= MAX_FUSED_RANK

    def make_kernel_side(self) -> SideArgs | None:
        return self.base.make_kernel_side() if self._fused_coeffs() else None

    @cached_property
    def _direction_terms(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(U (S, D, R), scales (S, R), zeros (S, R)) in fp32: one scale and zero per direction."""
        return fp32_basis(self.basis), self.coeffs.scale.float()[:, 0], self.coeffs.zero.float()[:, 0]

    def prepare(self, lowp: str | None = None) -> None:
        super().prepare(lowp)
        if self.kernel_side is not None:
            _ = self._direction_terms

    def view_tensors(self) -> list[torch.Tensor]:
        return super().view_tensors() + (list(self.__dict__["_direction_terms"]) if "_direction_terms" in self.__dict__
                                         else [])

    def keys_read(self) -> Layout:
        return self.base

    def psac_args(self, q: torch.Tensor) -> PsacArgs | None:
        if not self._fused_coeffs():  # per-token or symmetric coefficients: the reference path decodes them
            return None
        U, scales, zeros = self._direction_terms
        pq = torch.bmm(q.float(), U)  # (S, Nq, D) @ (S, D, R) -> (S, Nq, R)
        return PsacArgs(pq * scales[:, None], (pq * zeros[:, None]).sum(-1), self.coeffs.codes, self.coeffs.bits)

    def reads_codes(self, qk: str) -> bool:
        return self.base.reads_codes(qk)

    def code_form(self) -> CodeForm:
        return self.base.code_form()

    def make_center(self) -> torch.Tensor:
        return self.base.make_center()


@dataclass(frozen=True, eq=False)
class RankCompensated(Layout):
    """PSAC with stream s keeping its first ranks[s] directions: coeffs, one GroupQuant (1, N, r_s) per stream."""

    base: Layout
    basis: torch.Tensor
    ranks: torch.Tensor
    coeffs: tuple

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.base.shape

    def components(self) -> dict[str, torch.Tensor]:
        out = {"psac_ranks": self.ranks}
        for s, c in enumerate(self.coeffs):
            out[f"psac_codes.{s}"], out[f"psac_scales.{s}"], out[f"psac_zeros.{s}"] = c.codes, c.scale, c.zero
        return {**self.base.components(), **out}

    def shared(self) -> dict[str, torch.Tensor]:
        return {**self.base.shared(), "psac_basis": self.basis}

    def decode(self) -> torch.Tensor:
        U = self.basis.float()
        out = self.base.decode()
        for s, c in enumerate(self.coeffs):
            r = c.shape[-1]
            out[s] += dequantize_groups(c)[0] @ U[s, :, :r].T
        return out

    def step(self) -> torch.Tensor | None:
        return self.base.step()

    def describe(self) -> str:
        return f"{self.base.describe()}; PSAC with per-stream ranks up to {self.basis.shape[-1]}"
