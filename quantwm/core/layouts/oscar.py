"""Spans coded in a rotated basis, OSCAR's form (arXiv 2605.17757; the `oscar` method): per-token groups of the
rotated vectors y = x R, then x̂ = ŷ Rᵀ.

`inner` is the `Grouped` layout of the rotated span (S, N, D): per token, groups of `group_size` channels (OSCAR's
128: the whole head), asymmetric min/max codes with fp16 scales and zeros. `rotation` is the orthogonal R (1, D, D)
fp16 of the layer, calibrated once from the history statistics (see the method) and then the same tensor object in
every later span of the layer: `shared()`, so the cache counts it once per layer. Spans quantized before any history
carry `rotation=None`: their R is the data-free normalized Hadamard matrix (`data_free_rotation`), regenerated, no
bytes.

Worked example: D = 128, 2 bits, one group per token: 32 bytes of codes and 2 + 2 bytes of scale and zero a token,
2.25 bits per element; the layer's rotation adds 128 · 128 · 2 = 32 KiB once (over two spans of 4 heads × 1728
tokens, 0.148 bits per element).

The fused kernel does not read this form (`kernel_side` is None): the reference path decodes it.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..random_rotation import hadamard, is_power_of_two, random_rotation
from ..tables import on_device
from .base import Layout
from .grouped import Grouped


@functools.lru_cache(maxsize=16)
def data_free_rotation(d: int) -> torch.Tensor:
    """The rotation of a span coded before any history (d, d) float32: H_d / √d (a seeded random orthogonal
    matrix where d is not a power of two), built once per d on the host (callers must not modify it)."""
    return hadamard(d) / d ** 0.5 if is_power_of_two(d) else random_rotation(d, 0)


@dataclass(frozen=True, eq=False)
class OscarSpan(Layout):
    """inner: the rotated span's per-token groups; rotation: R (1, D, D) fp16 shared by the layer's spans, or None
    (the data-free rotation)."""

    inner: Grouped
    rotation: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.inner.shape

    def matrix(self) -> torch.Tensor:
        """R (1, D, D) float32 as the decoder applies it."""
        D = self.shape[2]
        if self.rotation is None:
            return on_device(data_free_rotation(D), self.inner.q.codes.device)[None]
        return self.rotation.float()

    def components(self) -> dict[str, torch.Tensor]:
        return self.inner.components()

    def shared(self) -> dict[str, torch.Tensor]:
        return {} if self.rotation is None else {"oscar_rotation": self.rotation}

    def decode(self) -> torch.Tensor:
        return self.inner.decode() @ self.matrix().transpose(1, 2)  # (S, N, D) @ (1, D, D): back to the model's space

    def step(self) -> torch.Tensor | None:
        """Per channel, the uniform step of the same error variance, Δ_j² = Σ_i R_ji² Δ_i²."""
        inner = self.inner.step()
        return None if inner is None else (inner.square() @ self.matrix().square().transpose(1, 2)).sqrt()

    def describe(self) -> str:
        basis = "the data-free Hadamard rotation" if self.rotation is None else "the layer's calibrated rotation"
        return f"in {basis}: {self.inner.describe()}"
