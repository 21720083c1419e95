"""A bitshift trellis code for one coordinate of a span: fractional-rate coding at an integer number of bits a
sample, read at random (docs/method.md §2.10; issue 44's block code).

A coordinate's N samples, normalised x_t = (y_t − mean) / scale, are coded with k bits each (k = 1..8), exactly
as many bits as a k-bit uniform grid stores, in the same little-endian bitstream (`Channels`' buffer: code t at
bits [t k, t k + k)). What differs is what a code means. The reader of sample t takes the STATE_BITS = L = 8 bits
of the stream that end where code t ends, bits [(t + 1) k − L, (t + 1) k), as an integer w_t (its window), and
decodes

    ŷ_t = mean + scale · T_k[w_t >> (L − L_k)]      (L_k = TABLE_BITS[k]; scale: the standard deviation times SCALES[k]).

So width k's state s_t = w_t >> (L − L_k), its window's newest L_k bits, is s_t = (s_{t−1} >> k) | (code_t << (L_k −
k)): a shift register, and each code picks one of 2^k successors of the previous state, a path through a trellis of
2^L_k states. The bits before the stream's first are its last ones (a tail-biting trellis) where the stream holds at
least L bits, else 0, so that no sample decodes from a window of padding. The encoder finds the path of least
squared error by the Viterbi search (one step per token, every sequence and state at once), tail-biting by QTIP's
rotation trick (`wrap_states`). Paths through a trellis of values spread like the source's fill space better than
any scalar grid (the "bitshift trellis" of QTIP, Tseng et al., arXiv 2406.11235). Decoding needs no scan: one or two
window reads and one table load per sample.

The values (`tables`): at widths 1-4, L_k = k + 4 and T_k is a stored table of 2^(k+4) values (kernels/
trellis_tables.py) trained by Lloyd's iteration on the trellis from half unit-Gaussian, half unit-Laplacian samples
(the built-in model's Values have heavier tails than a Gaussian), each in units of the coordinate's standard deviation (SCALES
1); at widths 5-8, L_k = 8 and T_k is QTIP's computed "1MAD" codebook of the window (a 32-bit linear congruential
step, then the sum of its four bytes, centred and scaled: `mad`), whose histogram is close to the unit Gaussian's.
The search's work per sample is 2^L_k state updates: 32, 64, 128 at 1-3 bits against 256 for a computed code of 8
bits at every width (the code this format stored before the tables).

Measured on unit-Gaussian tuning samples (24 sequences of 1728, generator seed 7; no trace or world seed):
`python benchmarks/trellis_gain.py --tables`. The mean squared error per sample of the tail-biting search the format
stores (at widths 5-7 the best of the codebook's scales 0.8 .. 1.8), against a uniform grid with the allocator's
clip search on the same samples:

    k                1      2      3       4        5        6        7        8
    trellis MSE      0.312  0.0901 0.025   0.00651  0.00204  0.000642 0.000308 0.000124
    / uniform grid   0.664  0.692  0.618   0.531    0.583    0.649    1.261    2.033
    scale            1      1      1       1        1.4      1.4      1.4      1.6

(the Gaussian bound 2^−2k: 0.25, 0.0625, 0.0156, 0.0039; a Lloyd-Max scalar grid: 0.363, 0.118, 0.0345, 0.0095).
On Gaussians the tables give up 2-5% at 1-3 bits to the computed code of 256 states (0.305, 0.0859, 0.0245); on
Laplacian samples they err 0.50-0.97x as much (docs/method.md §2.10, "Stored tables"). At 7-8 bits 256 values are too
few and the grid codes a channel better (the commit keeps it). The allocator prices a trellis coordinate as its
uniform grid's measured error times the ratio (ERROR_RATIO), at most 1 (the grid is kept where it is better).
The constants the fused kernel needs live in quantwm/kernels/span_args.py.
"""
from __future__ import annotations

import functools
import itertools
import math

import torch

from ..kernels.span_args import (
    MAD_ADD,
    MAD_CENTER,
    MAD_MULT,
    MAD_SCALE,
    TRELLIS_SCALES,
    TRELLIS_STATE_BITS,
    TRELLIS_TABLE_BITS,
    TRELLIS_TRAINED,
    TRELLIS_UNIT_MSE,
    rows_of,
)
from .backend import kernel, use_kernels
from .tables import on_device

STATE_BITS = TRELLIS_STATE_BITS  # L = 8: the window a sample decodes from
TABLE_BITS = TRELLIS_TABLE_BITS  # the top bits of it each width 0..8 reads: its trellis has 2^TABLE_BITS[k] states
WIDTHS = tuple(range(1, 9))  # the widths a trellis coordinate may take
SCALES = TRELLIS_SCALES[1:]  # codebook scale per width 1..8 (module docstring's table)
UNIT_MSE = TRELLIS_UNIT_MSE  # per unit variance, widths 0..8
ERROR_RATIO = (1.0, 0.664, 0.692, 0.618, 0.531, 0.583, 0.649, 1.261, 2.033)  # trellis / uniform MSE, widths 0..8
BACKPOINTER_BYTES = 1 << 27  # the Viterbi search keeps at most this many bytes of backpointers at once
WRAP_TOKENS = 64  # the tail-biting start's search sees this many samples either side of the wrap (`wrap_states`)
_SCALE_TABLE = torch.tensor(TRELLIS_SCALES, device="cpu")


def mad(state: torch.Tensor) -> torch.Tensor:
    """CODEBOOK[state] computed from the state alone (int64 in, float32 out): x = (MAD_MULT·s + MAD_ADD) mod 2^32,
    the sum of its four bytes, centred and scaled to unit variance. What kernels/span_tiles.py computes in the
    same integer and float32 steps."""
    x = (state.long() * MAD_MULT + MAD_ADD) & 0xFFFFFFFF
    total = (x & 255) + ((x >> 8) & 255) + ((x >> 16) & 255) + (x >> 24)
    return (total.float() - MAD_CENTER) * MAD_SCALE  # an fp32 value: the product is fp32's on any device


@functools.cache
def codebook() -> torch.Tensor:
    """(2^L,) float32 on the host: CODEBOOK[s] for every state (`mad`), the computed code of widths 5-8."""
    return mad(torch.arange(1 << STATE_BITS, device="cpu"))


@functools.cache
def tables() -> torch.Tensor:
    """(9, 2^L) float32 on the host: row k the value a k-bit sample decodes to from each L-bit window s (row 0:
    zeros). A width with a stored table (1-4, kernels/trellis_tables.py) reads its top TABLE_BITS[k] bits,
    TRAINED[k][s >> (L − TABLE_BITS[k])]; widths 5-8 the computed codebook, `mad`(s). What the search, the choice and
    the fused kernel read (flattened: value = tables[k · 2^L + s])."""
    s = torch.arange(1 << STATE_BITS, device="cpu")
    rows = [torch.zeros(1 << STATE_BITS, device="cpu")]
    for k in WIDTHS:
        trained = TRELLIS_TRAINED.get(k)
        rows.append(mad(s) if trained is None else torch.tensor(trained, device="cpu")[s >> (STATE_BITS - TABLE_BITS[k])])
    return torch.stack(rows).float()


def table_of(table: torch.Tensor, k: int) -> torch.Tensor:
    """Width k's own trellis (2^TABLE_BITS[k],) of the (9, 2^L) `tables`: the value of each of its states (the
    window's top bits; the rest change nothing)."""
    return table[k, ::1 << (STATE_BITS - TABLE_BITS[k])]


def viterbi(x: torch.Tensor, bits: int, values: torch.Tensor, start: torch.Tensor | None = None,
            states: bool = False) -> torch.Tensor:
    """Codes (M, N) int64 in [0, 2^bits) of the least-squared-error path of every row of x (M, N) through the trellis
    whose state s decodes to values[s] (2^L,; L is read from its size, STATE_BITS for the stored code): from state 0
    with a free end, or, given `start` (M,) states, the tail-biting path that begins after start[r] and ends in it
    (needs N · bits >= L, so that every state can end a path). One step per token for every row and state at once;
    rows in batches whose backpointers (N x rows x 2^(L − bits) bytes) stay within BACKPOINTER_BYTES. `states`: the
    path's states (M, N) int64 instead of its codes (code = state >> (L − bits), value = values[state])."""
    M, N = x.shape
    n_states = values.numel()
    L = n_states.bit_length() - 1
    if not 1 <= bits <= 8:
        raise ValueError(f"trellis widths are 1-8 bits, got {bits}")
    if n_states != 1 << L or L < bits:
        raise ValueError(f"a trellis of {bits}-bit codes needs 2^L >= 2^{bits} state values, got {n_states}")
    if start is not None and (tuple(start.shape) != (M,) or N * bits < L):
        raise ValueError(f"a tail-biting search needs one start state a row ({M},) and at least {L} bits a "
                         f"row, got {tuple(start.shape)} and {N} x {bits}")
    keep = n_states >> bits  # each state is reached from 2^bits of them
    rows = max(1, BACKPOINTER_BYTES // max(1, N * keep))
    out = torch.empty(M, N, dtype=torch.long, device=x.device)
    for at in range(0, M, rows):  # one batch at the shapes a span meets
        xb = x[at:at + rows].float()
        m = xb.shape[0]
        first = torch.zeros(m, dtype=torch.long, device=x.device) if start is None else start[at:at + m].long()
        cost = torch.full((m, n_states), math.inf, device=x.device).scatter_(1, first[:, None], 0.0)
        back = torch.empty(N, m, keep, dtype=torch.uint8, device=x.device)
        for t in range(N):  # s' = (code << (L − bits)) | (s >> bits): the low bits of s are what is forgotten
            best, back[t] = cost.view(m, keep, 1 << bits).min(2)
            cost = best.repeat(1, 1 << bits) + (xb[:, t:t + 1] - values[None]).square()
        state = cost.argmin(1) if start is None else first
        for t in range(N - 1, -1, -1):
            out[at:at + m, t] = state if states else state >> (L - bits)
            high = state & (keep - 1)
            state = (high << bits) | back[t].gather(1, high[:, None])[:, 0].long()
    return out


def wrap_states(x: torch.Tensor, search, window: int = WRAP_TOKENS) -> torch.Tensor:
    """Each row's tail-biting state (M,): the state after its last sample on the free-start search over a window
    around the wrap, its last `window` samples (at most half the row) then its first (so that the last sample sits
    mid-path); QTIP's rotation trick, over a window. x: (M, N) rows, or a span (S, N, D) (its samples along dim 1);
    `search(w)` returns the free-start path's states (M, W) through the window w (x's form, W samples): the state
    after a sample is the L bits that end there, so the one after the row's last sample is read off the path."""
    N = x.shape[1]
    before, after = min(N - N // 2, window), min(N // 2, window)
    return search(torch.cat([x[:, N - before:], x[:, :after]], 1))[:, before - 1].long()


def encode(y: torch.Tensor, widths: torch.Tensor, mean: torch.Tensor, scale: torch.Tensor,
           states: bool = False) -> torch.Tensor:
    """Integer codes (S, N, D) of y (S, N, D) coded coordinate by coordinate along its tokens with widths (S, D)
    (0: nothing, code 0) against the stored mean and scale (S, D) (their fp16 values; ŷ = mean + scale ·
    CODEBOOK[state]). A coordinate of N · k >= L bits takes the tail-biting path through the state `wrap_states`
    picks (`states` reads the bits before its first from its end); a shorter one the path from state 0.
    kernels/trellis_viterbi.py on the fast path (every width in one launch a search, the span read in place and
    normalised as it is read), else the searches of `viterbi`, width by width present (the widths' counts read on
    the host once, for both searches). `states`: the paths' states (S, N, D) uint8 instead of their codes (code =
    state >> (L − width); `values` decodes them)."""
    S, N, D = y.shape
    flat = widths.reshape(-1).long()
    table = on_device(tables(), y.device)
    norm = {"mean": mean.reshape(-1), "scale": scale.reshape(-1)}
    if use_kernels(y):  # two launches per batch of rows, every width at once, nothing read back
        search = kernel("trellis_viterbi")
    else:  # the widths' rows grouped once (host read: one a span), then a search per width present
        groups = _width_groups(flat)
        search = functools.partial(_search_by_width, groups=groups)
    start = wrap_states(y, lambda w: search(w, flat, table, states=True, **norm))
    return search(y, flat, table, start, states=states, **norm).reshape(S, D, N).permute(0, 2, 1)


def normalised_rows(x: torch.Tensor, mean: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The search's rows (M, N) float32 of x (M, N) or of a span (S, N, D) (row s·D + d: its channel d along N), each
    as (x − mean) / scale where mean and scale (M,) are given: what kernels/trellis_viterbi.py reads in place."""
    rows_of(x, mean, scale)  # the kernel's checks
    if x.dim() == 3:
        x = x.permute(0, 2, 1).reshape(-1, x.shape[1])
    x = x.float()
    return x if mean is None else (x - mean.float()[:, None]) / scale.float()[:, None]


def _width_groups(widths: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(width, its rows) for every width 1-8 present in widths (M,) (host read: the counts, once)."""
    order = widths.argsort(stable=True)
    counts = torch.bincount(widths, minlength=len(WIDTHS) + 1).tolist()
    ends = list(itertools.accumulate(counts))
    return [(k, order[ends[k] - counts[k]:ends[k]]) for k in WIDTHS if counts[k]]


def _search_by_width(x: torch.Tensor, widths: torch.Tensor, table: torch.Tensor, start: torch.Tensor | None = None,
                     groups: list | None = None, states: bool = False, mean: torch.Tensor | None = None,
                     scale: torch.Tensor | None = None) -> torch.Tensor:
    """Codes (M, N) of every row of x (M, N), or of a span (S, N, D)'s channels (`normalised_rows`, by mean and
    scale (M,) where given), at its width (0: code 0) by `viterbi` through that width's trellis (`table_of` the
    (9, 2^L) `tables`), width by width: from state 0, or given `start` (M,) L-bit windows, tail-biting through
    start[r]'s top TABLE_BITS[k] bits where the row holds at least L bits; `states`: the paths' L-bit windows
    (M, N) uint8 instead, each state in their top bits (the rest 0; 0 on 0-width rows)."""
    x = normalised_rows(x, mean, scale)
    M, N = x.shape
    if tuple(table.shape) != (len(WIDTHS) + 1, 1 << STATE_BITS):
        raise ValueError(f"the trellis search reads the widths' tables (9, {1 << STATE_BITS}), got {tuple(table.shape)}")
    codes = torch.zeros(M, N, dtype=torch.uint8 if states else torch.long, device=x.device)
    for k, rows in groups if groups is not None else _width_groups(widths.long()):
        tail = start is not None and N * k >= STATE_BITS
        drop = STATE_BITS - TABLE_BITS[k]  # the window's bits below width k's state
        path = viterbi(x[rows], k, table_of(table, k), start[rows] >> drop if tail else None, states)
        codes[rows] = (path << drop if states else path).to(codes.dtype)
    return codes


def trellis_viterbi_ref(x: torch.Tensor, widths: torch.Tensor, table: torch.Tensor, start: torch.Tensor | None = None,
                        scratch_bytes: int | None = None, states: bool = False, mean: torch.Tensor | None = None,
                        scale: torch.Tensor | None = None) -> torch.Tensor:
    """The PyTorch twin of kernels/trellis_viterbi.py (same arguments, the same codes or states): `viterbi` width by
    width on the rows as the kernel reads them (`normalised_rows`; the widths' counts read on the host once);
    `scratch_bytes` is the kernel's and unused here."""
    return _search_by_width(x, widths, table, start, states=states, mean=mean, scale=scale)


def states(buffer: torch.Tensor, offsets: torch.Tensor, widths: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """The state (S, N, D) int64 each sample decodes from: the L bits of its coordinate's stream ending where its
    code ends, from the uint8 buffer, first bytes `offsets` and widths (S, D). Bits before the stream's first are
    read from its end (tail-biting) where the stream holds at least L bits, else as 0."""
    b = widths.long()[:, None, :]
    end = (torch.arange(n_tokens, device=b.device)[None, :, None] + 1) * b  # (S, N, D) bit after the code
    first = (end - STATE_BITS).clamp_min(0)
    buf = torch.nn.functional.pad(buffer.long(), (0, 3))  # a window spans at most three bytes
    head = _read_bits(buf, offsets[:, None, :] * 8 + first, end - first, b > 0)
    wrap = (b > 0) & (end < STATE_BITS) & (n_tokens * b >= STATE_BITS)
    missing = torch.where(wrap, STATE_BITS - end, 0)  # the window's oldest bits, the stream's last ones
    tail = _read_bits(buf, offsets[:, None, :] * 8 + n_tokens * b - missing, missing, wrap)
    return torch.where(b > 0, (head << (STATE_BITS - (end - first))) | tail, 0)


def _read_bits(buf: torch.Tensor, bit: torch.Tensor, length: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """The `length` (at most 17) bits of buf (int64, padded by 3) from bit `bit` on, little-endian; 0 where not live."""
    at = torch.where(live, bit >> 3, 0)
    word = buf[at] | (buf[at + 1] << 8) | (buf[at + 2] << 16)
    return torch.where(live, (word >> (bit & 7)) & ((1 << length) - 1), 0)


def values(state: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """The normalised samples (S, N, D) float32 of L-bit windows (S, N, D) in [0, 2^L) at widths (S, D) 0-8: each
    looked up in its width's row of `tables()` (row 0 is zeros), one gather, as the fused kernel reads it."""
    flat = widths.long()[:, None, :] * (1 << STATE_BITS) + state.long()
    return on_device(tables(), state.device).reshape(-1)[flat]


def scale_of(std: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """The stored scale (S, D) of coordinates of standard deviation std at widths (S, D): std times the width's
    codebook scale (SCALES; 1 at width 0)."""
    factor = on_device(_SCALE_TABLE, std.device)[widths.long()]
    return std * factor
