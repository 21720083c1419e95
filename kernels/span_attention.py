"""Fused attention of a chunk of queries over one cached span: the twin of
quantwm.core.attention.span_attention_ref.

A cache is a list of spans (the BF16 sink, quantized chunks, the BF16 recent chunk, the current chunk).
Instead of decompressing every span to BF16 before attention (what published video quantizers do), each
launch streams one span's stored bytes (packed codes, fp8/fp16 scales and zeros, centroid ids, codebook
rows) tile by tile, rebuilds keys and values in registers and folds them into an online softmax whose
state (acc, m, l) persists across launches, so the whole cache is one softmax:

    k̂_j = codebook[id_j] + code_j * scale_j + zero_j         (per-token or per-channel groups)
    logit_ij = τ (q_i·k̂_j + (Uᵀq_i)·â_j) - (τ²/24) Σ_c q_ic² Δ_jc²   (PSAC term; Jensen term if asked)

The PSAC term arrives precomputed per query as (Uᵀq)·scale and (Uᵀq)·zero (R numbers each, R <= 16), so a
key costs R extra MACs on the unpacked 4-bit coefficient codes. The state keeps P independent splits of
every span (flash-decoding): a chunk with few queries still fills the GPU, and the caller merges the
splits at the end. m is kept in log2 units (logits times log2(e)).

Supported: bits 2/4/8, asymmetric or symmetric grids, groups along channels (power-of-two G) or along
tokens, one codebook stage, keys and values independently quantized or full precision. Keys must be
post-RoPE (pre-RoPE caches use the reference path; see quantwm/attention.py for why).
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl


@triton.jit
def _dot(a, b, dtype: tl.constexpr, DOT_F32: tl.constexpr):
    """a @ b in fp32 (IEEE, no TF32) when DOT_F32, else with operands cast to the 16-bit `dtype` (fp32 accumulation)."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a.to(dtype), b.to(dtype))


@triton.jit
def _rebuild(codes_ptr, scale_ptr, zero_ptr, cb_ptr, ids_ptr, full_ptr, s, rows, d, N, D, n_cb, n_gt, row_bytes,
             rmask, dmask, QUANT: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, AXIS_TOKEN: tl.constexpr,
             SYM: tl.constexpr, CODEBOOK: tl.constexpr):
    """A (BLOCK_N, BLOCK_D) fp32 tile of rebuilt keys or values for token rows `rows` of stream s."""
    m2 = rmask[:, None] & dmask[None, :]
    if QUANT:
        PER: tl.constexpr = 8 // BITS
        b = tl.load(codes_ptr + (s * N + rows[:, None]).to(tl.int64) * row_bytes + d[None, :] // PER, mask=m2, other=0)
        code = ((b.to(tl.int32) >> ((d[None, :] % PER) * BITS)) & ((1 << BITS) - 1)).to(tl.float32)
        if AXIS_TOKEN:  # scales (S, ceil(N/G), D)
            sidx = (s * n_gt + rows[:, None] // G).to(tl.int64) * D + d[None, :]
        else:  # scales (S, N, D/G)
            sidx = (s * N + rows[:, None]).to(tl.int64) * (D // G) + d[None, :] // G
        sc = tl.load(scale_ptr + sidx, mask=m2, other=0.0).to(tl.float32)
        if SYM:
            x = (code - ((1 << (BITS - 1)) - 1)) * sc
        else:
            x = code * sc + tl.load(zero_ptr + sidx, mask=m2, other=0.0).to(tl.float32)
        if CODEBOOK:
            ids = tl.load(ids_ptr + s * N + rows, mask=rmask, other=0).to(tl.int64)
            x += tl.load(cb_ptr + (s * n_cb + ids[:, None]) * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
    else:
        x = tl.load(full_ptr + (s * N + rows[:, None]).to(tl.int64) * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
    return x


@triton.jit
def _span_attention_kernel(
        q_ptr, acc_ptr, m_ptr, l_ptr,
        kc_ptr, ks_ptr, kz_ptr, kcb_ptr, kid_ptr, kf_ptr,
        vc_ptr, vs_ptr, vz_ptr, vcb_ptr, vid_ptr, vf_ptr,
        pq_ptr, pc0_ptr, pcodes_ptr,
        Nq, N, D, P, split_len, qk_scale, jensen_coef,
        k_ncb, k_ngt, k_row_bytes, v_ncb, v_ngt, v_row_bytes, R, p_row_bytes,
        K_QUANT: tl.constexpr, K_BITS: tl.constexpr, K_G: tl.constexpr, K_AXIS_TOKEN: tl.constexpr,
        K_SYM: tl.constexpr, K_CODEBOOK: tl.constexpr,
        V_QUANT: tl.constexpr, V_BITS: tl.constexpr, V_G: tl.constexpr, V_AXIS_TOKEN: tl.constexpr,
        V_SYM: tl.constexpr, V_CODEBOOK: tl.constexpr,
        PSAC: tl.constexpr, P_BITS: tl.constexpr, JENSEN: tl.constexpr, DOT_F32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    s = tl.program_id(0)
    qi = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    p = tl.program_id(2)
    d = tl.arange(0, BLOCK_D)
    qmask, dmask = qi < Nq, d < D
    q = tl.load(q_ptr + (s * Nq + qi[:, None]).to(tl.int64) * D + d[None, :], mask=qmask[:, None] & dmask[None, :],
                other=0.0)
    state = (s * P + p) * Nq + qi
    m_i = tl.load(m_ptr + state, mask=qmask, other=0.0)
    l_i = tl.load(l_ptr + state, mask=qmask, other=0.0)
    acc = tl.load(acc_ptr + state[:, None].to(tl.int64) * D + d[None, :], mask=qmask[:, None] & dmask[None, :],
                  other=0.0)
    if JENSEN:
        qf = q.to(tl.float32)
        if K_AXIS_TOKEN:
            qsq = qf * qf  # (BM, BD)
        else:
            qsq = tl.sum(tl.reshape(qf * qf, (BLOCK_M, BLOCK_D // K_G, K_G)), axis=2)  # (BM, NG)
    if PSAC:
        r = tl.arange(0, BLOCK_R)
        pq = tl.load(pq_ptr + (s * Nq + qi[:, None]) * R + r[None, :], mask=qmask[:, None] & (r[None, :] < R),
                     other=0.0)
        pc0 = tl.load(pc0_ptr + s * Nq + qi, mask=qmask, other=0.0)
    start = p * split_len
    end = tl.minimum(N, start + split_len)
    for n0 in range(start, end, BLOCK_N):
        rows = n0 + tl.arange(0, BLOCK_N)
        rmask = rows < end
        k = _rebuild(kc_ptr, ks_ptr, kz_ptr, kcb_ptr, kid_ptr, kf_ptr, s, rows, d, N, D, k_ncb, k_ngt, k_row_bytes,
                     rmask, dmask, K_QUANT, K_BITS, K_G, K_AXIS_TOKEN, K_SYM, K_CODEBOOK)
        dots = _dot(q, tl.trans(k), q.dtype, DOT_F32)  # (BM, BN)
        if PSAC:
            PPER: tl.constexpr = 8 // P_BITS
            b = tl.load(pcodes_ptr + (s * N + rows[:, None]).to(tl.int64) * p_row_bytes + r[None, :] // PPER,
                        mask=rmask[:, None] & (r[None, :] < R), other=0)
            a = ((b.to(tl.int32) >> ((r[None, :] % PPER) * P_BITS)) & ((1 << P_BITS) - 1)).to(tl.float32)
            a = tl.where(r[None, :] < R, a, 0.0)
            dots += tl.dot(pq, tl.trans(a), input_precision="ieee") + pc0[:, None]
        logits = dots * qk_scale
        if JENSEN:
            if K_AXIS_TOKEN:
                sidx = (s * k_ngt + rows[:, None] // K_G).to(tl.int64) * D + d[None, :]
                st = tl.load(ks_ptr + sidx, mask=rmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
                logits += jensen_coef * tl.dot(qsq, tl.trans(st * st), input_precision="ieee")
            else:
                g = tl.arange(0, BLOCK_D // K_G)
                sidx = (s * N + rows[:, None]).to(tl.int64) * (D // K_G) + g[None, :]
                st = tl.load(ks_ptr + sidx, mask=rmask[:, None] & (g[None, :] < D // K_G), other=0.0).to(tl.float32)
                logits += jensen_coef * tl.sum(qsq[:, None, :] * (st * st)[None, :, :], axis=2)
        logits = tl.where(rmask[None, :], logits, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, axis=1))
        alpha = tl.exp2(m_i - m_new)
        pexp = tl.exp2(logits - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pexp, axis=1)
        v = _rebuild(vc_ptr, vs_ptr, vz_ptr, vcb_ptr, vid_ptr, vf_ptr, s, rows, d, N, D, v_ncb, v_ngt, v_row_bytes,
                     rmask, dmask, V_QUANT, V_BITS, V_G, V_AXIS_TOKEN, V_SYM, V_CODEBOOK)
        acc = acc * alpha[:, None] + _dot(pexp, v, q.dtype, DOT_F32)
        m_i = m_new
    tl.store(m_ptr + state, m_i, mask=qmask)
    tl.store(l_ptr + state, l_i, mask=qmask)
    tl.store(acc_ptr + state[:, None].to(tl.int64) * D + d[None, :], acc, mask=qmask[:, None] & dmask[None, :])


def _dot_f32(dtype: torch.dtype) -> bool:
    """fp32 inputs take IEEE fp32 dots. So do bf16 inputs under TRITON_INTERPRET=1: the interpreter's bf16
    tl.dot returns garbage and its fp32 -> bf16 cast truncates (Triton 3.7.1), so there the bf16 path keeps
    fp32 tiles (loads stay bf16). On a GPU, bf16 and fp16 inputs take tensor-core dots in their dtype."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1")


def _side_args(side: dict, S: int, N: int, D: int, dummy: torch.Tensor, what: str):
    """Pointers, runtime sizes and constexprs of one side (keys or values) of a span."""
    if "full" in side:
        f = side["full"]
        if tuple(f.shape) != (S, N, D):
            raise ValueError(f"{what}: full-precision tensor must be {(S, N, D)}, got {tuple(f.shape)}")
        return [dummy] * 5 + [f.contiguous()], [0, 0, 0], dict(QUANT=False, BITS=2, G=1, AXIS_TOKEN=False,
                                                               SYM=False, CODEBOOK=False)
    bits, G, axis, sym = side["bits"], side["group_size"], side["axis"], side["symmetric"]
    if bits not in (2, 4, 8):
        raise ValueError(f"{what}: the fused kernel reads 2-, 4- or 8-bit codes, got {bits}")
    if axis == "channel" and (D % G or G & (G - 1)):
        raise ValueError(f"{what}: per-token groups must be a power of two dividing D={D}, got {G}")
    row_bytes = (D * bits + 7) // 8
    if tuple(side["codes"].shape) != (S, N, row_bytes):
        raise ValueError(f"{what}: codes must be {(S, N, row_bytes)}, got {tuple(side['codes'].shape)}")
    n_gt = triton.cdiv(N, G)
    cb, ids = side.get("codebook"), side.get("ids")
    zero = side.get("zeros")
    ptrs = [side["codes"].contiguous(), side["scales"].contiguous(), dummy if zero is None else zero.contiguous(),
            dummy if cb is None else cb.contiguous(), dummy if ids is None else ids.contiguous(), dummy]
    return ptrs, [0 if cb is None else cb.shape[1], n_gt, row_bytes], dict(
        QUANT=True, BITS=bits, G=G, AXIS_TOKEN=axis == "token", SYM=sym, CODEBOOK=cb is not None)


def span_attention(q: torch.Tensor, acc: torch.Tensor, m: torch.Tensor, l: torch.Tensor, k: dict, v: dict,
                   scale: float, psac: dict | None = None, jensen: bool = False) -> None:
    """Fold one span into the running softmax state, in place.

    q (S, Nq, D) post-RoPE queries (fp32 or bf16/fp16: the dot products run in q's dtype);
    acc (S, P, Nq, D), m and l (S, P, Nq) fp32: the state of P splits (start: acc 0, m -inf, l 0);
    k, v: {"full": (S, N, D)} or {"codes": uint8 (S, N, D*bits/8), "scales", "zeros" (absent when
    symmetric), "bits", "group_size", "axis" ("channel" | "token"), "symmetric", optional "codebook"
    (S, K, D) and "ids" (S, N)}; psac (keys only): {"qs": (S, Nq, R) fp32 (Uᵀq)·coefficient scale,
    "c0": (S, Nq) fp32 Σ_r (Uᵀq)_r zero_r, "codes": uint8 (S, N, R*bits/8), "bits"}; jensen: subtract
    the Jensen term (quantized keys only).
    """
    if q.dim() != 3:
        raise ValueError(f"q must be (S, Nq, D), got shape {tuple(q.shape)}")
    S, Nq, D = q.shape
    P = acc.shape[1]
    if tuple(acc.shape) != (S, P, Nq, D) or tuple(m.shape) != (S, P, Nq) or tuple(l.shape) != (S, P, Nq):
        raise ValueError("state must be acc (S, P, Nq, D), m and l (S, P, Nq) matching q")
    if not (acc.is_contiguous() and m.is_contiguous() and l.is_contiguous()):
        raise ValueError("the softmax state tensors must be contiguous (they are updated in place)")
    N = (k["full"] if "full" in k else k["codes"]).shape[1]
    if N == 0 or Nq == 0:
        return
    if jensen and "full" in k:
        raise ValueError("the Jensen term applies to quantized keys only")
    dummy = q
    kp, ka, kc = _side_args(k, S, N, D, dummy, "keys")
    vp, va, vc = _side_args(v, S, N, D, dummy, "values")
    if psac is not None:
        R = psac["qs"].shape[-1]
        p_row_bytes = (R * psac["bits"] + 7) // 8
        if "full" in k or tuple(psac["codes"].shape) != (S, N, p_row_bytes) or R > 16 or psac["bits"] not in (2, 4, 8):
            raise ValueError("PSAC needs quantized keys, codes (S, N, R*bits/8), R <= 16 and bits 2, 4 or 8")
        pp = [psac["qs"].float().contiguous(), psac["c0"].float().contiguous(), psac["codes"].contiguous()]
        p_bits = psac["bits"]
    else:
        R, p_row_bytes, pp, p_bits = 0, 0, [dummy] * 3, 4
    BLOCK_M = 64 if Nq > 32 else 16
    BLOCK_N = 64
    BLOCK_D = max(16, triton.next_power_of_2(D))
    split_len = triton.cdiv(triton.cdiv(N, P), BLOCK_N) * BLOCK_N
    grid = (S, triton.cdiv(Nq, BLOCK_M), P)
    _span_attention_kernel[grid](
        q.contiguous(), acc, m, l, *kp, *vp, *pp,
        Nq, N, D, P, split_len, float(scale) * math.log2(math.e), -(float(scale) ** 2 / 24) * math.log2(math.e),
        *ka, *va, R, p_row_bytes,
        K_QUANT=kc["QUANT"], K_BITS=kc["BITS"], K_G=kc["G"], K_AXIS_TOKEN=kc["AXIS_TOKEN"], K_SYM=kc["SYM"],
        K_CODEBOOK=kc["CODEBOOK"],
        V_QUANT=vc["QUANT"], V_BITS=vc["BITS"], V_G=vc["G"], V_AXIS_TOKEN=vc["AXIS_TOKEN"], V_SYM=vc["SYM"],
        V_CODEBOOK=vc["CODEBOOK"],
        PSAC=psac is not None, P_BITS=p_bits, JENSEN=jensen, DOT_F32=_dot_f32(q.dtype),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, BLOCK_R=16)
