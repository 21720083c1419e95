"""Attention of a chunk's queries over a KVCache, span by span, without decompressing the cache.

The fused path: every cached span (sink, quantized chunks, recent chunk, the current chunk) is folded into
one online softmax by `span_attention` (kernels/span_attention.py on the fast path) or its twin
`span_attention_ref` here. The kernel reads each span's `kernel_side` (kernels/span_args.py), which its layout
(quantwm/core/layouts) built once, when the span was committed; the twin reads the layout itself. The state
holds P splits of every span (flash-decoding) that `merge_splits` combines at the end.

Supported spans: full precision, and every layout with a kernel side: group quantization with 2/4/8-bit codes
(per-token groups a power of two dividing D) and at most one codebook stage, with PSAC coefficients scaled
per direction (rtn, kivi, the qvg presets but qvg-pro, quantwm and its ablations, +jensen), and QuantWM's
allocator at a budget (`Channels`: mixed-width per-channel codes, in the model's basis or, `InBasis`, in the
history Queries' basis: the span's queries are rotated once per basis, q U, and the kernel reads the coded
coordinates, (q U)·ŷ = q·k̂). Anything else (qvg-pro's 4 stages, 3-bit codes,
a group size the kernel cannot take, quantwm-paper's per-token PSAC scales, the deployed formats) takes the
cache's reference path; the dispatcher only asks the layout. Keys must be stored post-RoPE: with pre-RoPE keys
the PSAC term would need Uᵀ applied to the query rotated back to every key's position (a D x R product per
key instead of R MACs), so pre-RoPE caches also take the reference path (dequantize, rotate, SDPA).

`lowp="int8"` or `"e4m3"` (CacheConfig.lowp) runs both products on 8-bit operands with fp32 accumulation, the
rounding points of quantwm/core/fp8.py: quantized keys whose layout `reads_codes` enter QKᵀ as their integer
codes; the others are centred on their layout's `center` (read off its stored parameters, no decode pass).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..kernels.span_args import CHANNELS, GROUPED, PsacArgs
from . import selfcheck
from .backend import kernel
from .fp8 import code_dots, lowp_dots, pv_fold
from .layouts import Full, Layout, TokenSplit
from .quant import unpack_bits_ref

LOG2E = math.log2(math.e)


def chunk_spans(cache, layer: int) -> list[tuple[Layout, Layout]] | None:
    """Every span of `layer` as (key layout, value layout); None if a layout has no kernel side (the reference
    path reads it). Full-precision chunks are wrapped as they are (a view, no copy); quantized spans carry the
    kernel side their layout built at commit."""
    out = []
    for c in cache.spans(layer):
        B, H, D = c.bhd
        k, v = (Full(full.reshape(B * H, c.n_tokens, D)) if full is not None else enc
                for full, enc in ((c.k, c.k_enc), (c.v, c.v_enc)))
        for pair in token_parts(k, v):
            if any(p.kernel_side is None for p in pair) or pair[1].coded()[0] is not None:  # outputs sum in one basis
                return None
            out.append(pair)
    return out


def token_parts(k: Layout, v: Layout) -> list[tuple[Layout, Layout]]:
    """A span as the spans attention reads: itself, or, where its Keys hold loud tokens apart (`TokenSplit`), the
    coded rest and the loud tokens in BF16, each with its Values (split at the same tokens; a sum over tokens does
    not care for their order)."""
    if not isinstance(k, TokenSplit):
        return [(k, v)]
    if isinstance(v, TokenSplit):
        return [(k.rest, v.rest), (Full(k.loud), Full(v.loud))]
    if not isinstance(v, Full):
        raise ValueError(f"Keys split at loud tokens need their Values split alike or in full precision, got "
                         f"{v.describe()}")
    rest, loud = v.data[:, k.kept()], v.data[:, k.index.long()]
    return [(k.rest, Full(rest)), (Full(k.loud), Full(loud))]


def span_logits(q: torch.Tensor, k: Layout, scale: float, psac: PsacArgs | None = None, jensen: bool = False,
                lowp: str | None = None) -> torch.Tensor:
    """The logits (S, Nq, N) in log2 units that the kernel computes for one span (q (S, Nq, D)): q·k̂ exact, or
    through `lowp`'s rounding ("int8", "e4m3", or "bf16": bf16 operands, the BF16 kernel's products), plus the
    PSAC and Jensen terms in fp32. `k` is the layout the kernel rebuilds (`Layout.keys_read`)."""
    qf = q.float()
    if lowp in ("int8", "e4m3") and k.reads_codes(lowp):
        dots = code_dots(qf, k.code_form(), lowp)
    else:
        K = k.decode()
        dots = qf @ K.transpose(1, 2) if lowp is None else lowp_dots(qf, K, k.center, lowp)  # (S, Nq, N)
    if psac is not None:
        R = psac.qs.shape[-1]
        a = unpack_bits_ref(psac.codes, psac.bits, R).float()  # (S, N, R)
        dots = dots + psac.qs @ a.transpose(1, 2) + psac.c0[..., None]
    logits = dots * (scale * LOG2E)
    if jensen:
        step = k.step()
        logits = logits - (scale ** 2 / 24 * LOG2E) * (qf.square() @ step.square().transpose(1, 2))
    return logits


def span_attention_ref(q: torch.Tensor, acc: torch.Tensor, m: torch.Tensor, l: torch.Tensor, k: Layout, v: Layout,
                       scale: float, psac: PsacArgs | None = None, jensen: bool = False, lowp: str | None = None) -> None:
    """PyTorch twin of kernels.span_attention.span_attention: the same fold, reading the layouts (`k` the keys
    the kernel rebuilds, `Layout.keys_read`) where the kernel reads their sides; folds into split 0. With `lowp`
    it is the low-precision path's emulation (quantwm/core/fp8.py), which the kernel matches with one split."""
    logits = span_logits(q, k, scale, psac, jensen, lowp)
    V = v.decode()
    m0, l0, a0 = m[:, 0], l[:, 0], acc[:, 0]
    if lowp is not None:
        pv_fold(logits, V, m0, l0, a0)  # views: updates split 0 in place
        return
    m_new = torch.maximum(m0, logits.amax(-1))
    alpha = torch.exp2(m0 - m_new)
    p = torch.exp2(logits - m_new[..., None])
    l[:, 0] = l0 * alpha + p.sum(-1)
    acc[:, 0] = a0 * alpha[..., None] + p @ V
    m[:, 0] = m_new


def jensen_bias(q: torch.Tensor, steps: torch.Tensor | None, scale: float) -> torch.Tensor | None:
    """-(τ²/24) Σ_i q_i² Δ_{j,i}²: q (..., Nq, D), steps Δ (..., L, D) -> (..., Nq, L); None without steps."""
    if steps is None:
        return None
    return -(scale ** 2 / 24) * (q.float().square() @ steps.float().square().transpose(-1, -2))


def new_state(S: int, P: int, Nq: int, D: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An empty softmax state of P splits: acc (S, P, Nq, D) 0, m (S, P, Nq) -inf, l (S, P, Nq) 0."""
    return (torch.zeros(S, P, Nq, D, device=device), torch.full((S, P, Nq), float("-inf"), device=device),
            torch.zeros(S, P, Nq, device=device))


def merge_splits(acc: torch.Tensor, m: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
    """Combine the P splits of a softmax state: (S, P, Nq, D), (S, P, Nq) x2 -> output (S, Nq, D)."""
    M = m.amax(1, keepdim=True)
    w = torch.exp2(m - M).nan_to_num(0.0)  # empty splits (m = -inf) weigh 0
    return (acc * w[..., None]).sum(1) / (l * w).sum(1)[..., None]


def n_splits(S: int, Nq: int, target_programs: int = 256) -> int:
    """Splits of each span so that (streams x query blocks x splits) fills a GPU; 1 for long chunks."""
    programs = S * -(-Nq // 64)
    return max(1, min(8, -(-target_programs // programs)))


def fused_attention(cache, layer: int, q: torch.Tensor, scale: float, use_kernel: bool = True,
                    lowp: str | None = None) -> torch.Tensor | None:
    """Attention of q (B, H, Nq, D) (post-RoPE) over every span of `layer`; None if a span is unsupported.
    `lowp`: the low-precision path (8-bit products; on the reference side its emulation)."""
    spans = chunk_spans(cache, layer)
    if spans is None:
        return None
    B, H, Nq, D = q.shape
    qs = q.reshape(B * H, Nq, D)
    acc, m, l = new_state(B * H, n_splits(B * H, Nq) if use_kernel else 1, Nq, D, q.device)
    rotated = {}  # the queries in each basis a span is coded in, once per basis
    for k, v in spans:
        jensen = cache.config.jensen and k.quantized
        U, k = k.coded()
        if U is not None and id(U) not in rotated:
            rotated[id(U)] = torch.bmm(qs.float(), U).to(qs.dtype)
        qk = qs if U is None else rotated[id(U)]
        if use_kernel:
            fold_checked(qk, (acc, m, l), k, v, scale, jensen, lowp)
        else:
            span_attention_ref(qk, acc, m, l, k.keys_read(), v, scale, psac=k.psac_args(qk), jensen=jensen, lowp=lowp)
    return merge_splits(acc, m, l).reshape(B, H, Nq, D)


def side_key(side) -> str:
    """A kernel side's form as the self-check keys it: what decides which code the kernel runs."""
    if side.form != CHANNELS and side.form != GROUPED:
        return "full"
    if side.form == CHANNELS:
        return "channels" + (" +codebook" if side.codebook is not None else "")
    grid = "symmetric" if side.symmetric else "asymmetric"
    along = "tokens" if side.axis_token else "channels"
    return f"{side.bits}-bit {grid} groups of {side.group_size} along {along}" + (
        " +codebook" if side.codebook is not None else "")


def fold_checked(qs: torch.Tensor, state: tuple, k: Layout, v: Layout, scale: float, jensen: bool,
                 lowp: str | None) -> None:
    """One span through the kernel, its first use per (layout, dtype, device, shape class) checked against the
    reference on the first queries (quantwm/core/selfcheck.py); a layout whose check failed folds through the
    reference."""
    acc, m, l = state
    psac = k.psac_args(qs)
    layout = (f"k: {side_key(k.kernel_side)}" + (" +psac" if psac is not None else "") + (" +jensen" if jensen else "")
              + f"; v: {side_key(v.kernel_side)}" + (f"; lowp={lowp}" if lowp else ""))

    def fast():
        kernel("span_attention")(qs, acc, m, l, k.kernel_side, v.kernel_side, scale, psac=psac, jensen=jensen,
                                 lowp=lowp, center=k.center if lowp is not None else None)

    def ref():
        span_attention_ref(qs, acc, m, l, k.keys_read(), v, scale, psac=psac, jensen=jensen, lowp=lowp)

    shape = selfcheck.shape_class("span_attention", Nq=qs.shape[1], N=k.shape[1], D=qs.shape[2])
    selfcheck.run("span_attention", layout, qs, fast, ref, lambda: attention_check(qs, k, v, scale, jensen, lowp),
                  shape=shape)


def attention_check(qs: torch.Tensor, k: Layout, v: Layout, scale: float, jensen: bool,
                    lowp: str | None) -> tuple[float, float, str]:
    """(the kernel's error, the error allowed, shapes) on the first queries over span (k, v) alone (one tile of
    them plus the call's remainder: selfcheck.sample_length), one split: against float64 attention over the
    decoded span, the kernel may err twice as much as the same attention in the input dtype (plus ATTENTION_FLOOR
    of the output); with `lowp`, against its emulation."""
    q = qs[:, :selfcheck.sample_length("span_attention", "Nq", qs.shape[1])]
    S, Nq, D = q.shape

    def fold(fn, **kw) -> torch.Tensor:
        acc, m, l = new_state(S, 1, Nq, D, q.device)
        fn(acc, m, l, **kw)
        return merge_splits(acc, m, l).double()

    out = fold(lambda acc, m, l: kernel("span_attention")(q, acc, m, l, k.kernel_side, v.kernel_side, scale,
                                                           psac=k.psac_args(q), jensen=jensen, lowp=lowp,
                                                           center=k.center if lowp is not None else None))
    shapes = f"{S} streams x {Nq} queries x {k.shape[1]} keys x {D}"
    if lowp is not None:
        emulated = fold(lambda acc, m, l: span_attention_ref(q, acc, m, l, k.keys_read(), v, scale,
                                                             psac=k.psac_args(q), jensen=jensen, lowp=lowp))
        return float((out - emulated).abs().max()), selfcheck.LOWP_TOLERANCE * float(emulated.abs().max()), shapes
    K, V = k.decode(), v.decode()
    bias = jensen_bias(q, k.step(), scale) if jensen else None
    exact = F.scaled_dot_product_attention(q.double(), K.double(), V.double(), scale=scale,
                                           attn_mask=None if bias is None else bias.double())
    low = F.scaled_dot_product_attention(q, K.to(q.dtype), V.to(q.dtype), scale=scale,
                                         attn_mask=None if bias is None else bias.to(q.dtype))
    err_low = float((low.double() - exact).abs().max())
    allowed = 2 * err_low + selfcheck.ATTENTION_FLOOR * float(exact.abs().max())
    return float((out - exact).abs().max()), allowed, shapes
