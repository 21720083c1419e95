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

`lowp` ("int8" or "e4m3") runs both products on 8-bit operands, accumulating in fp32, at the rounding points
of quantwm/core/fp8.py. QKᵀ: quantized keys that fp8.reads_codes accepts enter as their integer codes, exact,
against the queries rounded with one scale per row (per-token channel groups: one 3-D dot over the groups,
each group's product times its scale; token groups: the queries times the block's channel scales, rounded per
block; over the allocator's per-channel grids, in two terms), with q·z' and the query's codebook products
(computed by the launcher) in fp32; other keys, less their span's centre μ (given), and the queries are rounded
in two terms each (value and remainder; three products), with q·μ added back in fp32. PV: each key block's
probabilities (in [0, 1], unscaled) and its values (one scale per channel) in e4m3. PSAC and Jensen terms stay
fp32. With one split (P = 1) the kernel takes the same steps as the emulation.

Supported: bits 2/4/8, asymmetric or symmetric grids, groups along channels (power-of-two G) or along
tokens, one codebook stage, keys and values independently quantized or full precision; and QuantWM's allocator
(a budget): 0-8 bits per channel on per-channel grids over the span, each channel's codes packed along the span
in one buffer (quantwm/core/allocate.py `fused_side`: a table of byte offsets and widths), read code by code
(codes of 3, 5, 6 or 7 bits straddle two bytes). Keys must be post-RoPE (pre-RoPE caches use the reference
path; see quantwm/attention.py for why).
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
def _rint(x):
    """x rounded to the nearest integer, ties to even (fp32, |x| < 2^22): the 1.5 * 2^23 trick."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def _to_e4m3(x, INTERP: tl.constexpr):
    """x (fp32) rounded to fp8-e4m3, saturating at ±448: an fp8 tensor on a GPU; under the interpreter, whose
    fp8 cast truncates (Triton 3.7.1), the rounded values in fp32 (round to nearest even, subnormals below 2^-6)."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    if INTERP:
        e = ((tl.abs(x).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # the exponent of |x|
        e = tl.maximum(e, -6)  # below the smallest normal the step stays 2^-9
        step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e-3): three mantissa bits
        return _rint(x / step) * step
    return x.to(tl.float8e4nv)


@triton.jit
def _lowp_rows(x, LOWP: tl.constexpr, INTERP: tl.constexpr):
    """(codes, scales) of a fp32 tile, one scale per row (its absolute maximum over 127 or 448): INT8 (LOWP 1;
    integer-valued fp32 under the interpreter) or e4m3 (LOWP 2). A zero row gets scale 1."""
    amax = tl.max(tl.abs(x), axis=1)
    if LOWP == 1:
        sc = tl.where(amax > 0, amax / 127.0, 1.0)
    else:
        sc = tl.where(amax > 0, amax / 448.0, 1.0)
    y = x / sc[:, None]
    if LOWP == 1:
        c = tl.minimum(tl.maximum(_rint(y), -127.0), 127.0)
        if not INTERP:
            c = c.to(tl.int8)
    else:
        c = _to_e4m3(y, INTERP)
    return c, sc


@triton.jit
def _dot_lowp(a, b, INT8: tl.constexpr, INTERP: tl.constexpr):
    """a @ b of 8-bit operands (INT8 -> int32, or e4m3 -> fp32) as fp32; under the interpreter the operands are
    exactly representable fp32 values and the dot is IEEE fp32."""
    if INTERP:
        out = tl.dot(a, b, input_precision="ieee")
    elif INT8:
        out = tl.dot(a, b, out_dtype=tl.int32).to(tl.float32)
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _unpack(codes_ptr, s, rows, d, N, row_bytes, m2, BITS: tl.constexpr):
    """The (BLOCK_N, BLOCK_D) int32 codes of token rows `rows` of stream s (0 outside m2)."""
    PER: tl.constexpr = 8 // BITS
    b = tl.load(codes_ptr + (s * N + rows[:, None]).to(tl.int64) * row_bytes + d[None, :] // PER, mask=m2, other=0)
    return (b.to(tl.int32) >> ((d[None, :] % PER) * BITS)) & ((1 << BITS) - 1)


@triton.jit
def _alloc_codes(codes_ptr, meta_ptr, s, rows, d, D, m2, dmask):
    """(codes (BN, BD) int32, bits (BD,) int32) of the allocator's channels for token rows `rows` of stream s:
    meta = byte offset * 16 + bits per channel; code j of a b-bit channel sits at bits [j b, j b + b) from its
    offset, little-endian, so it may straddle two bytes. 0-bit channels and rows outside m2 read 0."""
    meta = tl.load(meta_ptr + s * D + d, mask=dmask, other=0)
    bits = (meta & 15).to(tl.int32)
    pos = rows[:, None].to(tl.int64) * bits[None, :]
    byte = (meta >> 4)[None, :] + pos // 8
    shift = (pos % 8).to(tl.int32)
    live = m2 & (bits[None, :] > 0)
    b0 = tl.load(codes_ptr + byte, mask=live, other=0).to(tl.int32)
    b1 = tl.load(codes_ptr + byte + 1, mask=live & (shift + bits[None, :] > 8), other=0).to(tl.int32)
    return ((b0 | (b1 << 8)) >> shift) & ((1 << bits[None, :]) - 1), bits


@triton.jit
def _code_dots(q_lp, q_sc, q3, qsum, qf32, codes_ptr, scale_ptr, zero_ptr, ids_ptr, meta_ptr, qcb_ptr, s, qi, qmask,
               rows, n0, d, N, Nq, D, n_cb, n_gt, row_bytes, rmask, dmask, BITS: tl.constexpr, G: tl.constexpr,
               AXIS_TOKEN: tl.constexpr, SYM: tl.constexpr, CODEBOOK: tl.constexpr, ALLOC: tl.constexpr,
               LOWP: tl.constexpr, INTERP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """q·k̂ (BM, BN) of a key tile read as its codes u = code - 2^(b-1), exact 8-bit operands (fp8.code_dots):
    k̂ = u s + z' (+ codebook row), z' = zero + 2^(b-1) s (s when symmetric; the allocator's low end + 2^(b-1) s,
    its channels one token group)."""
    m2 = rmask[:, None] & dmask[None, :]
    if ALLOC:
        code, bits = _alloc_codes(codes_ptr, meta_ptr, s, rows, d, D, m2, dmask)
        half = tl.where(bits > 0, 1 << tl.maximum(bits - 1, 0), 0)  # (BD,)
        u = tl.where(m2, code - half[None, :], 0).to(tl.float32)
    else:
        u = tl.where(m2, _unpack(codes_ptr, s, rows, d, N, row_bytes, m2, BITS) - (1 << (BITS - 1)), 0).to(tl.float32)
    if not INTERP:
        if LOWP == 1:
            u = u.to(tl.int8)
        else:
            u = u.to(tl.float8e4nv)
    if ALLOC or AXIS_TOKEN:  # the block lies in one token group (G a multiple of BLOCK_N, or the whole span)
        if ALLOC:  # step and low end (S, D)
            sc = tl.load(scale_ptr + s * D + d, mask=dmask, other=0.0).to(tl.float32)
            zp = tl.load(zero_ptr + s * D + d, mask=dmask, other=0.0).to(tl.float32) + half.to(tl.float32) * sc
        else:  # scales (S, ceil(N/G), D)
            sidx = (s * n_gt + n0 // G).to(tl.int64) * D + d
            sc = tl.load(scale_ptr + sidx, mask=dmask, other=0.0).to(tl.float32)
            if SYM:
                zp = sc
            else:
                zp = tl.load(zero_ptr + sidx, mask=dmask, other=0.0).to(tl.float32) + sc * (1 << (BITS - 1))
        qx = qf32 * sc[None, :]
        qg_lp, qg_sc = _lowp_rows(qx, LOWP, INTERP)
        dots = _dot_lowp(qg_lp, tl.trans(u), LOWP == 1, INTERP) * qg_sc[:, None]
        if ALLOC:  # widths differ by channel: the queries in two terms, value and remainder (fp8.code_dots)
            qr_lp, qr_sc = _lowp_rows(qx - qg_lp.to(tl.float32) * qg_sc[:, None], LOWP, INTERP)
            dots += _dot_lowp(qr_lp, tl.trans(u), LOWP == 1, INTERP) * qr_sc[:, None]
        dots += tl.sum(qf32 * zp[None, :], axis=1)[:, None]
    else:  # per-token groups of G channels: scales (S, N, D/G)
        NG: tl.constexpr = BLOCK_D // G
        gi = tl.arange(0, NG)
        gmask = rmask[:, None] & (gi[None, :] < D // G)
        sidx = (s * N + rows[:, None]).to(tl.int64) * (D // G) + gi[None, :]
        sc = tl.load(scale_ptr + sidx, mask=gmask, other=0.0).to(tl.float32)  # (BN, NG)
        if SYM:
            zp = sc
        else:
            zp = tl.load(zero_ptr + sidx, mask=gmask, other=0.0).to(tl.float32) + sc * (1 << (BITS - 1))
        if NG > 1:  # one dot per group, batched: (NG, BM, G) @ (NG, G, BN)
            u3 = tl.permute(tl.reshape(u, (BLOCK_N, NG, G)), (1, 2, 0))
            dots = tl.sum(_dot_lowp(q3, u3, LOWP == 1, INTERP) * tl.trans(sc)[:, None, :], axis=0) * q_sc[:, None]
        else:
            dots = _dot_lowp(q_lp, tl.trans(u), LOWP == 1, INTERP) * q_sc[:, None] * tl.sum(sc, axis=1)[None, :]
        dots += tl.sum(qsum[:, None, :] * zp[None, :, :], axis=2)
    if CODEBOOK:  # the query's products with the codebook rows (S, Nq, K), gathered by centroid id
        ids = tl.load(ids_ptr + s * N + rows, mask=rmask, other=0).to(tl.int64)
        dots += tl.load(qcb_ptr + (s * Nq + qi[:, None]).to(tl.int64) * n_cb + ids[None, :],
                        mask=qmask[:, None] & rmask[None, :], other=0.0)
    return dots


@triton.jit
def _rebuild(codes_ptr, scale_ptr, zero_ptr, cb_ptr, ids_ptr, full_ptr, s, rows, d, N, D, n_cb, n_gt, row_bytes,
             rmask, dmask, QUANT: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, AXIS_TOKEN: tl.constexpr,
             SYM: tl.constexpr, CODEBOOK: tl.constexpr, ALLOC: tl.constexpr):
    """A (BLOCK_N, BLOCK_D) fp32 tile of rebuilt keys or values for token rows `rows` of stream s (0 outside the
    tile's rows). The allocator's spans (ALLOC): full_ptr is the channel table, scale_ptr the steps, zero_ptr
    the low ends (S, D)."""
    m2 = rmask[:, None] & dmask[None, :]
    if ALLOC:
        code, _ = _alloc_codes(codes_ptr, full_ptr, s, rows, d, D, m2, dmask)
        step = tl.load(scale_ptr + s * D + d, mask=dmask, other=0.0).to(tl.float32)
        low = tl.load(zero_ptr + s * D + d, mask=dmask, other=0.0).to(tl.float32)
        x = tl.where(m2, low[None, :] + code.to(tl.float32) * step[None, :], 0.0)
        if CODEBOOK:
            ids = tl.load(ids_ptr + s * N + rows, mask=rmask, other=0).to(tl.int64)
            x += tl.load(cb_ptr + (s * n_cb + ids[:, None]) * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
    elif QUANT:
        code = _unpack(codes_ptr, s, rows, d, N, row_bytes, m2, BITS).to(tl.float32)
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
        pq_ptr, pc0_ptr, pcodes_ptr, kmu_ptr, qcb_ptr,
        Nq, N, D, P, split_len, qk_scale, jensen_coef,
        k_ncb, k_ngt, k_row_bytes, v_ncb, v_ngt, v_row_bytes, R, p_row_bytes,
        K_QUANT: tl.constexpr, K_BITS: tl.constexpr, K_G: tl.constexpr, K_AXIS_TOKEN: tl.constexpr,
        K_SYM: tl.constexpr, K_CODEBOOK: tl.constexpr, K_ALLOC: tl.constexpr,
        V_QUANT: tl.constexpr, V_BITS: tl.constexpr, V_G: tl.constexpr, V_AXIS_TOKEN: tl.constexpr,
        V_SYM: tl.constexpr, V_CODEBOOK: tl.constexpr, V_ALLOC: tl.constexpr,
        PSAC: tl.constexpr, P_BITS: tl.constexpr, JENSEN: tl.constexpr, DOT_F32: tl.constexpr,
        LOWP: tl.constexpr, K_CODES: tl.constexpr, INTERP: tl.constexpr,
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
        if K_ALLOC:  # one step per channel over the span: the term is one number per query
            st = tl.load(ks_ptr + s * D + d, mask=dmask, other=0.0).to(tl.float32)
            st = tl.where((tl.load(kf_ptr + s * D + d, mask=dmask, other=0) & 15) > 0, st, 0.0)
            jen_q = jensen_coef * tl.sum(qf * qf * (st * st)[None, :], axis=1)
        elif K_AXIS_TOKEN:
            qsq = qf * qf  # (BM, BD)
        else:
            qsq = tl.sum(tl.reshape(qf * qf, (BLOCK_M, BLOCK_D // K_G, K_G)), axis=2)  # (BM, NG)
    if PSAC:
        r = tl.arange(0, BLOCK_R)
        pq = tl.load(pq_ptr + (s * Nq + qi[:, None]) * R + r[None, :], mask=qmask[:, None] & (r[None, :] < R),
                     other=0.0)
        pc0 = tl.load(pc0_ptr + s * Nq + qi, mask=qmask, other=0.0)
    if LOWP:  # the queries' codes and row scales, and q·μ, once per program
        qf32 = q.to(tl.float32)
        mu = tl.load(kmu_ptr + s * D + d, mask=dmask, other=0.0)
        q_mu = tl.sum(qf32 * mu[None, :], axis=1)
        q_lp, q_sc = _lowp_rows(qf32, LOWP, INTERP)
        if not K_CODES:  # keys given as values: the queries' remainder, a second 8-bit term
            qr_lp, qr_sc = _lowp_rows(qf32 - q_lp.to(tl.float32) * q_sc[:, None], LOWP, INTERP)
        q3, qsum = q_lp, q_sc  # per-token channel groups read as codes: the queries' codes and sums per group
        if K_CODES and not K_AXIS_TOKEN and not K_ALLOC:
            qsum = tl.sum(tl.reshape(qf32, (BLOCK_M, BLOCK_D // K_G, K_G)), axis=2)  # (BM, NG)
            if BLOCK_D // K_G > 1:
                q3 = tl.permute(tl.reshape(q_lp, (BLOCK_M, BLOCK_D // K_G, K_G)), (1, 0, 2))  # (NG, BM, G)
    start = p * split_len
    end = tl.minimum(N, start + split_len)
    for n0 in range(start, end, BLOCK_N):
        rows = n0 + tl.arange(0, BLOCK_N)
        rmask = rows < end
        if K_CODES:
            dots = _code_dots(q_lp, q_sc, q3, qsum, qf32, kc_ptr, ks_ptr, kz_ptr, kid_ptr, kf_ptr, qcb_ptr, s, qi, qmask,
                              rows, n0, d, N, Nq, D, k_ncb, k_ngt, k_row_bytes, rmask, dmask, K_BITS, K_G,
                              K_AXIS_TOKEN, K_SYM, K_CODEBOOK, K_ALLOC, LOWP, INTERP, BLOCK_N, BLOCK_D)
        elif LOWP:  # keys less the centre and queries in two terms each (value, remainder): three products
            k = _rebuild(kc_ptr, ks_ptr, kz_ptr, kcb_ptr, kid_ptr, kf_ptr, s, rows, d, N, D, k_ncb, k_ngt, k_row_bytes,
                         rmask, dmask, K_QUANT, K_BITS, K_G, K_AXIS_TOKEN, K_SYM, K_CODEBOOK, K_ALLOC)
            kc = tl.where(rmask[:, None] & dmask[None, :], k - mu[None, :], 0.0)
            k_hi, hi_sc = _lowp_rows(kc, LOWP, INTERP)
            k_lo, lo_sc = _lowp_rows(kc - k_hi.to(tl.float32) * hi_sc[:, None], LOWP, INTERP)
            dots = (_dot_lowp(q_lp, tl.trans(k_hi), LOWP == 1, INTERP) * hi_sc[None, :]
                    + _dot_lowp(q_lp, tl.trans(k_lo), LOWP == 1, INTERP) * lo_sc[None, :]) * q_sc[:, None]
            dots += _dot_lowp(qr_lp, tl.trans(k_hi), LOWP == 1, INTERP) * hi_sc[None, :] * qr_sc[:, None] + q_mu[:, None]
        else:
            k = _rebuild(kc_ptr, ks_ptr, kz_ptr, kcb_ptr, kid_ptr, kf_ptr, s, rows, d, N, D, k_ncb, k_ngt, k_row_bytes,
                         rmask, dmask, K_QUANT, K_BITS, K_G, K_AXIS_TOKEN, K_SYM, K_CODEBOOK, K_ALLOC)
            dots = _dot(q, tl.trans(k), q.dtype, DOT_F32)  # (BM, BN)
        if PSAC:
            pmask = rmask[:, None] & (r[None, :] < R)
            a = tl.where(pmask, _unpack(pcodes_ptr, s, rows, r, N, p_row_bytes, pmask, P_BITS).to(tl.float32), 0.0)
            dots += tl.dot(pq, tl.trans(a), input_precision="ieee") + pc0[:, None]
        logits = dots * qk_scale
        if JENSEN:
            if K_ALLOC:
                logits += jen_q[:, None]
            elif K_AXIS_TOKEN:
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
                     rmask, dmask, V_QUANT, V_BITS, V_G, V_AXIS_TOKEN, V_SYM, V_CODEBOOK, V_ALLOC)
        if LOWP:  # P as it is (in [0, 1]), V with one scale per channel of the block
            vmax = tl.max(tl.abs(v), axis=0)
            v_sc = tl.where(vmax > 0, vmax / 448.0, 1.0)
            pv = _dot_lowp(_to_e4m3(pexp, INTERP), _to_e4m3(v / v_sc[None, :], INTERP), False, INTERP) * v_sc[None, :]
        else:
            pv = _dot(pexp, v, q.dtype, DOT_F32)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    tl.store(m_ptr + state, m_i, mask=qmask)
    tl.store(l_ptr + state, l_i, mask=qmask)
    tl.store(acc_ptr + state[:, None].to(tl.int64) * D + d[None, :], acc, mask=qmask[:, None] & dmask[None, :])


def _dot_f32(dtype: torch.dtype) -> bool:
    """fp32 inputs take IEEE fp32 dots. So do bf16 inputs under TRITON_INTERPRET=1: the interpreter's bf16
    tl.dot returns garbage and its fp32 -> bf16 cast truncates (Triton 3.7.1), so there the bf16 path keeps
    fp32 tiles (loads stay bf16). On a GPU, bf16 and fp16 inputs take tensor-core dots in their dtype."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1")


def capability(t: torch.Tensor) -> tuple[int, int] | None:
    """The CUDA compute capability of t's device; None off CUDA (the interpreter reads every dtype)."""
    return torch.cuda.get_device_capability(t.device) if t.is_cuda else None


def _loadable(t: torch.Tensor | None, fp8: bool) -> torch.Tensor | None:
    """t as the kernel may load it: fp8 tensors (stored scales, codebooks) widened to fp16 on GPUs without fp8
    loads (compute capability below 8.9: Triton has no e4m3 there). Exact: every e4m3 value is an fp16 value."""
    if t is None:
        return None
    return t.half().contiguous() if not fp8 and t.dtype == torch.float8_e4m3fn else t.contiguous()


def _side_args(side: dict, S: int, N: int, D: int, dummy: torch.Tensor, what: str, fp8: bool = True):
    """Pointers, runtime sizes and constexprs of one side (keys or values) of a span."""
    if "full" in side:
        f = _loadable(side["full"], fp8)
        if tuple(f.shape) != (S, N, D):
            raise ValueError(f"{what}: full-precision tensor must be {(S, N, D)}, got {tuple(f.shape)}")
        return [dummy] * 5 + [f], [0, 0, 0], dict(QUANT=False, BITS=2, G=1, AXIS_TOKEN=False,
                                                               SYM=False, CODEBOOK=False, ALLOC=False)
    cb, ids = side.get("codebook"), side.get("ids")
    if "alloc_codes" in side:  # the allocator's channels: codes, steps, low ends, and the channel table in "full"
        meta, step, low = side["alloc_meta"], side["alloc_step"], side["alloc_low"]
        if tuple(meta.shape) != (S, D) or tuple(step.shape) != (S, D) or tuple(low.shape) != (S, D) or \
                side["n_tokens"] != N:
            raise ValueError(f"{what}: the allocator's tables must be {(S, D)} over {N} tokens, got "
                             f"{tuple(meta.shape)}, {tuple(step.shape)}, {tuple(low.shape)} over {side['n_tokens']}")
        ptrs = [side["alloc_codes"].contiguous(), _loadable(step, fp8), low.float().contiguous(),
                dummy if cb is None else _loadable(cb, fp8), dummy if ids is None else ids.contiguous(),
                meta.contiguous()]
        return ptrs, [0 if cb is None else cb.shape[1], 0, 0], dict(
            QUANT=True, BITS=8, G=1, AXIS_TOKEN=False, SYM=False, CODEBOOK=cb is not None, ALLOC=True)
    bits, G, axis, sym = side["bits"], side["group_size"], side["axis"], side["symmetric"]
    if bits not in (2, 4, 8):
        raise ValueError(f"{what}: the fused kernel reads 2-, 4- or 8-bit codes, got {bits}")
    if axis == "channel" and (D % G or G & (G - 1)):
        raise ValueError(f"{what}: per-token groups must be a power of two dividing D={D}, got {G}")
    row_bytes = (D * bits + 7) // 8
    if tuple(side["codes"].shape) != (S, N, row_bytes):
        raise ValueError(f"{what}: codes must be {(S, N, row_bytes)}, got {tuple(side['codes'].shape)}")
    n_gt = triton.cdiv(N, G)
    zero = side.get("zeros")
    ptrs = [side["codes"].contiguous(), _loadable(side["scales"], fp8), dummy if zero is None else _loadable(zero, fp8),
            dummy if cb is None else _loadable(cb, fp8), dummy if ids is None else ids.contiguous(), dummy]
    return ptrs, [0 if cb is None else cb.shape[1], n_gt, row_bytes], dict(
        QUANT=True, BITS=bits, G=G, AXIS_TOKEN=axis == "token", SYM=sym, CODEBOOK=cb is not None, ALLOC=False)


def _reads_codes(side: dict, D: int, lowp: str) -> bool:
    """Whether the 8-bit path reads this key side's codes as operands: quantwm/core/fp8.py's `reads_codes`, the
    rule the emulation follows (kernels import nothing of quantwm; tests/test_kernels.py checks the two agree)."""
    if "alloc_codes" in side:
        return lowp == "int8" or bool(((side["alloc_meta"] & 15) <= 4).all())  # e4m3 only: a host sync
    if "codes" not in side or (lowp == "e4m3" and side["bits"] > 4):
        return False
    G = side["group_size"]
    return G >= 16 and D % G == 0 if side["axis"] == "channel" else G % BLOCK_N == 0


LOWP = {None: 0, "int8": 1, "e4m3": 2}
# 8 warps, no software pipelining: with 4 warps or 2-3 stages ptxas spills 1-3 KB per thread at D = 128 (sm_90,
# benchmarks/compile_check.py); of the six settings compiled these spill least
NUM_WARPS = 8
NUM_STAGES = 1
# keys per tile: with 64, the rebuilt key and value tiles (codes, scales, zeros, codebook rows in registers at
# once) spill 0.6-0.9 KB per thread on sm_90; with 32, at most 0.33 KB (quantwm+jensen), none for BF16 spans.
# quantwm/core/fp8.py's BLOCK (the 8-bit path's PV block) is the same number.
BLOCK_N = 32


def span_attention(q: torch.Tensor, acc: torch.Tensor, m: torch.Tensor, l: torch.Tensor, k: dict, v: dict,
                   scale: float, psac: dict | None = None, jensen: bool = False, lowp: str | None = None) -> None:
    """Fold one span into the running softmax state, in place.

    q (S, Nq, D) post-RoPE queries (fp32 or bf16/fp16: the dot products run in q's dtype);
    acc (S, P, Nq, D), m and l (S, P, Nq) fp32: the state of P splits (start: acc 0, m -inf, l 0);
    k, v: {"full": (S, N, D)} or {"codes": uint8 (S, N, D*bits/8), "scales", "zeros" (absent when
    symmetric), "bits", "group_size", "axis" ("channel" | "token"), "symmetric", optional "codebook"
    (S, K, D) and "ids" (S, N)} or the allocator's {"alloc_codes": uint8 buffer, "alloc_meta": (S, D) int64
    byte offset * 16 + bits, "alloc_step", "alloc_low" (S, D), "n_tokens", optional
    "codebook" and "ids"} (quantwm/core/allocate.py `fused_side`); psac (keys only): {"qs": (S, Nq, R) fp32 (Uᵀq)·coefficient scale,
    "c0": (S, Nq) fp32 Σ_r (Uᵀq)_r zero_r, "codes": uint8 (S, N, R*bits/8), "bits"}; jensen: subtract
    the Jensen term (quantized keys only); lowp: None, "int8" or "e4m3", the 8-bit products (k then needs
    "center", (S, D) fp32, the keys' centre).
    """
    if q.dim() != 3:
        raise ValueError(f"q must be (S, Nq, D), got shape {tuple(q.shape)}")
    S, Nq, D = q.shape
    P = acc.shape[1]
    if tuple(acc.shape) != (S, P, Nq, D) or tuple(m.shape) != (S, P, Nq) or tuple(l.shape) != (S, P, Nq):
        raise ValueError("state must be acc (S, P, Nq, D), m and l (S, P, Nq) matching q")
    if not (acc.is_contiguous() and m.is_contiguous() and l.is_contiguous()):
        raise ValueError("the softmax state tensors must be contiguous (they are updated in place)")
    N = k["n_tokens"] if "alloc_codes" in k else (k["full"] if "full" in k else k["codes"]).shape[1]
    if N == 0 or Nq == 0:
        return
    if jensen and "full" in k:
        raise ValueError("the Jensen term applies to quantized keys only")
    if lowp not in LOWP:
        raise ValueError(f"lowp must be None, 'int8' or 'e4m3', got {lowp!r}")
    cap = capability(q)
    fp8 = cap is None or cap >= (8, 9)
    if lowp is not None and not fp8:
        raise ValueError(f"lowp={lowp!r} multiplies e4m3 probabilities and values on fp8 tensor cores (compute "
                         f"capability 8.9 or newer: Ada, Hopper, Blackwell); this GPU is {cap[0]}.{cap[1]}")
    dummy = q
    mu, qcb = dummy, dummy
    if lowp is not None:
        mu = k.get("center")
        if mu is None or tuple(mu.shape) != (S, D):
            raise ValueError(f"lowp needs the keys' centre k['center'] of shape {(S, D)}, got "
                             f"{None if mu is None else tuple(mu.shape)}")
        mu = mu.float().contiguous()
        codes = _reads_codes(k, D, lowp)
        if codes and "codebook" in k:  # each query's products with the codebook rows, gathered per key
            qcb = torch.bmm(q.float(), k["codebook"].float().transpose(1, 2)).contiguous()
    else:
        codes = False
    kp, ka, kc = _side_args(k, S, N, D, dummy, "keys", fp8)
    vp, va, vc = _side_args(v, S, N, D, dummy, "values", fp8)
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
    BLOCK_D = max(16, triton.next_power_of_2(D))
    split_len = triton.cdiv(triton.cdiv(N, P), BLOCK_N) * BLOCK_N
    grid = (S, triton.cdiv(Nq, BLOCK_M), P)
    _span_attention_kernel[grid](
        q.contiguous(), acc, m, l, *kp, *vp, *pp, mu, qcb,
        Nq, N, D, P, split_len, float(scale) * math.log2(math.e), -(float(scale) ** 2 / 24) * math.log2(math.e),
        *ka, *va, R, p_row_bytes,
        K_QUANT=kc["QUANT"], K_BITS=kc["BITS"], K_G=kc["G"], K_AXIS_TOKEN=kc["AXIS_TOKEN"], K_SYM=kc["SYM"],
        K_CODEBOOK=kc["CODEBOOK"], K_ALLOC=kc["ALLOC"],
        V_QUANT=vc["QUANT"], V_BITS=vc["BITS"], V_G=vc["G"], V_AXIS_TOKEN=vc["AXIS_TOKEN"], V_SYM=vc["SYM"],
        V_CODEBOOK=vc["CODEBOOK"], V_ALLOC=vc["ALLOC"],
        PSAC=psac is not None, P_BITS=p_bits, JENSEN=jensen, DOT_F32=_dot_f32(q.dtype),
        LOWP=LOWP[lowp], K_CODES=codes, INTERP=os.environ.get("TRITON_INTERPRET") == "1",
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, BLOCK_R=16, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
