"""Attention of a chunk's queries over a KVCache, span by span, without decompressing the cache.

The fused path: every cached span (sink, quantized chunks, recent chunk, the current chunk) is folded into
one online softmax by `span_attention` (kernels/span_attention.py on the fast path) or its twin
`span_attention_ref` here, reading the span's stored tensors as they are. The state holds P splits of every
span (flash-decoding) that `merge_splits` combines at the end.

Supported spans: full precision, and every format a method's `fused_format` describes: group quantization
with 2/4/8-bit codes (per-token groups a power of two dividing D) and at most one codebook stage, with
PSAC coefficients scaled per direction (rtn, kivi, the qvg presets but qvg-pro, quantwm and its ablations,
+jensen), and QuantWM's allocator at a budget (mixed-width per-channel codes; `allocate.fused_side`).
Anything else (qvg-pro's 4 stages, 3-bit codes, a group size the kernel cannot take, quantwm-paper's per-token
PSAC scales) takes the cache's reference path; the dispatcher only asks the method. Keys must be stored
post-RoPE: with pre-RoPE keys the PSAC term would need Uᵀ applied to the query rotated back to every key's
position (a D x R product per key instead of R MACs), so pre-RoPE caches also take the reference path
(dequantize, rotate, SDPA).

`lowp="int8"` or `"e4m3"` (CacheConfig.lowp) runs both products on 8-bit operands with fp32 accumulation, the
rounding points of quantwm/core/fp8.py: quantized keys in the layouts `fp8.reads_codes` accepts enter QKᵀ as
their integer codes; the others are centred, so every key side carries a "center", the span's per-channel centre
that `side_center` reads off its stored parameters (no decode pass).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .allocate import decode_fused
from .backend import kernel
from .fp8 import code_dots, lowp_dots, pv_fold, reads_codes
from .methods.qvg import gather_rows
from .quant import GroupQuant, dequantize_groups, group_step, unpack_bits_ref

LOG2E = math.log2(math.e)
PsacFn = Callable[[torch.Tensor], dict]


def chunk_spans(cache, layer: int) -> list[tuple[dict, dict, PsacFn | None]] | None:
    """Every span of `layer` as (key side, value side, PSAC inputs); None if a method says its stored format
    has no fused kernel (`Method.fused_format`)."""
    out = []
    for c in cache.spans(layer):
        B, H, D = c.bhd
        sides = []
        for full, enc, method in ((c.k, c.k_enc, cache.k_method), (c.v, c.v_enc, cache.v_method)):
            side = {"full": full.reshape(B * H, c.n_tokens, D)} if full is not None else method.fused_format(enc, D)
            if side is None:
                return None
            sides.append(side)
        psac = sides[0].pop("psac", None)
        sides[1].pop("psac", None)
        out.append((sides[0], sides[1], psac))
    return out


def side_tokens(side: dict) -> int:
    """How many tokens a side dict holds."""
    if "alloc_codes" in side:
        return side["n_tokens"]
    return (side["full"] if "full" in side else side["codes"]).shape[1]


def side_center(side: dict) -> torch.Tensor:
    """A per-channel centre (S, D) float32 of a side's tokens, from what it stores: the mean of full keys; for
    codes, the mid-grid value (zero + scale (2^b - 1) / 2, 0 for symmetric grids) averaged over the span, plus
    the codebook's mean row. Any centre keeps the low-precision logits exact but for rounding (fp8.lowp_dots);
    this one is cheap and close to the keys' mean."""
    if "full" in side:
        return side["full"].float().mean(1)
    if "alloc_codes" in side:  # the allocator's channels: low end plus half the grid
        bits = side["alloc_meta"] % 16
        c = side["alloc_low"].float() + side["alloc_step"].float() * (2.0 ** bits - 1).clamp_min(0) / 2
        return c + side["codebook"].float().mean(1) if "codebook" in side else c
    sc = side["scales"].float()
    mid = 0 * sc if side["symmetric"] else side["zeros"].float() + sc * ((2 ** side["bits"] - 1) / 2)
    c = mid.mean(1)  # token groups (S, D), or per-token channel groups (S, D / G)
    if side["axis"] != "token":
        c = c.repeat_interleave(side["group_size"], -1)
    if "codebook" in side:
        c = c + side["codebook"].float().mean(1)
    return c


def side_step(side: dict, shape: tuple[int, int, int]) -> torch.Tensor:
    """The grid step (S, N, D) of every key of a quantized side (the Jensen term's Δ; 0 for 0-bit channels)."""
    if "alloc_codes" in side:
        step = torch.where(side["alloc_meta"] % 16 > 0, side["alloc_step"].float(), 0.0)
        return step[:, None, :].expand(shape)
    return group_step(GroupQuant(side["codes"], side["scales"], side.get("zeros"), shape, side["bits"],
                                 side["group_size"], side["axis"], side["symmetric"]))


def decode_side(side: dict, shape: tuple[int, int, int]) -> torch.Tensor:
    """Rebuild (S, N, D) float32 from a side dict (the reference's view of what the kernel reads)."""
    if "full" in side:
        return side["full"].float()
    if "alloc_codes" in side:
        x = decode_fused(side)
        return x + gather_rows(side["codebook"].float(), side["ids"].long()) if "codebook" in side else x
    q = GroupQuant(side["codes"], side["scales"], side.get("zeros"), shape, side["bits"], side["group_size"],
                   side["axis"], side["symmetric"])
    x = dequantize_groups(q)
    if "codebook" in side:
        x = x + gather_rows(side["codebook"].float(), side["ids"].long())
    return x


def span_logits(q: torch.Tensor, k: dict, scale: float, psac: dict | None = None, jensen: bool = False,
                lowp: str | None = None) -> torch.Tensor:
    """The logits (S, Nq, N) in log2 units that the kernel computes for one span (q (S, Nq, D)): q·k̂ exact, or
    through `lowp`'s rounding ("int8", "e4m3", or "bf16": bf16 operands, the BF16 kernel's products), plus the
    PSAC and Jensen terms in fp32."""
    S, Nq, D = q.shape
    N = side_tokens(k)
    qf = q.float()
    if lowp in ("int8", "e4m3") and reads_codes(k, D, lowp):
        dots = code_dots(qf, k, lowp)
    else:
        K = decode_side(k, (S, N, D))
        dots = qf @ K.transpose(1, 2) if lowp is None else lowp_dots(qf, K, k.get("center"), lowp)  # (S, Nq, N)
    if psac is not None:
        R = psac["qs"].shape[-1]
        a = unpack_bits_ref(psac["codes"], psac["bits"], R).float()  # (S, N, R)
        dots = dots + psac["qs"] @ a.transpose(1, 2) + psac["c0"][..., None]
    logits = dots * (scale * LOG2E)
    if jensen:
        step = side_step(k, (S, N, D))
        logits = logits - (scale ** 2 / 24 * LOG2E) * (qf.square() @ step.square().transpose(1, 2))
    return logits


def span_attention_ref(q: torch.Tensor, acc: torch.Tensor, m: torch.Tensor, l: torch.Tensor, k: dict, v: dict,
                       scale: float, psac: dict | None = None, jensen: bool = False, lowp: str | None = None) -> None:
    """PyTorch twin of kernels.span_attention.span_attention (same arguments; folds into split 0). With `lowp`
    it is the low-precision path's emulation (quantwm/core/fp8.py), which the kernel matches with one split."""
    if lowp is not None and k.get("center") is None:
        raise ValueError("lowp needs the keys' centre k['center'] (side_center)")
    logits = span_logits(q, k, scale, psac, jensen, lowp)
    S, Nq, D = q.shape
    V = decode_side(v, (S, logits.shape[-1], D))
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
    fold = kernel("span_attention") if use_kernel else span_attention_ref
    jensen = cache.config.jensen
    for k, v, psac in spans:
        if lowp is not None:
            k = {**k, "center": side_center(k)}
        fold(qs, acc, m, l, k, v, scale, psac=psac(qs) if psac else None, jensen=jensen and "full" not in k,
             lowp=lowp)
    return merge_splits(acc, m, l).reshape(B, H, Nq, D)
