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
what the bisection left; on a GPU one Triton launch (kernels/allocate_levels.py), with nothing read back. Each
grid's clipping (its range shrunk by α ∈ CLIPS) is the α that minimises E_i(b).

Stored per stream: the bit table (one byte a channel), the grid's low end and step per channel (fp16, codes
are computed against the stored values) and the codes, channel after channel, packed: the `Channels` layout
(quantwm/core/layouts/channels.py). Nothing here looks at
quality beyond the span and the statistics the encoder already has.
"""
from __future__ import annotations

import functools
import math

import torch

from .backend import kernel, use_kernels
from .layouts import Channels
from .layouts.channels import channel_bytes, channel_grid
from .tables import on_device

LEVELS = tuple(range(9))  # bits a channel may take
CLIPS = (1.0, 0.85, 0.7, 0.55, 0.42, 0.32)  # range shrink factors tried per (channel, bits)
WIDE_CLIPS = 2  # above 4 bits only the first two clips are tried
SAMPLE_TOKENS = 1024  # the error tables are measured on at most this many (evenly strided) tokens of a span
BISECTION_STEPS = 60  # of the Lagrangian θ (kernels/allocate_levels.py holds the same number)
TILE_ELEMENTS = 1 << 26  # the error tables evaluate at most this many (candidate, token, channel) values at once


@functools.lru_cache(maxsize=64)
def _tables(levels: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(qmax (L,): 2^b − 1 of each level, CLIPS (6,)): host tables, copied to a device once (tables.on_device)."""
    return (torch.tensor([2.0 ** b - 1 for b in levels], device="cpu"), torch.tensor(CLIPS, device="cpu"))


@functools.lru_cache(maxsize=256)
def level_costs(n_tokens: int) -> torch.Tensor:
    """(len(LEVELS),) float32 on the host: the bits a channel of `n_tokens` codes stores at each level."""
    return torch.tensor([8.0 * channel_bytes(n_tokens, b) for b in LEVELS], device="cpu")


def channel_errors_ref(sample: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, qmax: torch.Tensor,
                       clips: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """sample (S, n, D), lo/hi (S, D) its per-channel range, qmax (L,) each width's top code 2^b − 1 (0: width 0),
    clips (6,) -> (E (L, S, D): each channel's least Σ_t (x − Q(x))² over the width's clips (six up to 4 bits, two
    above), times `scale`; A (L, S, D): the clip that gave it, the first of equal ones, 1 at width 0). The twin of
    kernels/channel_errors.py: the (width, clip) pairs tried at once (a clip a width does not try counts as
    infinite), in tiles of at most TILE_ELEMENTS values; on a GPU every pair, nothing read back to the host."""
    L, K = qmax.shape[0], clips.shape[0]
    n_tried = torch.where(qmax > 15, WIDE_CLIPS, K) * (qmax > 0)  # clips each width tries (none at width 0)
    tried = (torch.arange(K, device=sample.device) < n_tried[:, None]).flatten()  # (L·K,), width-major
    # on the host only the pairs tried are measured (41% fewer at LEVELS; the index is read there at no cost);
    # on a GPU this runs only where the kernel cannot, and measures every pair rather than read the index back
    pairs = tried.nonzero().squeeze(1) if sample.device.type == "cpu" else None
    top = qmax[:, None].expand(L, K).reshape(-1, 1, 1)  # (L·K, 1, 1)
    alpha = clips[None, :].expand(L, K).reshape(-1, 1, 1)
    if pairs is not None:
        top, alpha = top[pairs], alpha[pairs]
    errors = []
    tile = max(1, TILE_ELEMENTS // max(sample.numel(), 1))
    for at in range(0, top.shape[0], tile):  # one pass at the shapes QuantWM meets
        t, a = top[at:at + tile], alpha[at:at + tile]
        low, step = channel_grid(lo, hi, torch.log2(t + 1), a)  # (C, S, D)
        low, step = low[:, :, None], step[:, :, None]
        # in place on one (C, S, n, D) buffer: x − (low + round((x − low) / step) clamped · step), the same
        # operations in the same order as kernels/channel_errors.py (a + b is b + a, bit for bit)
        x = torch.sub(sample, low).div_(step).round_().clamp_(min=0)
        x = torch.minimum(x, t[..., None], out=x).mul_(step).add_(low)
        errors.append(torch.sub(sample, x, out=x).square_().sum(2) * scale)
    measured = torch.cat(errors) if errors else sample.new_zeros(0, *lo.shape)
    if pairs is None:
        E = torch.where(tried[:, None, None], measured, float("inf"))
    else:
        E = torch.full((L * K, *lo.shape), float("inf"), device=sample.device).index_copy_(0, pairs, measured)
    E = E.reshape(L, K, *lo.shape)
    E, pick = E.min(1)  # the first of equal clips, as a strict `<` scan would take
    coded = (qmax > 0)[:, None, None]
    return torch.where(coded, E, sample.square().sum(1) * scale), torch.where(coded, clips[pick], 1.0)


def channel_errors(sample: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, qmax: torch.Tensor,
                   clips: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`channel_errors_ref`, by kernels/channel_errors.py on the fast path (one launch for every width and clip)."""
    if use_kernels(sample):
        return kernel("channel_errors")(sample, lo, hi, qmax, clips, scale)
    return channel_errors_ref(sample, lo, hi, qmax, clips, scale)


def error_tables(r: torch.Tensor, levels: tuple[int, ...] = LEVELS) -> tuple[torch.Tensor, torch.Tensor]:
    """E (S, D, L): each channel's squared error at each level with its best clip, measured on a strided sample
    of at most SAMPLE_TOKENS tokens and scaled to the span; alpha (S, D, L) the clip chosen (1 at 0 bits, the
    first of equal clips). On r's device (`channel_errors`)."""
    S, N, D = r.shape
    sample = r[:, :: max(1, math.ceil(N / SAMPLE_TOKENS))].float()  # (S, n, D)
    qmax, clips = (on_device(t, sample.device) for t in _tables(levels))
    E, A = channel_errors(sample, *torch.aminmax(sample, dim=1), qmax, clips, N / sample.shape[1])
    return E.permute(1, 2, 0), A.permute(1, 2, 0)


def allocate(weighted: torch.Tensor, cost: torch.Tensor, available: torch.Tensor) -> torch.Tensor:
    """Level index per (stream, channel) minimising Σ weighted[s, i, level] subject to Σ cost[level] <=
    available[s]: weighted (S, D, L), cost (L,) bits with cost[0] = 0, available (S,) bits. Deterministic, on
    weighted's device: kernels/allocate_levels.py on the fast path (one launch, nothing read back), else
    `allocate_levels_ref`."""
    cost = cost.to(weighted)
    if use_kernels(weighted):
        return kernel("allocate_levels")(weighted, cost, available)
    return allocate_levels_ref(weighted, cost, available)


def allocate_levels_ref(weighted: torch.Tensor, cost: torch.Tensor, available: torch.Tensor) -> torch.Tensor:
    """The allocation rule (module docstring): BISECTION_STEPS bisection steps (in log space, from the θ at which
    each stream's channels all take 0 bits down to 1e-12 of it) for the cheapest Lagrangian θ whose levels
    argmin_l weighted + θ·cost(l) fit each stream's bits, then a greedy fill: the upgrade with the largest error
    drop per extra bit that still fits, one a step, until none does. Sums of costs in fp64 (whole numbers:
    exact). The fill reads whether any stream moved after each step: free on the CPU; on a GPU
    kernels/allocate_levels.py runs the same rule in one launch."""
    S, D, L = weighted.shape
    cost = cost.to(weighted)
    cost64, avail = cost.double(), available.to(weighted.device).double()

    def pick(theta: torch.Tensor) -> torch.Tensor:
        return (weighted + theta[:, None, None] * cost).argmin(-1)

    hi = weighted.amax((1, 2)).clamp_min(1e-30) / cost[1:].min() * 4 + 1  # (S,)
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


def encode_channels(r: torch.Tensor, bits: torch.Tensor, alpha: torch.Tensor, capacity: int | None = None,
                    unbias: bool = False) -> Channels:
    """Code r (S, N, D) with bits (S, D) per channel and clips alpha (S, D): the span's `Channels` layout, on r's
    device (one kernel launch on the fast path). `capacity`: the code buffer's size in bytes when the caller bounds
    it (the allocator: its budget), else it is read from the widths (one host read). `unbias`: each channel's grid
    stretched to a slope of 1 on the values it codes (`Channels.code`; docs/method.md §2.6, step 5)."""
    return Channels.code(r, bits.to(r.device), alpha.to(r.device), capacity, unbias)
