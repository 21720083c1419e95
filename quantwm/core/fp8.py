"""The low-precision attention path's rounding points, in PyTorch: the twin the fused kernel's `lowp` mode is
checked against (kernels/span_attention.py, docs/kernels.md).

A chunk of thousands of queries over a long cache is compute-bound, so reading 2-bit keys cannot by itself make
attention faster than BF16; only cheaper matrix products can. This path runs both products of attention on 8-bit
operands with fp32 accumulation. Per span (a launch of the kernel):

* **Quantized keys are read as their integer codes.** A key rebuilt from b-bit codes is k̂ = u ⊙ s + z' (+ a
  codebook row), with u = code − 2^(b−1) an integer in [−2^(b−1), 2^(b−1) − 1], s its group scales and z' its
  group offsets (zero + 2^(b−1) s; s for symmetric grids). u is exact in INT8 (and in e4m3 for b ≤ 4), so QKᵀ
  rounds only the queries (`code_dots`): per-token groups of G channels take Σ_g s_g (q_g·u_g) with q rounded
  once per row; groups of G tokens along channels (KIVI's keys) take (q ⊙ s)·u with q ⊙ s rounded per group.
  The allocator's channels (one group: the span) take (q ⊙ s)·u with q ⊙ s in two terms: a channel of b bits
  multiplies its query term's rounding by up to 2^(b−1), so one term added 2 points of top-1 shift there.
  q·z' and q·codebook rows are added in fp32. This needs no key rounding, and no centre (the layout's
  `reads_codes` and `code_form`, quantwm/core/layouts).
* **Other keys are centred** (SageAttention's smoothing) **and split in two terms**: a per-channel centre μ of
  the span (`center`) is taken off every key and q·μ is added back in fp32; each centred key row is rounded to
  8 bits with one scale and its remainder is rounded again (k − μ ≈ a·s_a + b·s_b), and so are the queries, so
  both keep about 14 significant bits for three 8-bit products, 1.5 times a BF16 product's tensor-core time
  (`lowp_dots`). These are the BF16 sink, recent and current spans (a few chunks of a long cache) and quantized
  layouts whose `reads_codes` refuses.
* **The formats**: INT8 (`qk="int8"`, the default) or fp8-e4m3 (`qk="e4m3"`); the integer or e4m3 products
  are summed in fp32 and multiplied by the scales. Logit terms the method adds (a PSAC correction, the +jensen
  bias) stay fp32.
* **PV in e4m3**: an online softmax over key blocks of `BLOCK` rows from the span's start (the order the kernel
  visits them, running maximum m, in log2 units as the kernel keeps it). Each block's probabilities 2^(s − m) lie
  in [0, 1] and are rounded to e4m3 as they are; the block's values get one scale per channel (absolute maximum
  over 448) and are rounded to e4m3; products accumulate in fp32. The normaliser sums the fp32 probabilities.

Why these choices (tuning sources: trace seed 100003, world seeds 100005-100008; `benchmarks/fp8_error.py`): on
the built-in model nearly all of the top-1 shift a one-term 8-bit product added came from rounding the BF16
recent span's keys and queries (near-copies of one place differ by less than an 8-bit step). On a fixed 2-bit
cache (world 100005): 2.60 points with every key rounded once, 0.36 with codes and two key terms, 0.03 with two
query terms too; at a 2.5-bit budget one query term over the allocator's codes added 1.95 points, two 0.07.
e4m3 queries add 0.4-0.5 points more than INT8 ones (three mantissa bits cannot separate near-tied logits). INT8
and FP8 run at the same tensor-core rate on Hopper. `torch.float8_e4m3fn` does the e4m3 rounding (to nearest
even, saturating at ±448 here); INT8 rounds to nearest even and clamps at ±127.
"""
from __future__ import annotations

import math

import torch

from ..kernels.span_args import BLOCK_N
from .layouts import CodeForm

E4M3_MAX = 448.0
INT8_MAX = 127.0
BLOCK = BLOCK_N  # key rows per PV block: the kernel's tile (kernels/span_args.py)
LOG2E = math.log2(math.e)


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """x rounded to fp8-e4m3 and back to float32, saturating at ±448."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()


def int8(x: torch.Tensor) -> torch.Tensor:
    """x rounded to the nearest integer (ties to even) in [-127, 127], as float32."""
    return x.float().round().clamp(-INT8_MAX, INT8_MAX)


FORMATS = {"int8": (int8, INT8_MAX), "e4m3": (e4m3, E4M3_MAX)}


def _format(fmt: str):
    if fmt not in FORMATS:
        raise ValueError(f"unknown low-precision format {fmt!r}; known: {', '.join(FORMATS)}")
    return FORMATS[fmt]


def row_quantize(x: torch.Tensor, fmt: str = "int8") -> tuple[torch.Tensor, torch.Tensor]:
    """(codes as float32, scales (..., L, 1)) of x (..., L, D), one scale per row: x ≈ codes * scales. A row of
    zeros gets scale 1."""
    cast, top = _format(fmt)
    amax = x.float().abs().amax(-1, keepdim=True)
    s = torch.where(amax > 0, amax / top, torch.ones_like(amax))
    return cast(x.float() / s), s


def key_center(k: torch.Tensor) -> torch.Tensor:
    """The default centre of keys (..., L, D): their per-channel mean, (..., D)."""
    return k.float().mean(-2)


def lowp_dots(q: torch.Tensor, k: torch.Tensor, center: torch.Tensor | None = None, qk: str = "int8") -> torch.Tensor:
    """q·kᵀ through the path's QKᵀ rounding of keys given as values: q (..., Nq, D), k (..., L, D), center
    (..., D) (default: the keys' mean) -> (..., Nq, L) float32, exact but for the rounding of q and of k − center,
    each in two terms (value a, remainder b): a_q·a_k + a_q·b_k + b_q·a_k, three 8-bit products (b_q·b_k is
    below them). `qk="bf16"`: for comparison, the BF16 path's products (q and k rounded to bf16)."""
    if qk == "bf16":
        return q.bfloat16().float() @ k.bfloat16().float().transpose(-1, -2)
    c = key_center(k) if center is None else center.float()
    qc, qs = row_quantize(q, qk)
    qr, qrs = row_quantize(q.float() - qc * qs, qk)
    kk = k.float() - c[..., None, :]
    hi, hs = row_quantize(kk, qk)
    lo, ls = row_quantize(kk - hi * hs, qk)
    hs, ls = hs.transpose(-1, -2), ls.transpose(-1, -2)
    dots = ((qc @ hi.transpose(-1, -2)) * hs + (qc @ lo.transpose(-1, -2)) * ls) * qs
    return dots + (qr @ hi.transpose(-1, -2)) * hs * qrs + (q.float() @ c[..., :, None])


def code_dots(q: torch.Tensor, form: CodeForm, qk: str = "int8") -> torch.Tensor:
    """q·k̂ᵀ (S, Nq, N) float32 of queries q (S, Nq, D) over a quantized key side in its integer-code form (its
    layout's `code_form`), with the codes as the exact 8-bit operand: only the queries are rounded."""
    S, Nq, D = q.shape
    qf = q.float()
    u, sc, zp, G = form.u, form.scales, form.offsets, form.group_size
    N = u.shape[1]
    if not form.axis_token:  # per-token groups of G channels: scales (S, N, D / G)
        qc, qs = row_quantize(qf, qk)
        per_group = torch.einsum("sqgc,sngc->sgqn", qc.unflatten(-1, (-1, G)), u.unflatten(-1, (-1, G)))
        qsum = qf.unflatten(-1, (-1, G)).sum(-1)  # (S, Nq, D / G)
        dots = (per_group * sc.permute(0, 2, 1)[:, :, None, :]).sum(1) * qs + qsum @ zp.transpose(1, 2)
    else:  # scales (S, ceil(N / G), D): the queries times each token group's channel scales, rounded per group
        dots = torch.empty(S, Nq, N, device=q.device)
        for g in range(sc.shape[1]):
            a, e = g * G, min(N, g * G + G)
            qx = qf * sc[:, g, None, :]
            qc, qs = row_quantize(qx, qk)
            dots[..., a:e] = (qc @ u[:, a:e].transpose(1, 2)) * qs
            if form.two_term:  # widths differ by channel: the queries in two terms (value and remainder)
                lo, ls = row_quantize(qx - qc * qs, qk)
                dots[..., a:e] += (lo @ u[:, a:e].transpose(1, 2)) * ls
            dots[..., a:e] += qf @ zp[:, g, :, None]
    if form.codebook is not None:
        qcb = qf @ form.codebook.float().transpose(1, 2)  # (S, Nq, K)
        dots = dots + torch.gather(qcb, 2, form.ids.long()[:, None, :].expand(S, Nq, N))
    return dots


def pv_fold(logits2: torch.Tensor, v: torch.Tensor, m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor) -> None:
    """Fold a span's log2-unit logits (..., Nq, N) and values (..., N, D) into a softmax state m, l (..., Nq)
    and acc (..., Nq, D), in place, block by block with P and V in e4m3 (the kernel's order within one split)."""
    for a in range(0, logits2.shape[-1], BLOCK):
        s = logits2[..., a:a + BLOCK]
        m_new = torch.maximum(m, s.amax(-1))
        alpha = torch.exp2(m - m_new)
        p = torch.exp2(s - m_new[..., None])
        l.mul_(alpha).add_(p.sum(-1))
        vb = v[..., a:a + BLOCK, :].float()
        amax = vb.abs().amax(-2, keepdim=True)
        vs = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        acc.mul_(alpha[..., None]).add_((e4m3(p) @ e4m3(vb / vs)) * vs)
        m.copy_(m_new)


def lowp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   bias: torch.Tensor | None = None, qk: str = "int8",
                   center: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(τ QKᵀ + bias) V through the path's rounding points, as one span: q (..., Nq, D), k and v
    (..., L, D), bias (..., Nq, L) added in fp32 -> (..., Nq, D) float32."""
    logits = lowp_dots(q, k, center, qk) * scale
    if bias is not None:
        logits = logits + bias.float()
    *lead, Nq, _ = logits.shape
    m = torch.full((*lead, Nq), float("-inf"), device=logits.device)
    l = torch.zeros(*lead, Nq, device=logits.device)
    acc = torch.zeros(*lead, Nq, v.shape[-1], device=logits.device)
    pv_fold(logits * LOG2E, v, m, l, acc)
    return acc / l[..., None]
