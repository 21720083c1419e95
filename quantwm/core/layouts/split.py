"""A span whose loud tokens are kept in BF16 apart from the coded rest (QuantWM's allocator; docs/method.md §2.8).

A few tokens whose keys are several times louder than the span's others (massive activations, attention sinks)
stretch every per-channel grid of the span to their range, so the other tokens lose most of their levels; clipping
them instead costs their logits, which dominate attention. `TokenSplit` stores those tokens' vectors in BF16 with
their positions in the span and codes the other tokens as any layout (`rest`). Keys and Values of one span are split
at the same tokens (the cache splits the Values where the Keys' method split), so attention reads two spans, the
coded rest and the loud tokens in BF16: attention is a sum over tokens, their order does not matter
(quantwm/core/attention.py `chunk_spans`). Decoding puts every token back in its place.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Layout


@dataclass(frozen=True, eq=False)
class TokenSplit(Layout):
    """rest: the coded other tokens (S, N − n, D); index (n,) int16: the loud tokens' positions in the span, the
    same for every stream, ascending; loud (S, n, D) BF16: their vectors."""

    rest: Layout
    index: torch.Tensor
    loud: torch.Tensor

    def __post_init__(self):
        S, n, D = self.loud.shape
        if self.index.shape != (n,) or self.rest.shape[0] != S or self.rest.shape[2] != D:
            raise ValueError(f"a token split needs loud (S, n, D), index (n,) and rest (S, N − n, D), got "
                             f"{tuple(self.loud.shape)}, {tuple(self.index.shape)}, {tuple(self.rest.shape)}")

    @property
    def shape(self) -> tuple[int, int, int]:
        S, M, D = self.rest.shape
        return S, M + self.loud.shape[1], D

    def kept(self) -> torch.Tensor:
        """(N,) bool: True at the rest's tokens."""
        return kept_tokens(self.shape[1], self.index)

    def components(self) -> dict[str, torch.Tensor]:
        return {**self.rest.components(), "loud_index": self.index, "loud_bf16": self.loud}

    def shared(self) -> dict[str, torch.Tensor]:
        return self.rest.shared()

    def roles(self) -> dict[str, str]:
        return {**self.rest.roles(), "loud_index": "loud", "loud_bf16": "loud"}

    def _scatter(self, rest: torch.Tensor, loud: torch.Tensor) -> torch.Tensor:
        S, N, D = self.shape
        out = torch.empty(S, N, D, dtype=torch.float32, device=rest.device)
        out[:, kept_index(N, self.index)] = rest.float()  # integer indices: no host read
        out[:, self.index.long()] = loud.float()
        return out

    def decode(self) -> torch.Tensor:
        return self._scatter(self.rest.decode(), self.loud)

    def step(self) -> torch.Tensor | None:
        inner = self.rest.step()
        return None if inner is None else self._scatter(inner, torch.zeros_like(self.loud, dtype=torch.float32))

    def channel_bits(self) -> torch.Tensor | None:
        return self.rest.channel_bits()

    def describe(self) -> str:
        return f"{self.loud.shape[1]} loud token(s) in BF16; the others: {self.rest.describe()}"

    def view_tensors(self) -> list[torch.Tensor]:
        return self.rest.view_tensors()

    def prepare(self, lowp: str | None = None) -> None:
        self.rest.prepare(lowp)


def split_tokens(x: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the rest (S, N − n, D), the loud tokens (S, n, D) in BF16) of x (S, N, D) at `index` (n,)."""
    return x[:, kept_index(x.shape[1], index)], x[:, index.long()].to(torch.bfloat16)


def kept_index(n_tokens: int, index: torch.Tensor) -> torch.Tensor:
    """(n_tokens − n,) int64 ascending: the positions not in `index` (n,), found without a host read (a stable sort
    of the kept mask puts the kept positions first, in order)."""
    keep = kept_tokens(n_tokens, index)
    return keep.to(torch.uint8).argsort(descending=True, stable=True)[: n_tokens - index.shape[0]]


def kept_tokens(n_tokens: int, index: torch.Tensor) -> torch.Tensor:
    """(n_tokens,) bool on index's device: False at `index`, the held tokens."""
    keep = torch.ones(n_tokens, dtype=torch.bool, device=index.device)
    keep[index.long()] = False
    return keep
