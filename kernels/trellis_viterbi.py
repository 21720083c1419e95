"""The bitshift trellis's Viterbi search, every row of a span at once: the twin of quantwm.core.trellis.encode's
search (quantwm.core.trellis.viterbi, width by width), for `quantwm-trellis` (docs/method.md §2.10).

Row r of x (M, N) (a channel's samples along the span, or channel d of stream s of a span (S, N, D) for r = s·D +
d; normalised on load where a mean and scale are given) is coded with widths[r] bits a sample (0: left at code 0).
Width k's trellis has 2^L_k states (L_k = TABLE_BITS[k]: k + MEMORY at widths 1-4, else L = STATE_BITS): state s' =
(code << (L_k − k)) | (s >> k), the newest L_k bits of the sample's L-bit window, and it decodes to row k of the
tables (9, 2^L) at the window s << (L − L_k). One program per row holds the 2^L_k path costs in registers and takes
one step per sample: the least cost over each state's 2^k predecessors (a (2^(L_k−k), 2^k) min, its argmin kept as
a uint8 backpointer in `back`), then that cost, broadcast to the state's 2^k successors, plus the squared error of
their values. Then it walks the backpointers from the cheapest final state and writes the codes (or, asked, the
states the path passes through, each in its window's top bits: the decode reads them without unpacking anything).
Given start windows (the tail-biting search of quantwm.core.trellis.encode), a row of at least L bits begins after
its start state (the window's top L_k bits) and its walk back begins there too. The width is a runtime value; each
of the eight widths is its own compiled branch (block shapes are constants), so one launch covers a batch of rows
whatever their widths, and nothing is read back to the host.
Rows go in batches whose backpointers (N x 16 bytes a row at most: 2^(L_k − k)) fit `scratch_bytes`. The samples are
read where they lie: a row of an (M, N) x, or a channel of a span y (S, N, D) (row s·D + d, its samples along N),
each normalised on load by its row's mean and scale when given ((y − mean) / scale, as the reference's fp32 ops):
the commit writes no normalised copy of the span.

Ties between equal path costs go to the lowest predecessor, as torch's min takes the first: the codes equal the
reference's wherever no two paths cost the same to the last bit. Compiled without floating-point contraction
(`enable_fp_fusion=False`): a cost plus a squared error rounds twice, as the reference's does, not as one FMA.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .span_args import TRELLIS_MEMORY, TRELLIS_STATE_BITS, TRELLIS_TABLE_BITS, rows_of

SCRATCH_BYTES = 1 << 30  # backpointers kept at once on a GPU (the interpreter's batches are the caller's)
WARPS = max(1, (1 << TRELLIS_STATE_BITS) // 512)  # at most 16 path costs a thread (2^8 states: one warp, 8 each)


@triton.jit
def _search(x_ptr, table_ptr, back_ptr, codes_ptr, first, tail, row, r, N, at, step, center, scale,
            K: tl.constexpr, L: tl.constexpr, LK: tl.constexpr, STATES: tl.constexpr, NORMAL: tl.constexpr):
    S: tl.constexpr = 1 << LK  # width K's trellis: the window's top LK bits
    KEEP: tl.constexpr = S >> K
    DROP: tl.constexpr = L - LK
    s = tl.arange(0, S)
    h = tl.arange(0, KEEP)
    table = tl.load(table_ptr + K * (1 << L) + (s << DROP))  # row K of the tables, one value a state
    first = first >> DROP
    cost = tl.where(s == first, 0.0, float("inf"))
    base = r.to(tl.int64) * N * KEEP
    for t in range(N):
        best, arg = tl.min(tl.reshape(cost, (KEEP, 1 << K)), axis=1, return_indices=True, return_indices_tie_break_left=True)
        tl.store(back_ptr + base + t * KEEP + h, arg.to(tl.uint8))
        xt = tl.load(x_ptr + at + t * step)
        if NORMAL:
            xt = tl.math.div_rn(xt - center, scale)
        err = xt - table
        cost = tl.reshape(tl.broadcast_to(best[None, :], (1 << K, KEEP)), (S,)) + err * err
    state = tl.where(tail, first, tl.argmin(cost, axis=0, tie_break_left=True).to(tl.int32))
    for i in range(N):
        t = N - 1 - i
        if STATES:  # the state in the window's top bits (its top K bits are the code)
            tl.store(codes_ptr + row.to(tl.int64) * N + t, (state << DROP).to(tl.uint8))
        else:
            tl.store(codes_ptr + row.to(tl.int64) * N + t, (state >> (LK - K)).to(tl.int64))
        high = state & (KEEP - 1)
        state = (high << K) | tl.load(back_ptr + base + t * KEEP + high).to(tl.int32)


@triton.jit
def _viterbi_kernel(x_ptr, w_ptr, start_ptr, table_ptr, back_ptr, codes_ptr, mean_ptr, scale_ptr, row0, N, D,
                    L: tl.constexpr, MEMORY: tl.constexpr, TAIL: tl.constexpr, STATES: tl.constexpr,
                    NORMAL: tl.constexpr):
    r = tl.program_id(0)
    row = row0 + r
    width = tl.load(w_ptr + row)
    at = (row // D).to(tl.int64) * N * D + row % D  # sample 0 of the row: x (M, N) is D = 1, a span (S, N, D) its D
    center, scale = 0.0, 1.0
    if NORMAL:
        center, scale = tl.load(mean_ptr + row), tl.load(scale_ptr + row)
    tail = (N * width >= L) & TAIL  # a row of at least L bits: the tail-biting path through its start state
    first = tl.load(start_ptr + row, mask=tail, other=0).to(tl.int32)
    for k in tl.static_range(1, 9):  # unrolled: each width its own branch with constant block shapes
        if width == k:
            if k + MEMORY < L:  # a stored table: the window's top k + MEMORY bits
                _search(x_ptr, table_ptr, back_ptr, codes_ptr, first, tail, row, r, N, at, D, center, scale, k, L,
                        k + MEMORY, STATES, NORMAL)
            else:
                _search(x_ptr, table_ptr, back_ptr, codes_ptr, first, tail, row, r, N, at, D, center, scale, k, L, L,
                        STATES, NORMAL)


def trellis_viterbi(x: torch.Tensor, widths: torch.Tensor, table: torch.Tensor, start: torch.Tensor | None = None,
                    scratch_bytes: int = SCRATCH_BYTES, states: bool = False, mean: torch.Tensor | None = None,
                    scale: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, N) float32 samples, or a span (S, N, D) whose M = S·D rows are its channels (row s·D + d: y[s, :, d]),
    widths (M,) 0-8, table (9, 2^L) float32 each width's value of each window (quantwm.core.trellis.tables) ->
    codes (M, N) int64 (0 on 0-width rows): every row's path from state 0 with a free end, or, given `start` (M,)
    windows, the tail-biting path through the top bits of start[r] of every row of at least L bits (N · width >= L;
    the others' from state 0). `mean`, `scale` (M,): each row searched as (x − mean) / scale, normalised as it is
    read. `states`: the path's states (M, N) uint8 instead, each in its L-bit window's top bits (code = state >> (L
    − width), value = table[width, state]; 0 on 0-width rows). A launch per batch of rows (the batches depend on
    shapes only)."""
    M, N, D = rows_of(x, mean, scale)
    if any(t is not None and t.device != x.device for t in (widths, table, start, mean, scale)):
        raise ValueError(f"the trellis search's tensors must all be on the samples' device {x.device}")
    if (tuple(widths.shape) != (M,) or tuple(table.shape) != (9, 1 << TRELLIS_STATE_BITS)
            or (start is not None and tuple(start.shape) != (M,))):
        raise ValueError(f"need widths ({M},), start states None or ({M},) and the widths' tables (9, "
                         f"{1 << TRELLIS_STATE_BITS}), got {tuple(widths.shape)}, "
                         f"{None if start is None else tuple(start.shape)} and {tuple(table.shape)}")
    codes = torch.zeros(M, N, dtype=torch.uint8 if states else torch.int64, device=x.device)
    if M == 0 or N == 0:
        return codes
    per_row = N * max(1 << (b - k) for k, b in enumerate(TRELLIS_TABLE_BITS) if k)  # the most a row's step keeps
    rows = max(1, min(M, scratch_bytes // per_row))
    back = torch.empty(rows * per_row, dtype=torch.uint8, device=x.device)
    xs, ws, tab = x.float().contiguous(), widths.to(torch.int32).contiguous(), table.float().contiguous()
    starts = None if start is None else start.to(torch.int32).contiguous()
    normal = mean is not None
    centers, scales = (mean.float().contiguous(), scale.float().contiguous()) if normal else (tab, tab)
    for row0 in range(0, M, rows):  # batches by shape, not by value
        n = min(rows, M - row0)
        _viterbi_kernel[(n,)](xs, ws, ws if start is None else starts, tab, back, codes, centers, scales, row0, N, D,
                              L=TRELLIS_STATE_BITS, MEMORY=TRELLIS_MEMORY, TAIL=start is not None, STATES=states, NORMAL=normal,
                              num_warps=WARPS, enable_fp_fusion=False)
    return codes
