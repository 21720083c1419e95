"""3-D rotary position embedding over (time, row, column), Wan-style.

Token position p of a video whose frames are h x w tokens maps to (t, row, col) = (p // (h*w),
(p % (h*w)) // w, p % w). The head dim D is split like Wan 2.1's: D - 4*(D//6) channels rotate with t,
2*(D//6) with the row and 2*(D//6) with the column; channel pairs (2i, 2i+1) rotate together (interleaved,
as `torch.view_as_complex` on (..., D/2, 2)).
"""
from __future__ import annotations

import torch


def token_coords(positions: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """Absolute token positions (N,) -> (N, 3) long (frame, row, col)."""
    h, w = grid
    p = positions.long()
    return torch.stack([p // (h * w), (p % (h * w)) // w, p % w], -1)


class Rope3D:
    """rope(x, positions, inverse=False): rotate x (B, H, N, D) by the 3-D positions of its tokens."""

    def __init__(self, head_dim: int, grid: tuple[int, int], theta: float = 10000.0):
        if head_dim % 2 or head_dim < 6:
            raise ValueError(f"head_dim must be even and >= 6 for 3-D RoPE, got {head_dim}")
        self.grid = grid
        d_hw = 2 * (head_dim // 6)
        self.split = (head_dim - 2 * d_hw, d_hw, d_hw)  # channels for (t, row, col)
        self.freqs = [1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d) for d in self.split]

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """(N,) -> (N, D/2) rotation angle of every channel pair."""
        coords = token_coords(positions.cpu(), self.grid).double()
        return torch.cat([coords[:, i:i + 1] * f[None] for i, f in enumerate(self.freqs)], -1)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        ang = self.angles(positions).to(x.device)
        if inverse:
            ang = -ang
        cos, sin = ang.cos().float(), ang.sin().float()
        xp = x.float().reshape(*x.shape[:-1], -1, 2)
        a, b = xp[..., 0], xp[..., 1]
        out = torch.stack([a * cos - b * sin, a * sin + b * cos], -1)
        return out.reshape(x.shape).to(x.dtype)
