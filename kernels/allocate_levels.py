"""The allocator's bit assignment in one launch: the twin of quantwm.core.allocate.allocate_levels_ref (QuantWM's
reverse water-filling over a span's channels, docs/method.md §2.6).

One program per stream holds its (channels x levels) weighted error table in registers: 60 bisection steps of the
Lagrangian θ (each channel takes argmin_l w + θ·cost(l); the cheapest θ whose levels fit the stream's bits), then
the greedy fill (the upgrade with the largest error drop per extra bit that still fits, until none does), exactly
as the reference does them: IEEE division and square root, no fused multiply-add (the launch turns fp fusion off),
first index on ties, sums of costs in fp64 (whole numbers: exact).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BISECTION_STEPS = 60


@triton.jit
def _allocate_levels_kernel(w_ptr, cost_ptr, avail_ptr, out_ptr, D, L,
                            STEPS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr):
    s = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    lv = tl.arange(0, BLOCK_L)
    on = (d[:, None] < D) & (lv[None, :] < L)
    w = tl.load(w_ptr + (s * D + d[:, None]).to(tl.int64) * L + lv[None, :], mask=on, other=float("inf"))
    cost = tl.load(cost_ptr + lv, mask=lv < L, other=0.0)  # fp32
    cost64 = cost.to(tl.float64)
    avail = tl.load(avail_ptr + s).to(tl.float64)
    top = tl.maximum(tl.max(tl.max(tl.where(on, w, float("-inf")), axis=1), axis=0), 1e-30)
    cheapest = tl.min(tl.where((lv >= 1) & (lv < L), cost, float("inf")), axis=0)
    hi = top / cheapest * 4 + 1  # θ at which every channel of the stream takes 0 bits
    lo = hi * 1e-12
    for _ in range(STEPS):  # bisection in log space: the cheapest θ that fits
        mid = tl.sqrt_rn(lo * hi)
        pick = tl.argmin(w + mid * cost[None, :], axis=1, tie_break_left=True)
        spent = tl.sum(tl.sum(tl.where((lv[None, :] == pick[:, None]) & on, cost64[None, :], 0.0), axis=1), axis=0)
        fits = spent <= avail
        hi, lo = tl.where(fits, mid, hi), tl.where(fits, lo, mid)
    levels = tl.argmin(w + hi * cost[None, :], axis=1, tie_break_left=True)  # (BLOCK_D,)
    go = tl.full((), 1, tl.int32)
    steps = tl.full((), 0, tl.int32)
    while (go + (steps < 4 * D).to(tl.int32)) == 2:  # greedy fill: one upgrade a step, the best gain per bit that fits
        chosen = (lv[None, :] == levels[:, None]) & on
        left = avail - tl.sum(tl.sum(tl.where(chosen, cost64[None, :], 0.0), axis=1), axis=0)
        cur_w = tl.sum(tl.where(chosen, w, 0.0), axis=1)
        cur_c = tl.sum(tl.where(chosen, cost, 0.0), axis=1)
        extra = cost[None, :] - cur_c[:, None]
        gain = tl.math.div_rn(cur_w[:, None] - tl.where(on, w, 0.0), tl.maximum(extra, 1e-9))  # padding: no inf - inf
        ok = (extra > 0) & (extra.to(tl.float64) <= left) & (gain > 0) & on
        gain = tl.where(ok, gain, -1.0)
        best = tl.argmax(tl.reshape(gain, (BLOCK_D * BLOCK_L,)), axis=0, tie_break_left=True)
        go = (tl.max(tl.reshape(gain, (BLOCK_D * BLOCK_L,)), axis=0) > 0).to(tl.int32)
        ch = tl.where(go > 0, best // BLOCK_L, -1)  # no channel when nothing pays
        levels = tl.where(d == ch, best % BLOCK_L, levels)
        steps += 1
    tl.store(out_ptr + s * D + d, levels.to(tl.int64), mask=d < D)


def allocate_levels(weighted: torch.Tensor, cost: torch.Tensor, available: torch.Tensor) -> torch.Tensor:
    """weighted (S, D, L) float32, cost (L,) float32 with cost[0] = 0, available (S,) bits -> levels (S, D) int64."""
    if weighted.dim() != 3 or cost.shape != weighted.shape[2:] or available.shape != weighted.shape[:1]:
        raise ValueError(f"expected weighted (S, D, L), cost (L,), available (S,), got {tuple(weighted.shape)}, "
                         f"{tuple(cost.shape)}, {tuple(available.shape)}")
    S, D, L = weighted.shape
    out = torch.zeros(S, D, dtype=torch.int64, device=weighted.device)
    if S and D:
        BLOCK_D, BLOCK_L = max(16, triton.next_power_of_2(D)), max(16, triton.next_power_of_2(L))
        _allocate_levels_kernel[(S,)](weighted.float().contiguous(), cost.float().contiguous(),
                                      available.float().contiguous(), out, D, L,
                                      STEPS=BISECTION_STEPS, BLOCK_D=BLOCK_D, BLOCK_L=BLOCK_L, enable_fp_fusion=False)
    return out
