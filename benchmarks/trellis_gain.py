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
    python benchmarks/trellis_gain.py --trace t.pt [--budget 2.5]     # on a synthetic trace's Keys (below)
    python benchmarks/trellis_gain.py --tables [--state-bits L]  # quantwm/core/trellis.py's constants (2^L states)
    python benchmarks/trellis_gain.py --trained [--restarts 4] [--save T.json]  # smaller trellises, trained tables
    python benchmarks/trellis_gain.py --probe T.json 4 --methods quantwm-trellis-v --budget 2.5 --seeds 5,6,7
    python benchmarks/trellis_gain.py --emit T.json 4 kernels/trellis_tables.py  # the format's stored tables
    python benchmarks/trellis_gain.py --warmup      # its error by token position: the first samples of a channel
    python benchmarks/trellis_gain.py --wrap        # the tail-biting start's search window (WRAP_TOKENS)
    python benchmarks/trellis_gain.py --encode-time [--device cuda] [--shape 12,4680,128]  # seconds to code a span
    python benchmarks/trellis_gain.py --tails t.pt [--budget 4]    # its key error by how extreme an element is
    python benchmarks/trellis_gain.py --price t.pt [--budget 4]    # its real error against its price, per width

`--tables`: the bitshift trellis QuantWM codes with (quantwm/core/trellis.py, 2^8 states, QTIP's computed
codebook) on unit-Gaussian tuning samples (24 sequences of 1728, generator seed 7): at each width 1-8, the codebook
scale of least error (0.8 to 1.8 by 0.1), that error, and its ratio to the uniform grid with the allocator's clip
search (quantwm/core/allocate.py) on the same samples: the SCALES, UNIT_MSE and ERROR_RATIO tables. `--state-bits
L` measures the same trellis with 2^L states (the codebook `mad` of states 0 .. 2^L − 1) at the widths below L,
the state sizes not stored: 10 and 12 (QTIP's 16 is out of this machine's reach), or 4-7, a search 2-16 times
cheaper.

`--trained`: the search's work grows as 2^L, and QuantWM's computed codebook needs L = 8 at every width (with 2^6
values it codes worse than the grid from 2 bits). A stored table of 2^L values a width instead, L = k + m (m bits
of memory: 2^m states, 2^k branches into each), trained by Lloyd's iteration on the trellis (each value the mean of
the samples its state decoded, the search run again) from Gaussian quantiles in `--restarts` random orders on
unit-Gaussian training samples (24 x 1728, generator seed 11), the best restart kept; measured by the stored
tail-biting search on the `--tables` samples (seed 7) against the stored code's error there and the uniform grid's.
Work: 2^L values a sample against the stored code's 256.

`--laplace T.json`: the saved tables against the stored code on unit-variance Laplacian samples, a heavier-tailed
source, beside Gaussian ones and 128-sample spans. `--trained --source mixture` trains on half Gaussian, half
Laplacian rows instead (`--widths` a subset of 1-4).

`--probe T.json M EVAL-ARGS`: what other tables would do on the built-in model: `quantwm eval EVAL-ARGS` with
quantwm-trellis's codes and decodes through the tables of memory M saved by `--trained --save T.json`
(`stored_tables`: the reference path, each width's trellis of 2^(k+M) states, the allocator's prices the format's);
`stored` instead of a file runs the same patches with the format's own tables, which reproduces plain `quantwm
eval` figure for figure (its check). How the format's tables (kernels/trellis_tables.py) were chosen, before the
format held them (then the search ran over 256 states): docs/method.md §2.10, "Stored tables".

`--emit T.json M OUT.py`: the memory-M tables of a `--trained --save` file written as the module the format reads.

`--trace`: the textbook transform coder (S's eigenbasis of the history Queries, reverse water-filling over the
allocator's uniform tables, as benchmarks/bits_above_bound.py's step 2) on the trace's second and third chunks,
then the same coordinates at the same widths by TCQ (the union's spacing half the uniform grid's step, centred on
it: the Gaussian tuning's 0.5 at every width). Prints both coders' query-weighted error, logit RMSE and top-1
shift among the span's keys under the trace's reading queries.

Measured (64 sequences of 1728 samples): R=1 +0.77 dB, R=2 +1.08 dB, R=3 +1.08 dB over the best uniform grid,
i.e. 0.13-0.18 bit per coded coordinate at equal rate (the Gaussian bound is another 0.8-2.6 dB away).
"""
from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bits_above_bound's textbook coder (--trace)
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


def tcq_decode_path(y: torch.Tensor, widths: torch.Tensor, low: torch.Tensor, step: torch.Tensor,
                    taps=((0,), (1, 2))) -> torch.Tensor:
    """y (S, N, D) coded coordinate by coordinate along the tokens by TCQ at `widths` (S, D) bits, the union of
    2^(b+1) levels spaced step/2 over the uniform grid's range (low, step (S, D)); the Viterbi path's values
    (width 0: 0)."""
    S, N, D = y.shape
    x, b = y.permute(0, 2, 1).reshape(S * D, N).double(), widths.reshape(-1)
    half = step.reshape(-1).double()[:, None] / 2
    L = (2 ** (b + 1)).double()[:, None]
    centre = low.reshape(-1).double()[:, None] + (2.0 ** b[:, None] - 1) / 2 * 2 * half
    u = (x - centre) / half + (L - 1) / 2  # position in union-level units
    index = torch.stack([j + 4 * torch.minimum(torch.round((u - j) / 4).clamp(min=0), L / 4 - 1) for j in range(4)], -1)
    val = centre[..., None] + (index - (L[..., None] - 1) / 2) * half[..., None]  # (M, N, 4): each subset's nearest
    err = (x[..., None] - val).square()
    label, preds, branch = trellis(taps)
    step_label = label[preds, branch[:, None].expand(STATES, 2)]
    M = x.shape[0]
    cost = torch.full((M, STATES), math.inf, dtype=x.dtype)
    cost[:, 0] = 0
    back = torch.zeros(N, M, STATES, dtype=torch.long)
    for t in range(N):  # Viterbi forward
        cost, back[t] = (cost[:, preds] + err[:, t][:, step_label]).min(-1)
    state, rows, out = cost.argmin(-1), torch.arange(M), torch.zeros(M, N, dtype=x.dtype)
    for t in range(N - 1, -1, -1):  # and back along the kept branches
        pick = back[t][rows, state]
        out[:, t] = val[rows, t, step_label[state, pick]]
        state = preds[state, pick]
    return torch.where(b[:, None] > 0, out, 0.0).reshape(S, D, N).permute(0, 2, 1)


def bitshift_tables(state_bits: int | None = None) -> None:
    """The module docstring's `--tables` (2^state_bits states; None: the stored code's), printed as a table and as
    the constants' tuples."""
    from quantwm.core import trellis
    from quantwm.core.allocate import CLIPS, channel_errors_ref

    x = torch.randn(24, 1728, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    x = ((x - x.mean(1, keepdim=True)) / x.std(1, keepdim=True)).float()
    cols = x.T[None]  # (1, N, 24): the sequences as the allocator's channels
    L = trellis.STATE_BITS if state_bits is None else state_bits
    if not 4 <= L <= 12:
        raise SystemExit(f"--state-bits takes 4-12 (the stored code has {trellis.STATE_BITS}), got {L}")
    rows = []
    for k in (k for k in trellis.WIDTHS if k < L):  # a width of L bits would leave the trellis no memory
        E, _ = channel_errors_ref(cols, cols.amin(1), cols.amax(1), torch.tensor([2.0 ** k - 1]),
                                  torch.tensor(CLIPS), 1.0)
        uniform = E.sum().item() / x.numel()
        best, values, scales = None, trellis.mad(torch.arange(1 << L)), [round(0.8 + 0.1 * i, 1) for i in range(11)]
        if state_bits is None:  # the format's code: a stored table holds its own scale
            values = trellis.table_of(trellis.tables(), k)
            scales = [1.0] if k in trellis.TRELLIS_TRAINED else scales
        for scale in scales:  # the stored search: tail-biting
            path = _search_path(x / scale, k, values, tail=True)
            err = (x - scale * path).square().mean().item()
            best = min(best or (err, scale), (err, scale))
        rows.append((k, best[0], best[1], uniform))
        print(f"| {k} | {best[1]:.1f} | {best[0]:.3g} | {uniform:.3g} | {best[0] / uniform:.3f} |", flush=True)
    print("SCALES =", tuple(r[2] for r in rows))
    print("UNIT_MSE =", (1.0, *(float(f"{r[1]:.3g}") for r in rows)))
    print("ERROR_RATIO =", (1.0, *(round(r[1] / r[3], 3) for r in rows)))


def trained_table(x: torch.Tensor, k: int, L: int, seed: int, iterations: int = 25) -> torch.Tensor:
    """A 2^L-value table for k-bit codes trained on x (M, N) by Lloyd's iteration on the trellis: the Gaussian's
    2^L quantiles in a random order (generator `seed`), then each value the mean of the samples its state decodes on
    the free-start search's paths (a value no path visits is kept), `iterations` times."""
    from quantwm.core import trellis

    n = 1 << L
    quantiles = torch.distributions.Normal(0.0, 1.0).icdf((torch.arange(n, dtype=torch.float64) + 0.5) / n).float()
    table = quantiles[torch.randperm(n, generator=torch.Generator().manual_seed(seed))]
    for _ in range(iterations):
        state = trellis.viterbi(x, k, table, states=True).reshape(-1)
        sums = torch.zeros(n).index_add_(0, state, x.reshape(-1))
        seen = torch.bincount(state, minlength=n)
        table = torch.where(seen > 0, sums / seen.clamp_min(1), table)
    return table


def laplacian(rows: int, n: int, seed: int) -> torch.Tensor:
    """(rows, n) unit-variance Laplacian samples (generator `seed`): a heavier-tailed source than the Gaussian."""
    u = torch.rand(rows, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) - 0.5
    return (-torch.sign(u) * torch.log1p(-2 * u.abs()) / 2 ** 0.5).float()


def trained_tables(restarts: int = 4, save: str | None = None, source: str = "gauss",
                   widths: tuple[int, ...] = (1, 2, 3, 4)) -> None:
    """The module docstring's `--trained`, printed as a table; `save`: every trained table written to a JSON file
    (what `--probe` and `--laplace` read); `source`: "gauss" (24 Gaussian rows) or "mixture" (12 Gaussian and 12
    Laplacian rows) to train on; `widths`: a subset of 1-4."""
    import json

    from quantwm.core import trellis
    from quantwm.core.allocate import CLIPS, channel_errors_ref

    if restarts < 1:
        raise SystemExit(f"--restarts takes 1 or more, got {restarts}")
    if source not in ("gauss", "mixture") or not widths or not set(widths) <= set(TRAINED_WIDTHS):
        raise SystemExit(f"--source takes gauss or mixture and --widths a subset of {TRAINED_WIDTHS}, got {source!r} "
                         f"and {widths}")
    train = torch.randn(24, 1728, generator=torch.Generator().manual_seed(11))
    if source == "mixture":
        train = torch.cat([train[:12], laplacian(12, 1728, 11)])
    x = torch.randn(24, 1728, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    x = ((x - x.mean(1, keepdim=True)) / x.std(1, keepdim=True)).float()  # the --tables samples
    cols = x.T[None]
    stored = COMPUTED_SCALES
    print("| width k | memory m | values 2^L | search work | MSE | / stored code (256, computed) | / uniform grid |\n"
          "|---|---|---|---|---|---|---|")
    kept = {}
    for k in widths:
        E, _ = channel_errors_ref(cols, cols.amin(1), cols.amax(1), torch.tensor([2.0 ** k - 1]),
                                  torch.tensor(CLIPS), 1.0)
        uniform = E.sum().item() / x.numel()
        ours = (x - stored[k] * _search_path(x / stored[k], k, trellis.codebook(), tail=True)).square().mean().item()
        for m in TRAINED_MEMORY:
            L = k + m
            tables = [trained_table(train, k, L, seed) for seed in range(restarts)]  # the best on its training
            table = min(tables, key=lambda t: (t[trellis.viterbi(train, k, t, states=True)] - train).square().mean())
            err = (x - _search_path(x, k, table, tail=True)).square().mean().item()
            kept[f"{k},{m}"] = [round(v, 6) for v in table.tolist()]
            print(f"| {k} | {m} | {1 << L} | {(1 << L) / 256:.3g} | {err:.4g} | {err / ours:.3f} | {err / uniform:.3f} |",
                  flush=True)
    if save:
        Path(save).parent.mkdir(parents=True, exist_ok=True)
        training = {"gauss": "unit Gaussian, 24 x 1728, generator seed 11",
                    "mixture": "12 x 1728 unit Gaussian and 12 x 1728 unit Laplacian, generator seed 11"}[source]
        Path(save).write_text(json.dumps({"training": training, "restarts": restarts, "tables": kept}, indent=1))
        print(f"wrote {save}")


TRAINED_WIDTHS, TRAINED_MEMORY = (1, 2, 3, 4), (3, 4)
COMPUTED_SCALES = {1: 0.9, 2: 1.1, 3: 1.2, 4: 1.2}  # the computed 256-state code's scales at widths 1-4 (stored until
# the trained tables replaced it there): what --trained and --laplace measure the tables against


def saved_tables(path: str) -> dict:
    """The tables a `--trained --save` file holds ({"k,m": values}), or a clear exit naming what is wrong."""
    return _tables_file(path)["tables"]


def _tables_file(path: str) -> dict:
    """A `--trained --save` file read once: its fields, the tables as floats, or a clear exit naming what is wrong."""
    import json

    try:
        meta = json.loads(Path(path).read_text())
        return {**meta, "tables": {key: [float(v) for v in values] for key, values in meta["tables"].items()}}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise SystemExit(f"{path}: not a tables file written by --trained --save ({type(e).__name__}: {e})") from None


def emit(path: str, memory: int, out: str) -> None:
    """`--emit T.json M OUT.py`: the memory-M tables of a `--trained --save` file written as the Python module the
    format reads (kernels/trellis_tables.py: MEMORY and TRAINED, width k's 2^(k + M) values)."""
    meta = _tables_file(path)
    rows = {}
    for k in TRAINED_WIDTHS:
        values = meta["tables"].get(f"{k},{memory}", ())
        if len(values) != 1 << (k + memory):
            raise SystemExit(f"{path} holds no table of {1 << (k + memory)} values for width {k} and memory {memory}")
        rows[k] = values
    training = f"{meta.get('training', 'samples not recorded')}, best of {meta.get('restarts', '?')} restarts"
    lines = ['"""The stored value tables of the TRELLIS form\'s widths 1-4 (kernels/span_args.py, quantwm/core/trellis.py):',
             f"width k's 2^(k + {memory}) values, read by the top k + {memory} bits of a sample's 8-bit window. Trained by",
             "Lloyd's iteration on the trellis from", f"{training}. Written by", "",
             "    python benchmarks/trellis_gain.py --trained --source mixture --save docs/frontier/trellis-tables-mixture.json",
             f"    python benchmarks/trellis_gain.py --emit {path} {memory} {out}", "",
             "(tests/test_trellis.py and tests/test_trellis_gain.py check the two agree). Generated: change the tables by",
             "running those commands again.",
             '"""', "", f"MEMORY = {memory}  # width k reads the top k + MEMORY bits of its 8-bit window (at most 8)",
             "TRAINED = {"]
    for k, values in rows.items():
        lines.append(f"    {k}: (")
        row = " " * 8
        for v in values:
            cell = f"{float(v)!r}, "
            if len(row) + len(cell) > 119:
                lines.append(row.rstrip())
                row = " " * 8
            row += cell
        lines += [row.rstrip(), "    ),"]
    Path(out).write_text("\n".join(lines + ["}"]) + "\n")
    print(f"wrote {out}: widths {', '.join(map(str, rows))}, memory {memory}")


def on_laplace(path: str) -> None:
    """`--laplace T.json`: each saved table's error over the stored code's, both by the stored tail-biting search, on
    unit-variance Gaussian and Laplacian samples (8 x 1728, generator seed 21) and on 128-sample Gaussian spans (64
    of them, the built-in model's span length), every row normalised."""
    from quantwm.core import trellis

    saved = saved_tables(path)
    g = torch.Generator().manual_seed(21)
    sources = {"Gaussian": torch.randn(8, 1728, generator=g), "Laplacian": laplacian(8, 1728, 21),
               "Gaussian, 128-sample spans": torch.randn(64, 128, generator=g)}
    stored = COMPUTED_SCALES
    print(f"{path}: error / the stored code's\n| samples | width k | memory m | ratio |\n|---|---|---|---|")
    for name, x in sources.items():
        x = (x - x.mean(1, keepdim=True)) / x.std(1, keepdim=True)
        for key in sorted(saved):
            k, m = map(int, key.split(","))
            ours = (x - stored[k] * _search_path(x / stored[k], k, trellis.codebook(), tail=True)).square().mean()
            err = (x - _search_path(x, k, torch.tensor(saved[key]), tail=True)).square().mean()
            print(f"| {name} | {k} | {m} | {(err / ours).item():.3f} |", flush=True)


class stored_tables:
    """`with stored_tables(path, m):` quantwm-trellis's reference path (QUANTWM_KERNELS=ref) codes and decodes
    through other tables than the format's: at widths 1-4 the trained table of 2^(k+m) values from `path`
    (`--trained --save`), read by the top k + m bits of a sample's 8-bit window (`trellis.tables` and
    `trellis.TABLE_BITS` patched), each holding its own scale (a channel stores its standard deviation); at 5-8
    the format's codebook. No path: the format's own tables through the same patches (a check that they change
    nothing). The allocator still prices a channel by the format's ratios; the fused kernel does not read these
    tables (the probe forces the reference path)."""

    def __init__(self, path: str | None, memory: int):
        from quantwm.core import trellis

        n = 1 << trellis.STATE_BITS
        tables, bits = trellis.tables().clone(), list(trellis.TABLE_BITS)
        factor = [1.0, *trellis.SCALES]  # the stored scale's factor at widths 0-8 (`trellis.scale_of`)
        if path is not None:
            saved = saved_tables(path)
            for k in TRAINED_WIDTHS:
                if len(saved.get(f"{k},{memory}", ())) != 1 << (k + memory):
                    raise SystemExit(f"{path} holds no table of {1 << (k + memory)} values for width {k} and memory "
                                     f"{memory}")
                bits[k] = k + memory
                tables[k] = torch.tensor(saved[f"{k},{memory}"])[torch.arange(n) >> (trellis.STATE_BITS - bits[k])]
                factor[k] = 1.0  # the trained table holds its scale: the stored one is the channel's deviation
        self.tables, self.bits, self.factor = tables, tuple(bits), torch.tensor(factor)
        self.saved = []

    def __enter__(self):
        from quantwm.core import trellis

        patches = [(trellis, "tables", lambda: self.tables), (trellis, "TABLE_BITS", self.bits),
                   (trellis, "scale_of", lambda std, widths: std * self.factor[widths.long()])]
        for module, name, f in patches:
            self.saved.append((module, name, getattr(module, name)))
            setattr(module, name, f)
        return self

    def __exit__(self, *exc):
        for module, name, f in self.saved:
            setattr(module, name, f)
        self.saved = []


def probe(path: str | None, memory: int, eval_args: list[str]) -> int:
    """`--probe`: `quantwm eval eval_args` with quantwm-trellis's codes through `stored_tables(path, memory)` on
    the reference path (no path: the stored codebook through the same patches, a check that they change nothing
    but the tables)."""
    import os

    from quantwm.cli import main as cli

    os.environ["QUANTWM_KERNELS"] = "ref"
    with stored_tables(path, memory):
        return cli(["eval", *eval_args])


def warmup() -> None:
    """The `--warmup` tables: unit-Gaussian samples (256 channels x 128 tokens, the built-in model's span length;
    generator seed 0, each channel normalised as the layout does) coded at each width by the search quantwm-trellis
    stores (tail-biting: the bits before a channel are read from its end, and the path begins and ends in the state
    quantwm.core.trellis.wrap_states picks, QTIP's rotation trick over a window) and by the search from state 0
    whose first samples read zeros before the channel (the format before the tail-biting one). Per search: the
    squared error of tokens 0-5 over the mean of tokens 12-115, and the MSE."""
    from quantwm.core import trellis

    x = torch.randn(256, 128, generator=torch.Generator().manual_seed(0))
    x = (x - x.mean(1, keepdim=True)) / x.std(1, keepdim=True, correction=0)
    print("| bits | search | error of tokens 0-5 over the mean | MSE |\n|---|---|---|---|")
    for k in (1, 2, 3, 4):
        values = trellis.table_of(trellis.tables(), k) * trellis.SCALES[k - 1]  # the stored code
        for name, tail in (("from state 0 (before)", False), ("tail-biting (stored)", True)):
            e = (_search_path(x, k, values, tail) - x).square()
            ratio = e.mean(0)[:6] / e.mean(0)[12:116].mean()
            print(f"| {k} | {name} | " + ", ".join(f"{v:.1f}" for v in ratio.tolist()) + f" | {e.mean().item():.4f} |")


def wrap_window() -> None:
    """The `--wrap` table: the MSE of the tail-biting search quantwm-trellis stores when its start state comes from a
    search over 8 ... 64 samples either side of the wrap, or over the whole channel rotated by half (QTIP's trick as
    published), on unit-Gaussian samples (generator seed 0, normalised per channel): 256 channels of 128 tokens and
    24 of 1728, widths 1-3."""
    from quantwm.core import trellis

    windows = (8, 16, 32, 64, None)
    print("| tokens | bits | " + " | ".join(f"window {w}" if w else "whole channel" for w in windows) + " |")
    print("|---" * (len(windows) + 2) + "|")
    for n, m in ((128, 256), (1728, 24)):
        x = torch.randn(m, n, generator=torch.Generator().manual_seed(0))
        x = (x - x.mean(1, keepdim=True)) / x.std(1, keepdim=True, correction=0)
        for k in (1, 2, 3):
            values = trellis.table_of(trellis.tables(), k) * trellis.SCALES[k - 1]  # the stored code
            cells = [f"{(_search_path(x, k, values, True, w or n) - x).square().mean().item():.5f}" for w in windows]
            print(f"| {n} | {k} | " + " | ".join(cells) + " |", flush=True)


def encode_time(device: str = "cpu", shape: str = "4,1728,128") -> None:
    """The `--encode-time` figure: seconds to code one span (heads x tokens x head dim, `shape`) as quantwm-trellis
    codes its Values at commit (unit-Gaussian samples, widths 0-8 drawn at random, every grid unclipped; generator
    seed 0): the searches, each channel's choice of trellis or grid with the stretch, the packing. On the CPU its
    PyTorch path on one thread; on CUDA (`--device cuda`) its Triton kernels, timed after one untimed call (the
    compile) with the device synchronised around the timed one."""
    import time

    from quantwm.core.layouts.trellis import TrellisChannels

    try:
        H, N, D = (int(v) for v in shape.split(","))
    except ValueError:
        raise SystemExit(f"--shape takes heads,tokens,head_dim, got {shape!r}") from None
    if min(H, N, D) < 1:
        raise SystemExit(f"--shape needs positive sizes, got {shape!r}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    g = torch.Generator().manual_seed(0)
    r, bits = torch.randn(H, N, D, generator=g).to(dev), torch.randint(0, 9, (H, D), generator=g).to(dev)
    alpha = torch.ones(H, D, device=dev)
    if dev.type == "cuda":
        TrellisChannels.code(r, bits, alpha, unbias=True)  # the first call compiles the kernels
        torch.cuda.synchronize(dev)
        where = torch.cuda.get_device_name(dev)
    else:
        torch.set_num_threads(1)
        where = "one CPU thread"
    start = time.perf_counter()
    TrellisChannels.code(r, bits, alpha, unbias=True)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    print(f"one span of {H} x {N} x {D} coded in {time.perf_counter() - start:.3f} s ({where})")


def tails(path: str, budget: float) -> None:
    """The `--tails` table: quantwm's and quantwm-trellis's Keys committed from a trace as `quantwm analyze` commits
    them at `budget`, and the squared error of every quantized key element binned by how extreme it is in its
    span's channel (|z|, its distance from the channel's mean over its standard deviation; bins at quantiles 0.5,
    0.9, 0.99 and 0.999 of |z|)."""
    from quantwm.evaluation.analyze import keys_config, layer_keys, quantized_spans
    from quantwm.evaluation.trace import read_trace

    trace = read_trace(path)
    parts = {}
    for m in ("quantwm", "quantwm-trellis"):
        config, chunk = keys_config(trace, m, budget)
        rows = []
        for layer in trace.layers:
            cache, k, k_hat, _ = layer_keys(trace, layer, config, chunk)
            for span in quantized_spans(cache):
                x = k[:, span]
                z = (x - x.mean(1, keepdim=True)) / x.std(1, keepdim=True).clamp_min(1e-6)
                rows.append(torch.stack([z.abs().flatten(), (k_hat[:, span] - x).square().flatten()]))
        parts[m] = torch.cat(rows, 1)
    z = parts["quantwm"][0]
    qs = [0.0, 0.5, 0.9, 0.99, 0.999, 1.0]
    edges = torch.sort(z).values[[min(len(z) - 1, int(q * len(z))) for q in qs]]
    print(f"{path}, Keys at {budget:g} bits\n| quantiles of abs(z) | abs(z) | quantwm MSE | quantwm-trellis MSE | ratio |"
          "\n|---|---|---|---|---|")
    for i in range(len(qs) - 1):
        sel = (z >= edges[i]) & (z <= edges[i + 1])
        g, t = parts["quantwm"][1][sel].mean().item(), parts["quantwm-trellis"][1][sel].mean().item()
        print(f"| {qs[i]:g}-{qs[i + 1]:g} | {edges[i]:.2f}-{edges[i + 1]:.2f} | {g:.3e} | {t:.3e} | {t / g:.2f} |")


def price(path: str, budget: float) -> None:
    """The `--price` table: quantwm-trellis's Keys committed from a trace as `quantwm analyze` commits them at
    `budget`; for every coded residual (TrellisChannels.code is wrapped to see it), each channel's squared error as
    stored (its trellis code, or its grid where that codes it better: at most 1) against its uniform grid's at the
    same width (the allocator's error table), summed per width: the ratio the allocator assumed (ERROR_RATIO,
    measured on Gaussian samples) against the real one."""
    from quantwm.core import trellis
    from quantwm.core.allocate import error_tables
    from quantwm.core.layouts import trellis as layout
    from quantwm.evaluation.analyze import keys_config, layer_keys
    from quantwm.evaluation.trace import read_trace

    sums = torch.zeros(3, len(trellis.WIDTHS) + 1, dtype=torch.float64)  # trellis error, grid error, channels
    original = layout.TrellisChannels.__dict__["code"]
    code = original.__func__

    def measured(cls, r, bits, alpha=None, capacity=None, unbias=False):
        out = code(cls, r, bits, alpha, capacity, unbias)
        grid = error_tables(r)[0].gather(2, bits.long()[..., None])[..., 0]
        real = (out.decode() - r.float()).square().sum(1)
        for k in trellis.WIDTHS:
            sel = bits == k
            sums[:, k] += torch.tensor([real[sel].sum().item(), grid[sel].sum().item(), sel.sum().item()])
        return out

    trace = read_trace(path)
    config, chunk = keys_config(trace, "quantwm-trellis", budget)
    layout.TrellisChannels.code = classmethod(measured)
    try:
        for layer in trace.layers:
            layer_keys(trace, layer, config, chunk)
    finally:
        layout.TrellisChannels.code = original
    print(f"{path}, Keys at {budget:g} bits\n| width | channels | stored error / its grid's | the price's ratio |"
          "\n|---|---|---|---|")
    for k in trellis.WIDTHS:
        if sums[2, k]:
            print(f"| {k} | {int(sums[2, k])} | {sums[0, k] / sums[1, k]:.3f} | {trellis.ERROR_RATIO[k]} |")


def _states(codes: torch.Tensor, k: int, start: torch.Tensor, L: int) -> torch.Tensor:
    """The shift register's states (M, N) of L bits along codes (M, N) of width k from the states `start` (M,)."""
    state, out = start, []
    for t in range(codes.shape[1]):
        state = (state >> k) | (codes[:, t] << (L - k))
        out.append(state)
    return torch.stack(out, 1)


def _search_path(x: torch.Tensor, k: int, values: torch.Tensor, tail: bool, window: int | None = None) -> torch.Tensor:
    """The decoded least-error path of every row of x (M, N) (N k >= L) at width k through the trellis whose 2^L
    states decode to `values`: tail-biting as quantwm-trellis stores it (its start searched over `window` samples
    either side of the wrap; None: the library's), or from state 0."""
    from quantwm.core import trellis

    L = values.numel().bit_length() - 1
    start = torch.zeros(x.shape[0], dtype=torch.long)
    if tail:
        start = trellis.wrap_states(x, lambda w: trellis.viterbi(w, k, values, states=True),
                                    window or trellis.WRAP_TOKENS)
    return values[_states(trellis.viterbi(x, k, values, start if tail else None), k, start, L)]


def on_trace(path: str, budget: float) -> None:
    """The module docstring's `--trace` comparison, printed as a table."""
    import bits_above_bound as B

    from quantwm.core.layouts.channels import channel_grid
    from quantwm.evaluation.metrics import second_moment
    from quantwm.evaluation.trace import read_trace

    tr = read_trace(path)
    t = tr.layers[0]
    span = int(tr.meta.get("chunk_frames", 1)) * tr.tokens_per_frame
    k, q = t["k"].double(), t["q"].double()
    rows = {"uniform": [], "tcq": []}
    for chunk in (1, 2):
        keys = k[:, chunk * span:(chunk + 1) * span]
        S = second_moment(t["q_hist"][:, t["q_hist_chunk"] <= chunk].float()).double()
        U = torch.linalg.eigh(S).eigenvectors.flip(-1)
        mean = keys.mean(1, keepdim=True)
        y = ((keys - mean) @ U).float()
        E, A = B.uniform_tables(y)
        widths, _ = B.allocated(torch.einsum("sdi,sde,sei->si", U, S, U)[..., None] * E, span, budget)
        alpha = A.gather(2, widths[..., None])[..., 0]
        low, step = channel_grid(y.amin(1), y.amax(1), widths.float(), alpha)
        for name, yh in (("uniform", B.uniform_decode(y, widths, alpha).double()),
                         ("tcq", tcq_decode_path(y, widths, low, step))):
            e = yh @ U.transpose(1, 2) + mean - keys
            exact, coded = q @ keys.transpose(1, 2), q @ (keys + e).transpose(1, 2)
            rows[name].append([torch.einsum("sni,sij,snj->", e, S, e).item() / e[..., 0].numel(),
                               (exact - coded).square().mean().sqrt().item(),
                               (exact.argmax(-1) != coded.argmax(-1)).double().mean().item()])
    print(f"{path}, {budget:g} bits per element of code, chunks 1-2:\n| coder | weighted error | logit RMSE | top-1 shift |"
          "\n|---|---|---|---|")
    for name, values in rows.items():
        m = torch.tensor(values).mean(0).tolist()
        print(f"| {name} | {m[0]:.4f} | {m[1]:.4f} | {m[2]:.4f} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--length", type=int, default=1728)
    ap.add_argument("--trace", default=None, help="compare on this synthetic trace's Keys instead (docstring)")
    ap.add_argument("--budget", type=float, default=2.5)
    ap.add_argument("--tables", action="store_true", help="measure quantwm/core/trellis.py's constants (docstring)")
    ap.add_argument("--state-bits", type=int, default=None, help="--tables for a trellis of 2^L states (4-12)")
    ap.add_argument("--trained", action="store_true", help="smaller trellises with trained tables (docstring)")
    ap.add_argument("--restarts", type=int, default=4, help="--trained: random starts of each table's training")
    ap.add_argument("--save", default=None, help="--trained: write the trained tables to this JSON file")
    ap.add_argument("--source", default="gauss", help="--trained: train on gauss or mixture (Gaussian and Laplacian)")
    ap.add_argument("--widths", default="1,2,3,4", help="--trained: these widths (of 1-4)")
    ap.add_argument("--laplace", default=None, help="saved tables' error on Laplacian samples (docstring)")
    ap.add_argument("--probe", nargs=argparse.REMAINDER, default=None,
                    help="TABLES.json|stored M EVAL-ARGS...: quantwm eval with trained tables of memory M (docstring)")
    ap.add_argument("--emit", nargs=3, default=None, metavar=("TABLES.json", "M", "OUT.py"),
                    help="write the memory-M tables of a --trained --save file as kernels/trellis_tables.py")
    ap.add_argument("--warmup", action="store_true", help="the trellis's error by token position (docstring)")
    ap.add_argument("--wrap", action="store_true", help="the tail-biting start's search window (docstring)")
    ap.add_argument("--encode-time", action="store_true", help="seconds to code one span here (docstring)")
    ap.add_argument("--device", default="cpu", help="--encode-time on this device (cpu or cuda)")
    ap.add_argument("--shape", default="4,1728,128", help="--encode-time's span: heads,tokens,head_dim")
    ap.add_argument("--tails", default=None, help="a trace: the trellis's key error by how extreme an element is")
    ap.add_argument("--price", default=None, help="a trace: the trellis's real error against its price per width")
    a = ap.parse_args(argv)
    if a.state_bits is not None and not a.tables:
        ap.error("--state-bits goes with --tables")
    if (a.save is not None or a.restarts != 4 or a.source != "gauss" or a.widths != "1,2,3,4") and not a.trained:
        ap.error("--restarts, --save, --source and --widths go with --trained")
    if a.laplace:
        return on_laplace(a.laplace)
    if a.tables:
        return bitshift_tables(a.state_bits)
    if a.emit is not None:
        if not a.emit[1].isdigit() or int(a.emit[1]) not in TRAINED_MEMORY:
            ap.error(f"--emit takes TABLES.json, a memory of {TRAINED_MEMORY} and the module to write")
        return emit(a.emit[0], int(a.emit[1]), a.emit[2])
    if a.probe is not None:
        if len(a.probe) < 2 or not a.probe[1].isdigit() or int(a.probe[1]) not in TRAINED_MEMORY:
            ap.error(f"--probe takes TABLES.json (or 'stored'), a memory of {TRAINED_MEMORY} and eval's arguments")
        raise SystemExit(probe(None if a.probe[0] == "stored" else a.probe[0], int(a.probe[1]), a.probe[2:]))
    if a.trained:
        try:
            widths = tuple(int(w) for w in a.widths.split(","))
        except ValueError:
            ap.error(f"--widths takes widths like 1,2,3,4, got {a.widths!r}")
        return trained_tables(a.restarts, a.save, a.source, widths)
    if a.warmup:
        return warmup()
    if a.wrap:
        return wrap_window()
    if a.encode_time:
        return encode_time(a.device, a.shape)
    if a.tails:
        return tails(a.tails, a.budget)
    if a.price:
        return price(a.price, a.budget)
    if a.trace:
        return on_trace(a.trace, a.budget)
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
