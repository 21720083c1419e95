"""What a trellis code would buy over QuantWM's uniform grids: 8-state trellis-coded quantization (TCQ; Marcellin &
Fischer 1990) against the best uniform scalar grid, on unit Gaussian samples, at 1-3 bits per sample (issue 44).

The trellis is a feed-forward shift register, so that a reader decodes sample t from the branch bits of samples
t-3..t alone (no scan over the sequence: the fused kernel could read it as it reads a grid code). Per sample: one
branch bit u_t and R - 1 index bits. The union codebook holds 2^(R+1) evenly spaced levels, split into four
subsets D_j (level i is in D_(i mod 4)); the subset of sample t is j = c0 + 2 c1 with c0 the XOR of the state bits
`taps[0]` and c1 = u_t XOR the state bits `taps[1]` (state bit i is u_(t-1-i)). So each state offers two subsets
of one superset (D0/D2 or D1/D3), as set partitioning wants. The encoder is the Viterbi search (one step per
sample, every sequence and state at once). The taps and the step are chosen on one sample set (seed 1) and the
gain is reported on another (seed 2).

    python benchmarks/trellis_gain.py [--sequences 64] [--length 1728]

Measured (64 sequences of 1728 samples): R=1 +0.77 dB, R=2 +1.08 dB, R=3 +1.08 dB over the best uniform grid,
i.e. 0.13-0.18 bit per coded coordinate at equal rate (the Gaussian bound is another 0.8-2.6 dB away).
"""
from __future__ import annotations

import argparse
import itertools
import math

import torch

STATES = 8
TAP_CHOICES = [(0,), (1,), (2,), (0, 1), (0, 2), (1, 2)]
UNIFORM_STEP = {1: 1.596, 2: 0.996, 3: 0.586}  # the best uniform grid's step for N(0, 1) (Max 1960), the search's scale


def uniform_mse(x: torch.Tensor, bits: int) -> float:
    """The least mean squared error of a symmetric uniform 2^bits-level grid over x, by a search over its step."""
    L = 2 ** bits
    steps = torch.linspace(0.5, 1.5, 101, dtype=x.dtype) * UNIFORM_STEP[bits]  # (K,)
    levels = (torch.arange(L, dtype=x.dtype) - (L - 1) / 2)[None] * steps[:, None]  # (K, L)
    err = (x.reshape(-1)[None, :, None] - levels[:, None]).square().amin(-1).mean(-1)  # (K,)
    return err.min().item()


def trellis(taps: tuple[tuple[int, ...], tuple[int, ...]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(subset label (STATES, 2), predecessors (STATES, 2), branch bit (STATES,)) of the shift-register trellis: the
    state after u_t is (u_t, u_(t-1), u_(t-2)); a state's two predecessors differ in their oldest bit."""
    label = torch.zeros(STATES, 2, dtype=torch.long)
    for s, u in itertools.product(range(STATES), range(2)):
        bit = [(s >> i) & 1 for i in range(3)]
        label[s, u] = sum(bit[i] for i in taps[0]) % 2 + 2 * ((u + sum(bit[i] for i in taps[1])) % 2)
    preds = torch.tensor([[(s >> 1) | (b << 2) for b in range(2)] for s in range(STATES)])
    return label, preds, torch.arange(STATES) & 1


def tcq_mse(x: torch.Tensor, bits: int, step: float, taps) -> float:
    """Mean squared error of the Viterbi-optimal path through the trellis for every sequence of x (M, N)."""
    L = 2 ** (bits + 1)
    levels = (torch.arange(L, dtype=x.dtype) - (L - 1) / 2) * step
    err = torch.stack([(x[..., None] - levels[j::4]).square().amin(-1) for j in range(4)], -1)  # (M, N, 4)
    label, preds, branch = trellis(taps)
    step_label = label[preds, branch[:, None].expand(STATES, 2)]  # (STATES, 2): the subset entering each state
    cost = torch.full((x.shape[0], STATES), math.inf, dtype=x.dtype)
    cost[:, 0] = 0  # the register starts at zero
    for t in range(x.shape[1]):  # the Viterbi recursion: one step per sample, all sequences and states at once
        cost = (cost[:, preds] + err[:, t][:, step_label]).amin(-1)
    return (cost.amin(-1) / x.shape[1]).mean().item()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--length", type=int, default=1728)
    a = ap.parse_args(argv)
    tune = torch.randn(16, 400, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    test = torch.randn(a.sequences, a.length, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    print("| bits | uniform MSE | TCQ MSE | gain dB | gain bit | Gaussian D(R) |\n|---|---|---|---|---|---|")
    for bits in (1, 2, 3):
        grid = [(tcq_mse(tune, bits, s * UNIFORM_STEP[bits], (t0, t1)), s, (t0, t1))
                for t0 in TAP_CHOICES for t1 in [(), *TAP_CHOICES] for s in (0.45, 0.5, 0.55, 0.6, 0.65, 0.7)]
        _, scale, taps = min(grid)
        u, t = uniform_mse(test, bits), tcq_mse(test, bits, scale * UNIFORM_STEP[bits], taps)
        print(f"| {bits} | {u:.5f} | {t:.5f} | {10 * math.log10(u / t):+.2f} | {math.log2(u / t) / 2:+.3f} | "
              f"{2.0 ** (-2 * bits):.5f} |")


if __name__ == "__main__":
    main()
