"""3-D rotary position embedding over (time, row, column), Wan-style.

Token position p of a video whose frames are h x w tokens maps to (t, row, col) = (p // (h*w),
(p % (h*w)) // w, p % w). The head dim D is split like Wan 2.1's: D - 4*(D//6) channels rotate with t,
2*(D//6) with the row and 2*(D//6) with the column; channel pairs (2i, 2i+1) rotate together (interleaved,
as `torch.view_as_complex` on (..., D/2, 2)).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


def token_coords(positions: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """Absolute token positions (N,) -> (N, 3) long (frame, row, col)."""
    h, w = grid
    p = positions.long()
    return torch.stack([p // (h * w), (p % (h * w)) // w, p % w], -1)


def rope_angles(coords: torch.Tensor, head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """Token coords (..., L, 3) = (frame, row, col) -> rotation angle of every channel pair (..., L, head_dim/2)."""
    if head_dim % 2 or head_dim < 6:
        raise ValueError(f"head_dim must be even and >= 6 for 3-D RoPE, got {head_dim}")
    d_hw = 2 * (head_dim // 6)
    parts = []
    for i, d in enumerate((head_dim - 2 * d_hw, d_hw, d_hw)):  # channels for (t, row, col)
        freqs = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=coords.device) / d)
        parts.append(coords[..., i:i + 1].double() * freqs)
    return torch.cat(parts, -1)


def apply_rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (2i, 2i+1) of x (B, H, L, D) by angles (L, D/2) or (B, L, D/2)."""
    if angles.dim() == 3:
        angles = angles[:, None]
    cos, sin = angles.cos().float(), angles.sin().float()
    xp = x.float().reshape(*x.shape[:-1], -1, 2)
    a, b = xp[..., 0], xp[..., 1]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).reshape(x.shape).to(x.dtype)


class Rope3D:
    """rope(x, positions, inverse=False): rotate x (B, H, N, D) by the 3-D positions of its tokens."""

    def __init__(self, head_dim: int, grid: tuple[int, int], theta: float = 10000.0):
        rope_angles(torch.zeros(1, 3, device="cpu"), head_dim, theta)  # validates head_dim
        self.grid, self.head_dim, self.theta = grid, head_dim, theta
        d_hw = 2 * (head_dim // 6)
        self.split = (head_dim - 2 * d_hw, d_hw, d_hw)  # channels for (t, row, col)

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """(N,) -> (N, D/2) rotation angle of every channel pair, on the positions' device."""
        return rope_angles(token_coords(positions, self.grid), self.head_dim, self.theta)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        ang = self.angles(positions.to(x.device))  # host positions are copied over, never read back
        return apply_rope(x, -ang if inverse else ang)


@dataclass(frozen=True)
class FrameShift:
    """Moves post-RoPE vectors by whole frames: 3-D RoPE's temporal pairs turned, its row and column pairs left
    as they are (a vector at (frame, row, col) goes to (frame + f, row, col)). What re-aims the history Queries'
    statistics at the frames that will read a span (quantwm/core/query_history.py)."""

    head_dim: int
    tokens_per_frame: int
    theta: float = 10000.0

    def __post_init__(self):
        rope_angles(torch.zeros(1, 3, device="cpu"), self.head_dim, self.theta)  # validates head_dim
        if self.tokens_per_frame < 1:
            raise ValueError(f"tokens_per_frame must be >= 1, got {self.tokens_per_frame}")

    def frames(self, tokens: int) -> int | None:
        """`tokens` as whole frames, None when it is not a whole number of them."""
        return None if tokens % self.tokens_per_frame else tokens // self.tokens_per_frame

    def matrix(self, frames: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """M (D, D) float64 on `device` with x M = x moved forward by `frames` frames, for row vectors x (built there,
        nothing copied from the host; kept per `frames` and device: one per chunk start; callers must not modify
        it)."""
        return _frame_matrix(self.head_dim, self.theta, frames, torch.device(device))


# kept for the frame counts of the chunks near the one being written (its anchor and aims): a long rollout asks
# for new ones every chunk, and 256 of them held 8 MiB
@functools.lru_cache(maxsize=16)
def _frame_matrix(head_dim: int, theta: float, frames: int, device: torch.device) -> torch.Tensor:
    coords = torch.zeros(1, 3, dtype=torch.long, device=device)
    coords[0, 0] = frames  # a fill on the device, no copy of host data
    angles = rope_angles(coords, head_dim, theta)  # (1, D/2)
    cos, sin = angles[0].cos(), angles[0].sin()
    M = torch.zeros(head_dim, head_dim, dtype=torch.float64, device=device)
    i = torch.arange(0, head_dim, 2, device=device)
    M[i, i], M[i, i + 1], M[i + 1, i], M[i + 1, i + 1] = cos, sin, -sin, cos
    return M
