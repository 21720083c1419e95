"""The low-precision attention path's rounding points, in PyTorch: the twin the fused kernel's `lowp` mode is
checked against (kernels/span_attention.py, docs/kernels.md).

A chunk of thousands of queries over a long cache is compute-bound, so reading 2-bit keys cannot by itself make
attention faster than BF16; only cheaper matrix products can. This path runs both products of attention on 8-bit
operands with fp32 accumulation. Per span (a launch of the kernel):

* **Keys are centred** (SageAttention's smoothing): a per-channel centre μ of the span (`center`) is taken off
  every decoded key, and q·μ is added back to each logit in fp32, so the logits are the exact ones up to the
  rounding below whatever μ is; a good μ only makes the rounded part small.
* **QKᵀ on 8-bit operands**: each query row and each centred key row gets one scale (its absolute maximum over
  the format's largest value), is divided by it and rounded to INT8 (`qk="int8"`, the default) or fp8-e4m3
  (`qk="e4m3"`); the integer or e4m3 products are summed in fp32 and multiplied by the two scales. Logit terms the
  method adds (a PSAC correction, the +jensen bias) stay fp32.
* **PV in e4m3**: an online softmax over key blocks of `BLOCK` rows from the span's start (the order the kernel
  visits them, running maximum m, in log2 units as the kernel keeps it). Each block's probabilities 2^(s − m) lie
  in [0, 1] and are rounded to e4m3 as they are; the block's values get one scale per channel (absolute maximum
  over 448) and are rounded to e4m3; products accumulate in fp32. The normaliser sums the fp32 probabilities.

Why INT8 by default: on the tuning traces (trace seed 100003, world seed 100005) e4m3 keys move the top-1
source of 3-5% more queries than the 2-bit cache alone (three mantissa bits cannot separate near-tied logits);
INT8 with per-token scales adds under 1 point over the BF16 path (`benchmarks/fp8_error.py`). INT8 and FP8 run
at the same tensor-core rate on Hopper. `torch.float8_e4m3fn` does the e4m3 rounding (to nearest even,
saturating at ±448 here); INT8 rounds to nearest even and clamps at ±127.
"""
from __future__ import annotations

import math

import torch

E4M3_MAX = 448.0
INT8_MAX = 127.0
BLOCK = 32  # key rows per PV block: the kernel's BLOCK_N (kernels/span_attention.py)
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
    """q·kᵀ through the path's QKᵀ rounding: q (..., Nq, D), k (..., L, D), center (..., D) (default: the keys'
    mean) -> (..., Nq, L) float32, exact but for the rounding of q and of k − center. `qk="bf16"`: for
    comparison, the BF16 path's products (q and k rounded to bf16, no centre)."""
    if qk == "bf16":
        return q.bfloat16().float() @ k.bfloat16().float().transpose(-1, -2)
    c = key_center(k) if center is None else center.float()
    qc, qs = row_quantize(q, qk)
    kc, ks = row_quantize(k.float() - c[..., None, :], qk)
    return (qc @ kc.transpose(-1, -2)) * qs * ks.transpose(-1, -2) + (q.float() @ c[..., :, None])


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
