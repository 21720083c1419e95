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
what the bisection left; on a GPU one Triton launch (kernels/allocate_levels.py), with nothing read back. Each grid's clipping (its range shrunk by α ∈ CLIPS) is the α that minimises E_i(b).

Stored per stream: the bit table (one byte a channel), the grid's low end and step per channel (fp16, codes
are computed against the stored values) and the codes, channel after channel, packed: the `Channels` layout
(quantwm/core/layouts/channels.py). Nothing here looks at
quality beyond the span and the statistics the encoder already has.
"""
from __future__ import annotations

import math

import torch

from .backend import kernel, use_kernels
from .layouts import Channels

LEVELS = tuple(range(9))  # bits a channel may take
CLIPS = (1.0, 0.85, 0.7, 0.55, 0.42, 0.32)  # range shrink factors tried per (channel, bits)
WIDE_CLIPS = 2  # above 4 bits only the first two clips are tried
SAMPLE_TOKENS = 1024  # the error tables are measured on at most this many (evenly strided) tokens of a span
BISECTION_STEPS = 60  # of the Lagrangian θ (kernels/allocate_levels.py holds the same number)
TILE_ELEMENTS = 1 << 26  # the error tables evaluate at most this many (candidate, token, channel) values at once


def _grid(lo: torch.Tensor, hi: torch.Tensor, bits: torch.Tensor, alpha: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(low, step) of a `bits` grid over [lo, hi] with its range shrunk by alpha about the middle, both already
    rounded to their fp16 storage; every argument broadcasts (e.g. lo (S, D), bits and alpha (C, 1, 1))."""
    mid, half = (hi + lo) / 2, (hi - lo) / 2 * alpha
    low = (mid - half).half().float()
    step = torch.where(half > 0, 2 * half / (2.0 ** bits - 1), 1.0).half().float()
    return low, step.clamp_min(torch.finfo(torch.float16).tiny)


def _clip_table(levels: tuple[int, ...]) -> list[tuple[int, float]]:
    """The (level index, clip) candidates of the coded levels (b > 0), level by level, clips in CLIPS order."""
    return [(j, a) for j, b in enumerate(levels) if b > 0 for a in (CLIPS if b <= 4 else CLIPS[:WIDE_CLIPS])]


def channel_errors_ref(sample: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, qmax: torch.Tensor,
                       alpha: torch.Tensor, scale: float) -> torch.Tensor:
    """sample (S, n, D), lo/hi (S, D) its per-channel range, qmax/alpha (C,) each candidate's top code 2^b − 1 and
    clip -> (C, S, D): Σ_t (x − Q(x))² per channel on the candidate's grid, times `scale` (kernels/channel_errors.py
    on the fast path). Candidates in tiles of at most TILE_ELEMENTS values."""
    errors = []
    tile = max(1, TILE_ELEMENTS // max(sample.numel(), 1))
    for at in range(0, qmax.shape[0], tile):  # one pass at the shapes QuantWM meets
        top = qmax[at:at + tile, None, None]  # (C, 1, 1)
        low, step = _grid(lo, hi, torch.log2(top + 1), alpha[at:at + tile, None, None])  # (C, S, D)
        codes = torch.round((sample - low[:, :, None]) / step[:, :, None]).clamp_(min=0).minimum(top[..., None])
        errors.append((sample - (low[:, :, None] + codes * step[:, :, None])).square().sum(2) * scale)
    return torch.cat(errors)


def channel_errors(sample: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, qmax: torch.Tensor,
                   alpha: torch.Tensor, scale: float) -> torch.Tensor:
    """`channel_errors_ref`, by kernels/channel_errors.py on the fast path (one launch for every candidate)."""
    if use_kernels(sample):
        return kernel("channel_errors")(sample, lo, hi, qmax, alpha, scale)
    return channel_errors_ref(sample, lo, hi, qmax, alpha, scale)


def error_tables(r: torch.Tensor, levels: tuple[int, ...] = LEVELS) -> tuple[torch.Tensor, torch.Tensor]:
    """E (S, D, L): each channel's squared error at each level with its best clip, measured on a strided sample
    of at most SAMPLE_TOKENS tokens and scaled to the span; alpha (S, D, L) the clip chosen (1 at 0 bits, the
    first of equal clips). On r's device, every (level, clip) candidate at once (`channel_errors`)."""
    S, N, D = r.shape
    sample = r[:, :: max(1, math.ceil(N / SAMPLE_TOKENS))].float()  # (S, n, D)
    scale = N / sample.shape[1]
    table = _clip_table(levels)
    lo, hi = sample.amin(1), sample.amax(1)  # (S, D)
    qmax = sample.new_tensor([2.0 ** levels[j] - 1 for j, _ in table])
    errors = channel_errors(sample, lo, hi, qmax, sample.new_tensor([a for _, a in table]), scale) if table else None
    E = sample.new_empty(len(levels), S, D)
    A = sample.new_ones(len(levels), S, D)
    if 0 in levels:
        E[levels.index(0)] = sample.square().sum(1) * scale
    at = 0
    for n_clips in (len(CLIPS), WIDE_CLIPS):  # levels with six clips, then levels with two: (levels, clips, S, D)
        rows = [j for j, b in enumerate(levels) if b > 0 and (b <= 4) == (n_clips == len(CLIPS))]
        if not rows:
            continue
        block = errors[at:at + len(rows) * n_clips].reshape(len(rows), n_clips, S, D)
        at += len(rows) * n_clips
        best, pick = block.min(1)  # the first of equal clips, as a strict `<` scan would take
        E[rows[0]:rows[-1] + 1], A[rows[0]:rows[-1] + 1] = best, sample.new_tensor(CLIPS[:n_clips])[pick]
    return E.permute(1, 2, 0), A.permute(1, 2, 0)


def allocate(weighted: torch.Tensor, cost: torch.Tensor, available: torch.Tensor) -> torch.Tensor:
    """Level index per (stream, channel) minimising Σ weighted[s, i, level] subject to Σ cost[level] <=
    available[s]: weighted (S, D, L), cost (L,) bits with cost[0] = 0, available (S,) bits. Deterministic, on
    weighted's device: kernels/allocate_levels.py on the fast path (one launch, nothing read back), else
    `allocate_levels_ref`."""
    cost = cost.to(weighted)
    top = weighted.amax().clamp_min(1e-30) / cost[1:].min() * 4 + 1  # θ at which every channel takes 0 bits
    if use_kernels(weighted):
        return kernel("allocate_levels")(weighted, cost, available, top)
    return allocate_levels_ref(weighted, cost, available, top)


def allocate_levels_ref(weighted: torch.Tensor, cost: torch.Tensor, available: torch.Tensor,
                        top: torch.Tensor) -> torch.Tensor:
    """The allocation rule (module docstring): BISECTION_STEPS bisection steps (in log space, from `top` down to
    1e-12 of it) for the cheapest Lagrangian θ whose levels argmin_l weighted + θ·cost(l) fit each stream's bits,
    then a greedy fill: the upgrade with the largest error drop per extra bit that still fits, one a step, until
    none does. Sums of costs in fp64 (whole numbers: exact). The fill reads whether any stream moved after each
    step: free on the CPU; on a GPU kernels/allocate_levels.py runs the same rule in one launch."""
    S, D, L = weighted.shape
    cost = cost.to(weighted)
    cost64, avail = cost.double(), available.to(weighted.device).double()

    def pick(theta: torch.Tensor) -> torch.Tensor:
        return (weighted + theta[:, None, None] * cost).argmin(-1)

    hi = top.to(weighted).expand(S).clone()
    lo = hi * 1e-12
    for _ in range(BISECTION_STEPS):
        mid = (lo * hi).sqrt()
        fits = cost64[pick(mid)].sum(-1) <= avail
        hi, lo = torch.where(fits, mid, hi), torch.where(fits, lo, mid)
    levels = pick(hi)
    channels = torch.arange(D, device=weighted.device)
    for _ in range(4 * D):
        left = avail - cost64[levels].sum(-1)
        extra = cost - cost[levels][..., None]  # (S, D, L)
        gain = (torch.gather(weighted, 2, levels[..., None]) - weighted) / extra.clamp_min(1e-9)
        ok = (extra > 0) & (extra.double() <= left[:, None, None]) & (gain > 0)
        gain = torch.where(ok, gain, -1.0).reshape(S, -1)
        best = gain.argmax(-1)
        go = gain.gather(1, best[:, None])[:, 0] > 0
        if not bool(go.any()):  # the reference's one host read a step
            break
        levels = torch.where(go[:, None] & (channels == (best // L)[:, None]), (best % L)[:, None], levels)
    return levels


def encode_channels(r: torch.Tensor, bits: torch.Tensor, alpha: torch.Tensor, capacity: int | None = None) -> Channels:
    """Code r (S, N, D) with bits (S, D) per channel and clips alpha (S, D): the span's `Channels` layout, on r's
    device in a fixed number of tensor ops. `capacity`: the code buffer's size in bytes when the caller bounds it
    (the allocator: its budget), else it is read from the widths (one host read)."""
    bits, alpha = bits.to(r.device).long(), alpha.to(r.device).float()
    rf = r.float()
    low, step = _grid(rf.amin(1), rf.amax(1), bits, alpha)
    coded = bits > 0
    low, step = torch.where(coded, low, 0.0), torch.where(coded, step, 1.0)
    codes = torch.round((rf - low[:, None]) / step[:, None]).long()  # (S, N, D), clamped per width by `pack`
    return Channels.pack(codes, bits, low, step, capacity)
