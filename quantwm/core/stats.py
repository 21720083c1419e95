"""Running history-Query statistics: S = E[q qᵀ] per (layer, head), the input of QSAC and PSAC.

Before any query is seen S is the identity (docs/method.md §2). `decay=None` keeps the cumulative mean over all
queries seen; a decay in (0, 1) keeps an exponential moving average over update calls instead. A
calibration run can seed S with `load`.

S is kept in the post-RoPE space, where queries meet keys. For keys stored before RoPE (rotated at read by
their own position p), a logit is q·R_p k = (R_pᵀ q)·k, so the sensitivity of a pre-RoPE key at p is
R_pᵀ S R_p: `rope_conjugate` averages it over a span's positions.

With 3-D RoPE the Queries' statistics also depend on *when* they are asked: a query at frame f turns its temporal
pairs by f. `anchored` keeps, beside S, the second moment of the same queries moved back to frame 0 (each chunk's
queries by their chunk's first frame, `FrameShift`), from which the cache re-aims S at the frames that will read a
span (`QueryHistory.aimed`).
"""
from __future__ import annotations

import torch


class QueryStats:
    """S for one layer: (H, D, D), accumulated in float64 from queries (B, H, N, D)."""

    def __init__(self, n_heads: int, head_dim: int, decay: float | None = None, device=None):
        if decay is not None and not 0 < decay < 1:
            raise ValueError(f"decay must be None (cumulative mean) or in (0, 1), got {decay}")
        self.n_heads, self.head_dim, self.decay = n_heads, head_dim, decay
        self.second = torch.zeros(n_heads, head_dim, head_dim, dtype=torch.float64, device=device)
        self.count = 0
        self.anchored: torch.Tensor | None = None  # the same queries moved to frame 0; None once any came without
        self.anchorable = True

    def update(self, q: torch.Tensor, anchor: torch.Tensor | None = None) -> None:
        """Add queries q (B, H, N, D) (already in the stored keys' space); `anchor`: M (D, D) with q M the same
        queries moved to frame 0, whose moment is Mᵀ (q's moment) M (without it, this accumulator keeps no anchored
        moment from now on)."""
        if q.dim() != 4 or q.shape[1] != self.n_heads or q.shape[3] != self.head_dim:
            raise ValueError(f"queries must be (B, {self.n_heads}, N, {self.head_dim}), got {tuple(q.shape)}")
        n = q.shape[0] * q.shape[2]
        if n == 0:
            return
        if self.second.device != q.device:  # S lives where the queries are (a GPU: no host copy per call)
            self.second = self.second.to(q.device)
            self.anchored = None if self.anchored is None else self.anchored.to(q.device)
        batch = self._moment(q)
        self.second = self._fold(self.second, batch, n)
        if anchor is None or not self.anchorable:
            self.anchorable, self.anchored = False, None
        else:
            M = anchor.to(batch)
            self.anchored = self._fold(self.anchored, M.T @ batch @ M, n)
        self.count += n

    @staticmethod
    def _moment(q: torch.Tensor) -> torch.Tensor:
        qd = q.detach().to(torch.float64)
        return torch.einsum("bhnd,bhne->hde", qd, qd) / (q.shape[0] * q.shape[2])  # (H, D, D) mean over the call

    def _fold(self, old: torch.Tensor | None, batch: torch.Tensor, n: int) -> torch.Tensor:
        """The running moment after `n` more queries whose mean moment is `batch` (cumulative or decayed)."""
        if self.count == 0 or old is None:
            return batch
        if self.decay is None:
            return old + (batch - old) * (n / (self.count + n))
        return self.decay * old + (1 - self.decay) * batch

    def merge(self, other: QueryStats) -> None:
        """Fold another accumulator's queries in (a chunk's, once the cache lets them count)."""
        if other.count == 0:
            return
        if not other.anchorable or other.anchored is None:
            self.anchorable, self.anchored = False, None
        elif self.anchorable:
            self.anchored = self._fold(self.anchored, other.anchored.to(self.second.device), other.count)
        if self.count == 0:
            self.second, self.count = other.second.clone(), other.count
            return
        self.second = self._fold(self.second, other.second.to(self.second.device), other.count)
        self.count += other.count

    def load(self, second: torch.Tensor, count: int = 1) -> None:
        """Seed S from a calibration run: second (H, D, D)."""
        if second.shape != self.second.shape:
            raise ValueError(f"calibration statistics must be {tuple(self.second.shape)}, got {tuple(second.shape)}")
        self.second, self.count = second.to(self.second).clone(), int(count)
        self.anchorable, self.anchored = False, None  # a seed has no frames to move back

    def matrix(self) -> torch.Tensor:
        """S (H, D, D) float32; the identity before any query."""
        if self.count == 0:
            return torch.eye(self.head_dim, device=self.second.device).expand(self.n_heads, -1, -1).clone()
        return self.second.float()


def rope_conjugate(stats: torch.Tensor, rope, positions: torch.Tensor, samples: int = 32) -> torch.Tensor:
    """mean over p of R_pᵀ S R_p: S (H, D, D) in post-RoPE space -> the pre-RoPE space of keys at `positions`.

    `rope(x, positions, inverse)` rotates x (B, H, N, D) token-wise. With S = L Lᵀ, R_pᵀ S R_p = (R_pᵀ L)(R_pᵀ L)ᵀ,
    so L's columns are rotated back by p. At most `samples` evenly spaced positions of the span are averaged.
    """
    H, D, _ = stats.shape
    pos = positions.long().flatten()
    if len(pos) > samples:
        pos = pos[torch.linspace(0, len(pos) - 1, samples, device=pos.device).round().long()]
    ev, vec = torch.linalg.eigh(stats.double())
    cols = (vec * ev.clamp_min(0).sqrt()[:, None, :]).transpose(1, 2).float()  # (H, D, D): row j = column j of L
    x = cols.repeat(1, len(pos), 1)[None]  # (1, H, n*D, D)
    rot = rope(x, pos.repeat_interleave(D), inverse=True)[0].double().reshape(H, len(pos), D, D)
    return torch.einsum("hpjd,hpje->hde", rot, rot).div(len(pos)).float()
