"""Seeded random rotations of R^d: TurboQuant's transform (arXiv 2504.19874), regenerated from a seed.

* d a power of two: a randomized Hadamard transform, R = H_d · diag(s) / √d, with s ∈ {±1}^d random signs and
  H_d the Sylvester-Hadamard matrix (entries ±1, H_d H_d = d I): y = R x flips signs, then mixes every
  coordinate into every other.
* any other d: a random orthogonal matrix, the Q of the QR factorisation of a d x d standard Gaussian with the
  signs of R's diagonal folded into Q (Haar-distributed; Mezzadri 2007).

Both are drawn with a CPU `torch.Generator` seeded by `seed`, so the same (seed, d) gives the same rotation on
every machine and device, and a decoder that knows the seed rebuilds the rotation without storing it. The
matrix is built once per (seed, d) and cached (at most 64). Rows of R are applied as y = x @ Rᵀ; the inverse is
x = y @ R.
"""
from __future__ import annotations

import functools

import torch


def is_power_of_two(d: int) -> bool:
    return d > 0 and d & (d - 1) == 0


def hadamard(d: int) -> torch.Tensor:
    """The d x d Sylvester-Hadamard matrix (float32, entries ±1), d a power of two."""
    if not is_power_of_two(d):
        raise ValueError(f"a Sylvester-Hadamard matrix needs a power-of-two size, got {d}")
    h = torch.ones(1, 1, device="cpu")
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)  # (n, n) -> (2n, 2n)
    return h


@functools.lru_cache(maxsize=64)
def random_rotation(d: int, seed: int) -> torch.Tensor:
    """The seeded rotation R (d, d) float32 on the CPU (see the module): orthogonal, R Rᵀ = I."""
    if d < 1:
        raise ValueError(f"a rotation needs a positive dimension, got {d}")
    g = torch.Generator().manual_seed(seed)
    if is_power_of_two(d):
        signs = torch.randint(0, 2, (d,), generator=g, device="cpu").float() * 2 - 1
        return hadamard(d) * signs / d ** 0.5  # H diag(s) / √d: column j scaled by s_j
    q, r = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64, device="cpu"))
    return (q * torch.sign(torch.diagonal(r))).float()
