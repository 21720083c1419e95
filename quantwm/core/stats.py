"""Running history-Query statistics: S = E[q qᵀ] per (layer, head), the input of QSAC and PSAC.

Before any query is seen S is the identity (SPEC.md §2). `decay=None` keeps the cumulative mean over all
queries seen; a decay in (0, 1) keeps an exponential moving average over update calls instead. A
calibration run can seed S with `load`.
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

    def update(self, q: torch.Tensor) -> None:
        """Add queries q (B, H, N, D) (already in the stored keys' space)."""
        if q.dim() != 4 or q.shape[1] != self.n_heads or q.shape[3] != self.head_dim:
            raise ValueError(f"queries must be (B, {self.n_heads}, N, {self.head_dim}), got {tuple(q.shape)}")
        n = q.shape[0] * q.shape[2]
        if n == 0:
            return
        qd = q.detach().to(self.second.device, torch.float64)
        batch = torch.einsum("bhnd,bhne->hde", qd, qd) / n  # (H, D, D) mean over this call's queries
        if self.count == 0:
            self.second = batch
        elif self.decay is None:
            self.second += (batch - self.second) * (n / (self.count + n))
        else:
            self.second = self.decay * self.second + (1 - self.decay) * batch
        self.count += n

    def load(self, second: torch.Tensor, count: int = 1) -> None:
        """Seed S from a calibration run: second (H, D, D)."""
        if second.shape != self.second.shape:
            raise ValueError(f"calibration statistics must be {tuple(self.second.shape)}, got {tuple(second.shape)}")
        self.second, self.count = second.to(self.second).clone(), int(count)

    def matrix(self) -> torch.Tensor:
        """S (H, D, D) float32; the identity before any query."""
        if self.count == 0:
            return torch.eye(self.head_dim, device=self.second.device).expand(self.n_heads, -1, -1).clone()
        return self.second.float()
