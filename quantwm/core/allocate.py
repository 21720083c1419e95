"""QuantWM's allocator: a mixed-precision, per-channel residual coder that spends a bits-per-element budget
where the attention logits (Keys) or the output (Values) feel it (docs/method.md §2.6).

After the span's centroids are subtracted, each channel i of a stream's residual r (N tokens) is coded on
its own uniform grid over the span with b_i bits (0 to 8; 0 stores nothing and decodes to the centroid). The
predicted error of a choice is

    Σ_i λ_i E_i(b_i),   E_i(b) = Σ_t (r_ti - Q_b(r_ti))²  measured on the span itself,

with λ_i = S_ii, the history Queries' energy along channel i, for Keys (quantization errors of different
channels are uncorrelated, so the logit error E[(q·e)²] = Σ_i S_ii e_i²), and λ_i = 1 for Values (the output
is a convex mix of value rows, every channel counted alike). Minimising it under the bit budget is reverse
water-filling: a channel whose λ_i·var_i is large gets many bits, one the Queries barely use gets 0 or 1.
The rule: a Lagrangian bisection (each channel takes argmin_b λ_i E_i(b) + θ·cost(b)), then a greedy fill of
what the bisection left. Each grid's clipping (its range shrunk by α ∈ CLIPS) is the α that minimises E_i(b).

Stored per stream: the bit table (one byte a channel), the grid's low end and step per channel (fp16, codes
are computed against the stored values) and the codes, channel after channel, packed: the `Channels` layout
(quantwm/core/layouts/channels.py). Nothing here looks at
quality beyond the span and the statistics the encoder already has.
"""
from __future__ import annotations

import math

import torch

from .layouts import Channels

LEVELS = tuple(range(9))  # bits a channel may take
CLIPS = (1.0, 0.85, 0.7, 0.55, 0.42, 0.32)  # range shrink factors tried per (channel, bits)
SAMPLE_TOKENS = 1024  # the error tables are measured on at most this many (evenly strided) tokens of a span


def _grid(r: torch.Tensor, bits: int, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(low, step) per (stream, channel) of a `bits` grid over r (S, N, D) with its range shrunk by alpha about
    the middle; both already rounded to their fp16 storage."""
    lo, hi = r.amin(1), r.amax(1)
    mid, half = (hi + lo) / 2, (hi - lo) / 2 * alpha
    low = (mid - half).half().float()
    step = torch.where(half > 0, 2 * half / (2 ** bits - 1), torch.ones_like(half)).half().float()
    return low, step.clamp_min(torch.finfo(torch.float16).tiny)


def _codes(r: torch.Tensor, low: torch.Tensor, step: torch.Tensor, bits: int) -> torch.Tensor:
    return torch.round((r - low[:, None]) / step[:, None]).clamp(0, 2 ** bits - 1)


def error_tables(r: torch.Tensor, levels: tuple[int, ...] = LEVELS) -> tuple[torch.Tensor, torch.Tensor]:
    """E (S, D, L): each channel's squared error at each level with its best clip, measured on a strided sample
    of at most SAMPLE_TOKENS tokens and scaled to the span; alpha (S, D, L) the clip chosen (1 at 0 bits). Both
    on the CPU, where the (small) allocation runs, whatever device r is on."""
    S, N, D = r.shape
    sample = r[:, :: max(1, math.ceil(N / SAMPLE_TOKENS))].float()
    scale = N / sample.shape[1]
    E = torch.empty(S, D, len(levels))
    A = torch.ones(S, D, len(levels))
    for j, b in enumerate(levels):
        if b == 0:
            E[..., j] = (sample.square().sum(1) * scale).cpu()
            continue
        best = None
        for a in CLIPS if b <= 4 else CLIPS[:2]:
            low, step = _grid(sample, b, a)
            e = (sample - (low[:, None] + _codes(sample, low, step, b) * step[:, None])).square().sum(1) * scale
            if best is None:
                best, alpha = e, torch.full_like(e, a)
            else:
                alpha = torch.where(e < best, a, alpha)
                best = torch.minimum(best, e)
        E[..., j], A[..., j] = best.cpu(), alpha.cpu()
    return E, A


def allocate(weighted: torch.Tensor, cost: torch.Tensor, available: torch.Tensor) -> torch.Tensor:
    """Level index per (stream, channel) minimising Σ weighted[s, i, level] subject to Σ cost[level] <=
    available[s]: weighted (S, D, L), cost (L,) bits with cost[0] = 0, available (S,) bits. Deterministic."""
    S, D, L = weighted.shape
    cost = cost.to(weighted)

    def pick(theta: torch.Tensor) -> torch.Tensor:
        return (weighted + theta[:, None, None] * cost).argmin(-1)

    def spent(levels: torch.Tensor) -> torch.Tensor:
        return cost[levels].sum(-1)

    # θ large enough that every channel takes 0 bits; bisect (in log space) for the cheapest θ that fits.
    hi = torch.full((S,), float(weighted.amax().clamp_min(1e-30) / cost[1:].min() * 4 + 1))
    lo = torch.full((S,), float(hi.min()) * 1e-12)
    for _ in range(60):
        mid = (lo * hi).sqrt()
        fits = spent(pick(mid)) <= available
        hi, lo = torch.where(fits, mid, hi), torch.where(fits, lo, mid)
    levels = pick(hi)
    # Greedy fill: the upgrade with the largest error drop per extra bit that still fits, until none does.
    rows = torch.arange(S)
    for _ in range(4 * D):
        left = available - spent(levels)
        cur_w = torch.gather(weighted, 2, levels[..., None])  # (S, D, 1)
        extra = cost[None, None, :] - cost[levels][..., None]  # (S, D, L)
        gain = (cur_w - weighted) / extra.clamp_min(1e-9)
        ok = (extra > 0) & (extra <= left[:, None, None]) & (gain > 0)
        gain = torch.where(ok, gain, torch.full_like(gain, -1.0))
        best = gain.reshape(S, -1).argmax(-1)
        go = gain.reshape(S, -1)[rows, best] > 0
        if not go.any():
            break
        ch, lv = best // L, best % L
        levels[rows[go], ch[go]] = lv[go]
    return levels


def encode_channels(r: torch.Tensor, bits: torch.Tensor, alpha: torch.Tensor) -> Channels:
    """Code r (S, N, D) with bits (S, D) per channel and clips alpha (S, D) (chosen on the CPU by `allocate`,
    coded where r lives): the span's `Channels` layout."""
    S, N, D = r.shape
    bits, alpha = bits.to(r.device), alpha.to(r.device)
    low = torch.zeros(S, D, device=r.device)
    step = torch.ones(S, D, device=r.device)
    for b in sorted(set(bits.unique().tolist()) - {0}):
        m = bits == b
        for a in sorted(set(alpha[m].tolist())):
            sel = m & (alpha == a)
            lo_b, st_b = _grid(r.float(), b, a)
            low, step = torch.where(sel, lo_b, low), torch.where(sel, st_b, step)
    codes = torch.round((r.float() - low[:, None]) / step[:, None]).long()  # (S, N, D), clamped per width by `pack`
    return Channels.pack(codes, bits, low, step)
