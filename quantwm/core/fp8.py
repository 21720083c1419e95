"""FP8 attention, emulated in PyTorch: the rounding points an FP8 tensor-core path takes (docs/kernels.md).

An FP8 path cannot make 2-bit attention faster by reading fewer bytes: a chunk of thousands of queries over a
long cache is compute-bound, so only cheaper matrix products help. The emulation fixes, ahead of any kernel,
where values are rounded to fp8-e4m3 and with which scales, so that a kernel can be checked against it and
its error measured on the CPU:

* **Keys are smoothed** first (SageAttention): the mean key of the span, per channel, is subtracted. Every
  logit of a query then moves by the same q·mean, which softmax ignores, and the outlier channels that would
  set the fp8 scale are gone.
* **QKᵀ in e4m3**: queries and (smoothed, decoded) keys are divided by one scale per block of `block` rows
  (their absolute maximum over 448, the largest e4m3 value), rounded to e4m3 and multiplied out in fp32; the
  logit is (q̃·k̃) · s_q · s_k. Logit terms the method adds (the +jensen bias, a PSAC correction) stay fp32.
* **PV in e4m3**: an online softmax over key blocks of `block` rows (the order a kernel visits them, running
  maximum m). Each block's probabilities exp(s − m) lie in [0, 1] and are rounded to e4m3 as they are; values
  get one scale per block of rows and channel. The products accumulate in fp32.

`torch.float8_e4m3fn` does the rounding (round to nearest even, saturating at ±448 after scaling). `qk="int8"`
rounds QKᵀ's operands to INT8 instead (SageAttention 2's choice; PV stays e4m3), for comparison.
"""
from __future__ import annotations

import torch

E4M3_MAX = 448.0


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """x rounded to fp8-e4m3 and back to float32 (x must already lie within ±448)."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()


def int8(x: torch.Tensor) -> torch.Tensor:
    """x rounded to the nearest integer in [-127, 127] (SageAttention's INT8 QKᵀ), as float32."""
    return x.float().round().clamp(-127, 127)


FORMATS = {"e4m3": (e4m3, E4M3_MAX), "int8": (int8, 127.0)}


def block_quantize(x: torch.Tensor, block: int, per_channel: bool = False,
                   fmt: str = "e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """(codes as float32, scales) of x (..., L, D) in `fmt` (e4m3 or int8) with one scale per block of `block`
    rows (and per channel with `per_channel`): x ≈ codes * scales, the scales broadcast over their block."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown low-precision format {fmt!r}; known: {', '.join(FORMATS)}")
    cast, top = FORMATS[fmt]
    *lead, L, D = x.shape
    pad = (-L) % block
    xp = torch.nn.functional.pad(x.float(), (0, 0, 0, pad)).reshape(*lead, (L + pad) // block, block, D)
    amax = xp.abs().amax(-2, keepdim=True) if per_channel else xp.abs().amax((-2, -1), keepdim=True)
    s = torch.where(amax > 0, amax / top, torch.ones_like(amax))
    codes = cast(xp / s).reshape(*lead, L + pad, D)[..., :L, :]
    return codes, s.expand_as(xp).reshape(*lead, L + pad, D)[..., :L, :]


def smooth_keys(k: torch.Tensor) -> torch.Tensor:
    """Keys (..., L, D) less their per-channel mean over the L tokens (softmax-invariant; SageAttention)."""
    return k - k.float().mean(-2, keepdim=True)


def fp8_logits(q: torch.Tensor, k: torch.Tensor, scale: float, block: int = 64, qk: str = "e4m3") -> torch.Tensor:
    """τ·QKᵀ through e4m3 (or `qk="int8"`, SageAttention's choice) with smoothed keys, per-block scales and
    fp32 products: q (..., Nq, D), k (..., L, D) -> (..., Nq, L). Differs from the exact logits by a per-query
    constant (the smoothing) plus rounding."""
    qc, qs = block_quantize(q, block, fmt=qk)
    kc, ks = block_quantize(smooth_keys(k), block, fmt=qk)
    # one scale per block: the product of the block scales multiplies each (query block, key block) tile
    return scale * (qc @ kc.transpose(-1, -2)) * qs[..., :, :1] * ks[..., :, 0][..., None, :]


def fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  bias: torch.Tensor | None = None, block: int = 64, qk: str = "e4m3") -> torch.Tensor:
    """softmax(τ QKᵀ + bias) V through the FP8 path's rounding points: q (..., Nq, D), k and v (..., L, D),
    bias (..., Nq, L) added in fp32 -> (..., Nq, D) float32. An online softmax over key blocks of `block`;
    QKᵀ in `qk` (e4m3 or int8), PV in e4m3."""
    logits = fp8_logits(q, k, scale, block, qk)
    if bias is not None:
        logits = logits + bias.float()
    vc, vs = block_quantize(v, block, per_channel=True)
    *lead, Nq, L = logits.shape
    m = torch.full((*lead, Nq, 1), float("-inf"))
    acc = torch.zeros(*lead, Nq, v.shape[-1])
    den = torch.zeros(*lead, Nq, 1)
    for a in range(0, L, block):
        s = logits[..., a:a + block]
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new)
        den = den * alpha + p.sum(-1, keepdim=True)  # the normaliser from the fp32 probabilities
        vb = vc[..., a:a + block, :] * vs[..., a:a + block, :]
        acc = acc * alpha + e4m3(p) @ vb  # P in e4m3 (values in [0, 1]); V as stored in e4m3 with its scales
        m = m_new
    return acc / den
