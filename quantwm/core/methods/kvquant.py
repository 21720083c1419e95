"""KVQuant (Hooper, Kim, Mohammadzadeh, Mahoney, Shao, Keutzer, Gholami, "KVQuant: Towards 10 Million Context Length
LLM Inference with KV Cache Quantization", arXiv 2401.18079) as the `kvquant` preset. Released code read:
SqueezeAILab/KVQuant (quant/kvquant/simquant_module_quantizer.py, quant/llama_simquant.py, its README).

Keys are coded per channel and before RoPE (`pre_rope`: the cache must run rope="pre"), Values per token. A "row"
is one channel of the span's Keys (its N tokens) or one token of its Values (its D channels). Per row:

1. Dense-and-sparse: the k largest and the k smallest elements are outliers, kept exactly (fp16, their positions in
   the row int16; int32 past 32767), k = ⌊(L − 1) · outliers / 2⌋ + 1 of a row of L elements (0 at outliers=0): the
   count the release's `get_outliers_dynamic` keeps with its torch.quantile thresholds at `1 − outliers / 2` and
   `outliers / 2` (`>=` / `<=`), ties aside, so 1% keeps 9 + 9 of a 1728-token channel and 1 + 1 of a 128-channel
   token. k is at most (L − 1) // 2, so that one element of each row is coded.
2. The row's other elements span [lo, hi]; centre (hi + lo) / 2 and half range (hi − lo) / 2, fp16, normalise it
   to u ∈ [−1, 1] (the release's offset and `rangeval`); outliers' slots are coded at u = 0, as the release zeroes
   them before it rounds (their dense code is stored and overwritten at decode).
3. Non-uniform datatype ("nuq"): u is rounded to the nearest of 2^bits levels, a codebook fitted by weighted 1-D
   k-means (Lloyd, `iters` updates from the uniform grid, outliers left out) on the span's normalised values, one
   per stream. Keys' weights are the history Queries' second moment on the element's channel, S_jj
   (SpanContext.stats, in the pre-RoPE keys' space), when the cache gives S; Values' are 1.
4. Q-Norm (`qnorm`; None: at 2 bits only, as the release's 2-bit checkpoints): the levels are mapped by the affine
   map that gives the coded values the mean and standard deviation of u (outliers left out), folded into the
   stored codebook: no bytes.

Stored and counted, per span of S streams, N tokens, head dim D, b bits, R rows, k outliers a side: the codes
(S, N, ⌈D b / 8⌉) uint8, packed along the channels; the codebook (S, 2^b) fp16; centre and half range (S, R) fp16
each; the outliers' values (S, R, 2k) fp16 and positions (S, R, 2k) int16. fp16 tensors are widened to fp32 where
fp16 cannot hold them (quant.to_storage), which the bytes count.

Worked example: D = 128, N = 1728, 2 bits, 1%. Keys: 55296 bytes of codes, 8 of codebook, 512 of centres and
ranges, 128 channels × 18 outliers × 4 bytes = 9216: 2.352 bits per element. Values: the same codes and codebook,
1728 × 4 = 6912 bytes of centres and ranges, 1728 tokens × 2 outliers × 4 bytes = 13824: 2.750 bits per element.

Deviations from the paper and the release, named:
* No calibration. The release fits, offline per layer (k_proj / v_proj, every head together), the Keys' per-channel
  outlier thresholds and the codebook of each kind on a calibration set, the codebook by k-means weighted by the
  Fisher information of each activation (gradients of the loss), and serves them fixed. Here, training-free, the
  Keys' thresholds are computed per span over its tokens (as the release computes the Values' per token online),
  and the codebook is fitted per span and stream on that span's own values, its bytes counted. S_jj stands for the
  Fisher weight: a key's gradient is Σ_q (∂L/∂logit) q, whose square's expectation on channel j goes as E[q_j²];
  Values have no such statistic here and go unweighted. As in the release, the weights multiply the normalised
  values' squared errors (no range² factor), so the codebook serves the loud channels' shape, not their scale.
  The k-means starts from the uniform grid with a fixed number of updates (sklearn's k-means++, max_iter 50, in the
  release). Q-Norm's moments are per span and stream too (per layer on the calibration set in the release).
* Outlier positions are int16 (int32 past 32767): a row's count is fixed, so no row pointers are stored; the
  paper keeps its outliers in CSR/CSC form (indices and row offsets), more bytes than here.
* Attention-sink awareness (the release's `first_few_fp16`, the first token(s) in fp16): the cache's sink chunk
  (`sink_chunks`, whole chunks in BF16), as for kivi. The release's per-token outlier cap (`cap_outliers`) is off by
  default there and not built here. Bits 2, 3, 4 (the paper's nuq2/3/4; the release also takes 5).
* The fused kernel does not read this form (`kernel_side` is None): spans take the reference path.

The layout is `NuqSpan` (below, with the method: one file).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layouts import Layout
from ..quant import pack_bits_ref, to_storage, unpack_bits_ref
from .base import Method, SpanContext, register

KVQUANT_BITS = (2, 3, 4)  # the paper's nuq2, nuq3, nuq4
OUTLIER_FRACTIONS = (0.01, 0.0)  # the paper's "-1%" configurations, and none (dense only)


def outlier_count(row_length: int, fraction: float) -> int:
    """Outliers kept on each side (largest, smallest) of a row of `row_length` elements at `fraction` (see the
    module): ⌊(L − 1) f / 2⌋ + 1, 0 at f = 0, at most (L − 1) // 2."""
    if fraction <= 0:
        return 0
    return min(int((row_length - 1) * fraction / 2) + 1, (row_length - 1) // 2)


@dataclass(frozen=True, eq=False)
class NuqSpan(Layout):
    """codes (S, N, ⌈D b / 8⌉) uint8; codebook (S, 2^b) fp16, the levels of normalised values; centre and half_range
    (S, R) fp16 per row; outlier_values (S, R, 2k) fp16 and outlier_index (S, R, 2k) int16 (their positions in the
    row); per_channel: rows are channels (Keys, R = D, L = N) or tokens (Values, R = N, L = D); bits; head_dim D."""

    codes: torch.Tensor
    codebook: torch.Tensor
    centre: torch.Tensor
    half_range: torch.Tensor
    outlier_values: torch.Tensor
    outlier_index: torch.Tensor
    per_channel: bool
    bits: int
    head_dim: int

    @property
    def shape(self) -> tuple[int, int, int]:
        return (*self.codes.shape[:2], self.head_dim)

    def components(self) -> dict[str, torch.Tensor]:
        return {"nuq_codes": self.codes, "nuq_codebook": self.codebook, "nuq_centre": self.centre,
                "nuq_range": self.half_range, "sparse_values": self.outlier_values, "sparse_index": self.outlier_index}

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        """(S, N, D) <-> the row view (S, R, L): Keys' rows are channels, Values' tokens."""
        return t.transpose(1, 2) if self.per_channel else t

    def levels(self) -> torch.Tensor:
        """Every element's normalised level (S, R, L) float32, outliers' slots included."""
        S, N, D = self.shape
        ids = unpack_bits_ref(self.codes, self.bits, D).reshape(S, N * D)
        return self._rows(torch.gather(self.codebook.float(), 1, ids).reshape(S, N, D))

    def decode(self) -> torch.Tensor:
        x = self.levels() * self.half_range.float()[..., None] + self.centre.float()[..., None]  # (S, R, L)
        if self.outlier_index.shape[-1]:
            x = x.scatter(2, self.outlier_index.long(), self.outlier_values.float())
        return self._rows(x).contiguous()

    def step(self) -> torch.Tensor:
        """Per element, the width of its level's cell (half the gap to each neighbour level, the full gap at the
        ends) times its row's half range: the uniform grid's step where the levels are uniform; 0 at outliers."""
        S, N, D = self.shape
        c = self.codebook.float()  # (S, K) ascending
        gaps = c[:, 1:] - c[:, :-1]
        width = torch.cat([gaps[:, :1], (gaps[:, 1:] + gaps[:, :-1]) / 2, gaps[:, -1:]], 1)  # (S, K)
        ids = unpack_bits_ref(self.codes, self.bits, D).reshape(S, N * D)
        w = self._rows(torch.gather(width, 1, ids).reshape(S, N, D)) * self.half_range.float()[..., None]
        if self.outlier_index.shape[-1]:
            w = w.scatter(2, self.outlier_index.long(), 0.0)
        return self._rows(w).contiguous()

    def describe(self) -> str:
        rows = "per channel" if self.per_channel else "per token"
        k = self.outlier_index.shape[-1]
        return (f"{self.bits}-bit non-uniform codebook ({2 ** self.bits} levels) {rows}, "
                f"{k} outlier(s) a row in fp16 with their positions")


@register("kvquant")
@dataclass(frozen=True)
class KVQuant(Method):
    name = "kvquant"
    source = ("KVQuant, arXiv 2401.18079; github.com/SqueezeAILab/KVQuant (training-free: no calibration set, the "
              "Keys' outlier thresholds per span and the nuq codebook per span and stream by k-means weighted by "
              "the history Queries' S_jj for the Fisher information; int16 outlier positions; the release's fp16 "
              "first token is the cache's sink chunk)")
    pre_rope = True
    sweep = tuple({"outliers": f} for f in OUTLIER_FRACTIONS)  # on top of the frontier's bits 2, 3, 4
    bits: int = 2
    outliers: float = 0.01  # the fraction of each row kept exactly, half above and half below (the paper's 1%)
    sensitivity: bool = True  # weight the Keys' k-means by S_jj (the Fisher weighting's stand-in); False: unweighted
    qnorm: bool | None = None  # Q-Norm; None: at 2 bits only (the release's 2-bit checkpoints)
    iters: int = 50  # Lloyd updates of the codebook (the release's k-means max_iter)

    def __post_init__(self):
        if self.bits not in KVQUANT_BITS:
            raise ValueError(f"kvquant: unsupported bits={self.bits!r}; allowed: {', '.join(map(str, KVQUANT_BITS))}")
        if isinstance(self.outliers, bool) or not isinstance(self.outliers, int | float) \
                or not 0 <= self.outliers < 0.5:
            raise ValueError(f"kvquant: outliers is the fraction of each row kept exactly, in [0, 0.5), got "
                             f"{self.outliers!r}")
        for name in ("sensitivity", "qnorm"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (name == "qnorm" and value is None):
                raise ValueError(f"kvquant: {name} must be True or False{' or None' if name == 'qnorm' else ''}, "
                                 f"got {value!r}")
        if isinstance(self.iters, bool) or not isinstance(self.iters, int) or self.iters < 1:
            raise ValueError(f"kvquant: iters must be an integer >= 1, got {self.iters!r}")

    @property
    def uses_queries(self) -> bool:
        """The Keys' codebook reads S (its diagonal) when `sensitivity` is on."""
        return self.sensitivity

    @property
    def q_norm(self) -> bool:
        return self.bits == 2 if self.qnorm is None else self.qnorm

    @classmethod
    def budget_candidates(cls, head_dim: int, kind: str) -> list[dict]:
        """Bits 4, 3, 2 (the paper's nuq4, nuq3, nuq2), each with 1% outliers, then none (its "-1%" and dense
        configurations). At head dim 128 and 1728-token spans: Keys 4.353, 4.020, 3.352, 3.019, 2.352, 2.019 bits per
        element; Values 4.751, 4.251, 3.751, 3.251, 2.750, 2.250 (per-token centres and ranges cost 0.25, the two
        outliers a token 0.5; the codebook's 8 bytes put the last 0.0003 above 2.25)."""
        return [{"bits": b, "outliers": f} for b in (4, 3, 2) for f in OUTLIER_FRACTIONS]

    def grid(self) -> str:
        qnorm = ", Q-Norm" if self.q_norm else ""
        weights = "S_jj-weighted " if self.sensitivity else ""
        return (f"{self.bits}-bit non-uniform ({2 ** self.bits} levels): Keys per channel (pre-RoPE), Values per "
                f"token, a {weights}k-means codebook per span and stream{qnorm}; {100 * self.outliers:g}% outliers a "
                "row in fp16 with int16 positions; fp16 centres and ranges")

    def weights(self, x: torch.Tensor, kind: str, ctx: SpanContext) -> torch.Tensor:
        """Each row's k-means weight (S, R, 1): the Keys' S_jj on its channel where S is given, else 1."""
        S, N, D = x.shape
        if kind == "k" and self.sensitivity and ctx.stats is not None:
            return ctx.stats_or_identity(S, D, x.device).diagonal(dim1=1, dim2=2).clamp_min(0)[..., None]
        return torch.ones(S, 1, 1, device=x.device)

    def encode(self, x: torch.Tensor, kind: str, ctx: SpanContext) -> Layout:
        self.validate(x, kind)
        S, N, D = x.shape
        per_channel = kind == "k"
        rows = (x.float().transpose(1, 2) if per_channel else x.float()).contiguous()  # (S, N, D) -> (S, R, L)
        L = rows.shape[2]
        k = outlier_count(L, self.outliers)
        hi, lo = rows.topk(k + 1, dim=2), rows.topk(k + 1, dim=2, largest=False)  # (S, R, k + 1) each
        top, bottom = hi.values[..., k], lo.values[..., k]  # the coded elements' max and min (S, R)
        centre = to_storage((top + bottom) / 2, torch.float16)
        half = to_storage((top - bottom) / 2, torch.float16)
        scale = torch.where(half.float() > 0, half.float(), 1.0)
        u = (rows - centre.float()[..., None]) / scale[..., None]  # (S, R, L), the coded elements in [-1, 1]
        keep = torch.ones_like(rows)
        index = torch.cat([hi.indices[..., :k], lo.indices[..., :k]], 2)  # (S, R, 2k)
        keep.scatter_(2, index, 0.0)
        u = u * keep  # outliers' slots at 0, as the release zeroes them
        values = to_storage(torch.gather(rows, 2, index), torch.float16)
        w = keep * self.weights(x, kind, ctx)
        w = torch.where(w.sum((1, 2), keepdim=True) > 0, w, keep)  # a stream with no weight: unweighted
        levels = lloyd_1d(u.reshape(S, -1), w.reshape(S, -1), 2 ** self.bits, self.iters)  # (S, K)
        ids = nearest_level(u.reshape(S, -1), levels)  # (S, R·L)
        if self.q_norm:
            levels = q_norm(u.reshape(S, -1), torch.gather(levels, 1, ids), keep.reshape(S, -1), levels)
        codes = ids.reshape(S, *rows.shape[1:])
        codes = codes.transpose(1, 2) if per_channel else codes  # back to (S, N, D)
        position = torch.int16 if L <= torch.iinfo(torch.int16).max else torch.int32
        return NuqSpan(pack_bits_ref(codes, self.bits), to_storage(levels, torch.float16), centre, half, values,
                       index.to(position), per_channel, self.bits, D)


def lloyd_1d(u: torch.Tensor, w: torch.Tensor, n_levels: int, iters: int) -> torch.Tensor:
    """Weighted 1-D k-means per stream: values u (S, M), weights w (S, M) >= 0 -> levels (S, K) ascending. Starts
    from the uniform grid on [-1, 1] and runs `iters` Lloyd updates as tensor ops (no host read); a level whose
    cell holds no weight stays. 1-D Lloyd keeps the levels in order, so each cell is an interval of the sorted
    values: one sort, then each update reads its cells' weighted sums off prefix sums (fp64) at the cell edges,
    the partition `nearest_level` makes (a value on an edge goes to the lower level)."""
    S, M = u.shape
    us, order = u.sort(1)
    ws = torch.gather(w, 1, order).double()
    zero = torch.zeros(S, 1, dtype=torch.float64, device=u.device)
    cw = torch.cat([zero, ws.cumsum(1)], 1)  # (S, M + 1)
    cwu = torch.cat([zero, (ws * us.double()).cumsum(1)], 1)
    grid = (2 * torch.arange(n_levels, device=u.device, dtype=torch.float32) + 1) / n_levels - 1
    c = grid.expand(S, n_levels).contiguous()
    first, last = torch.zeros(S, 1, dtype=torch.long, device=u.device), torch.full((S, 1), M, device=u.device)
    for _ in range(iters):
        mids = ((c[:, 1:] + c[:, :-1]) / 2).contiguous()
        edges = torch.cat([first, torch.searchsorted(us, mids, right=True), last], 1)  # (S, K + 1)
        den = cw.gather(1, edges[:, 1:]) - cw.gather(1, edges[:, :-1])
        num = cwu.gather(1, edges[:, 1:]) - cwu.gather(1, edges[:, :-1])
        c = torch.where(den > 0, (num / den.clamp_min(1e-300)).float(), c)
    return c


def nearest_level(u: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """The index of each value's nearest level: u (S, M), ascending levels (S, K) -> (S, M) int64."""
    mids = ((levels[:, 1:] + levels[:, :-1]) / 2).contiguous()  # (S, K − 1) cell edges
    return torch.searchsorted(mids, u.contiguous())


def q_norm(u: torch.Tensor, coded: torch.Tensor, keep: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Q-Norm: the levels (S, K) mapped by a·c + b so that the coded values (S, M) take the mean and standard
    deviation of u (S, M) over the kept (non-outlier) elements `keep` (S, M) in {0, 1}."""
    n = keep.sum(1).clamp_min(1)

    def moments(t):
        m = (t * keep).sum(1) / n
        return m, (((t - m[:, None]) * keep).square().sum(1) / n).sqrt()

    (m1, s1), (m2, s2) = moments(u), moments(coded)
    a = torch.where(s2 > 0, s1 / s2.clamp_min(1e-30), 1.0)
    return levels * a[:, None] + (m1 - a * m2)[:, None]
