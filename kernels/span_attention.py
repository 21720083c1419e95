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
of quantwm/core/fp8.py. QKᵀ: quantized keys whose layout `reads_codes` (quantwm/core/layouts) enter as their integer codes, exact,
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
in one buffer with a table of byte offsets and widths (kernels/span_args.py's CHANNELS form), read code by code
(codes of 3, 5, 6 or 7 bits straddle two bytes); and `quantwm-trellis`'s per-channel trellis codes in the same
buffer (the TRELLIS form), each sample read as the 8-bit window of its channel's stream that ends with its code
and decoded by QTIP's computed codebook. Keys must be post-RoPE (pre-RoPE caches use the reference
path; see quantwm/core/attention.py for why).

Each side arrives as a `SideArgs` (kernels/span_args.py) that the span's layout built once; the launcher turns it
into six pointers (data, scales, zeros, the channel table, codebook, ids) and the side's constexprs. The tile
helpers (unpacking, rebuilding, the 8-bit dots) live in kernels/span_tiles.py.
"""
from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import span_args as args
from .span_args import BLOCK_N, PsacArgs, SideArgs
from .span_tiles import CHANNELS, TRELLIS, _code_dots, _dot, _dot_lowp, _lowp_rows, _rebuild, _to_e4m3, _unpack

# a TRELLIS channel's equivalent grid step per unit of its scale, by width (span_args.TRELLIS_ERROR_STEP)
E1: tl.constexpr = tl.constexpr(args.TRELLIS_ERROR_STEP[1])
E2: tl.constexpr = tl.constexpr(args.TRELLIS_ERROR_STEP[2])
E3: tl.constexpr = tl.constexpr(args.TRELLIS_ERROR_STEP[3])
E4: tl.constexpr = tl.constexpr(args.TRELLIS_ERROR_STEP[4])
E5: tl.constexpr = tl.constexpr(args.TRELLIS_ERROR_STEP[5])
E6: tl.constexpr = tl.constexpr(args.TRELLIS_ERROR_STEP[6])
E7: tl.constexpr = tl.constexpr(args.TRELLIS_ERROR_STEP[7])
E8: tl.constexpr = tl.constexpr(args.TRELLIS_ERROR_STEP[8])


@triton.jit
def _trellis_error_step(bits):
    """The factor of TRELLIS_ERROR_STEP at each width (0 at width 0)."""
    f = tl.where(bits == 1, E1, 0.0)
    f = tl.where(bits == 2, E2, f)
    f = tl.where(bits == 3, E3, f)
    f = tl.where(bits == 4, E4, f)
    f = tl.where(bits == 5, E5, f)
    f = tl.where(bits == 6, E6, f)
    f = tl.where(bits == 7, E7, f)
    return tl.where(bits == 8, E8, f)


@triton.jit
def _span_attention_kernel(
        q_ptr, acc_ptr, m_ptr, l_ptr,
        k_data, k_scales, k_zeros, k_meta, k_cb, k_ids, k_table,
        v_data, v_scales, v_zeros, v_meta, v_cb, v_ids, v_table,
        pq_ptr, pc0_ptr, pcodes_ptr, kmu_ptr, qcb_ptr,
        Nq, N, D, P, split_len, qk_scale, jensen_coef, k_ncb, v_ncb, R,
        K_FORM: tl.constexpr, K_BITS: tl.constexpr, K_G: tl.constexpr, K_AXIS_TOKEN: tl.constexpr,
        K_SYM: tl.constexpr, K_CODEBOOK: tl.constexpr,
        V_FORM: tl.constexpr, V_BITS: tl.constexpr, V_G: tl.constexpr, V_AXIS_TOKEN: tl.constexpr,
        V_SYM: tl.constexpr, V_CODEBOOK: tl.constexpr,
        PSAC: tl.constexpr, P_BITS: tl.constexpr, JENSEN: tl.constexpr, DOT_F32: tl.constexpr,
        LOWP: tl.constexpr, K_CODES: tl.constexpr, INTERP: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    """Fold one span (keys K_*, values V_*: kernels/span_args.py's sides) into the softmax state of P splits."""
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
        if K_FORM == CHANNELS or K_FORM == TRELLIS:  # one step per channel over the span: one number per query
            st = tl.load(k_scales + s * D + d, mask=dmask, other=0.0).to(tl.float32)
            kmeta = tl.load(k_meta + s * D + d, mask=dmask, other=0)
            kbits = kmeta & 15
            if K_FORM == TRELLIS:  # a trellis channel's equivalent step; a grid channel's (16 in its meta) its own
                st = tl.where(((kmeta >> 4) & 1) != 0, st, st * _trellis_error_step(kbits))
            st = tl.where(kbits > 0, st, 0.0)
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
        if K_CODES and not K_AXIS_TOKEN and K_FORM != CHANNELS:
            qsum = tl.sum(tl.reshape(qf32, (BLOCK_M, BLOCK_D // K_G, K_G)), axis=2)  # (BM, NG)
            if BLOCK_D // K_G > 1:
                q3 = tl.permute(tl.reshape(q_lp, (BLOCK_M, BLOCK_D // K_G, K_G)), (1, 0, 2))  # (NG, BM, G)
    start = p * split_len
    end = tl.minimum(N, start + split_len)
    for n0 in range(start, end, BLOCK_N):
        rows = n0 + tl.arange(0, BLOCK_N)
        rmask = rows < end
        if K_CODES:
            dots = _code_dots(q_lp, q_sc, q3, qsum, qf32, k_data, k_scales, k_zeros, k_meta, k_ids, qcb_ptr, s, qi,
                              qmask, rows, n0, d, N, Nq, D, k_ncb, rmask, dmask, K_FORM, K_BITS, K_G, K_AXIS_TOKEN,
                              K_SYM, K_CODEBOOK, LOWP, INTERP, BLOCK_N, BLOCK_D)
        elif LOWP:  # keys less the centre and queries in two terms each (value, remainder): three products
            k = _rebuild(k_data, k_scales, k_zeros, k_meta, k_cb, k_ids, k_table, s, rows, d, N, D, k_ncb, rmask, dmask,
                         K_FORM, K_BITS, K_G, K_AXIS_TOKEN, K_SYM, K_CODEBOOK)
            kc = tl.where(rmask[:, None] & dmask[None, :], k - mu[None, :], 0.0)
            k_hi, hi_sc = _lowp_rows(kc, LOWP, INTERP)
            k_lo, lo_sc = _lowp_rows(kc - k_hi.to(tl.float32) * hi_sc[:, None], LOWP, INTERP)
            dots = (_dot_lowp(q_lp, tl.trans(k_hi), LOWP == 1, INTERP) * hi_sc[None, :]
                    + _dot_lowp(q_lp, tl.trans(k_lo), LOWP == 1, INTERP) * lo_sc[None, :]) * q_sc[:, None]
            dots += _dot_lowp(qr_lp, tl.trans(k_hi), LOWP == 1, INTERP) * hi_sc[None, :] * qr_sc[:, None] + q_mu[:, None]
        else:
            k = _rebuild(k_data, k_scales, k_zeros, k_meta, k_cb, k_ids, k_table, s, rows, d, N, D, k_ncb, rmask, dmask,
                         K_FORM, K_BITS, K_G, K_AXIS_TOKEN, K_SYM, K_CODEBOOK)
            dots = _dot(q, tl.trans(k), q.dtype, DOT_F32)  # (BM, BN)
        if PSAC:
            pmask = rmask[:, None] & (r[None, :] < R)
            a = tl.where(pmask, _unpack(pcodes_ptr, s, rows, r, N, R, pmask, P_BITS).to(tl.float32), 0.0)
            dots += tl.dot(pq, tl.trans(a), input_precision="ieee") + pc0[:, None]
        logits = dots * qk_scale
        if JENSEN:
            if K_FORM == CHANNELS or K_FORM == TRELLIS:
                logits += jen_q[:, None]
            elif K_AXIS_TOKEN:
                sidx = (s * ((N + K_G - 1) // K_G) + rows[:, None] // K_G).to(tl.int64) * D + d[None, :]
                st = tl.load(k_scales + sidx, mask=rmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
                logits += jensen_coef * tl.dot(qsq, tl.trans(st * st), input_precision="ieee")
            else:
                g = tl.arange(0, BLOCK_D // K_G)
                sidx = (s * N + rows[:, None]).to(tl.int64) * (D // K_G) + g[None, :]
                st = tl.load(k_scales + sidx, mask=rmask[:, None] & (g[None, :] < D // K_G), other=0.0).to(tl.float32)
                logits += jensen_coef * tl.sum(qsq[:, None, :] * (st * st)[None, :, :], axis=2)
        logits = tl.where(rmask[None, :], logits, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, axis=1))
        alpha = tl.exp2(m_i - m_new)
        pexp = tl.exp2(logits - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pexp, axis=1)
        v = _rebuild(v_data, v_scales, v_zeros, v_meta, v_cb, v_ids, v_table, s, rows, d, N, D, v_ncb, rmask, dmask,
                     V_FORM, V_BITS, V_G, V_AXIS_TOKEN, V_SYM, V_CODEBOOK)
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


def _loadable(t: torch.Tensor | None, fp8: bool, dummy: torch.Tensor) -> torch.Tensor:
    """t as the kernel may load it (`dummy` for an absent tensor): fp8 tensors (stored scales, codebooks) widened
    to fp16 on GPUs without fp8 loads (compute capability below 8.9: Triton has no e4m3 there). Exact: every e4m3
    value is an fp16 value. A fallback for sides built elsewhere: the layouts widen their sides once, when they
    build them (quantwm/core/layouts/base.py), so this copies nothing for theirs."""
    if t is None:
        return dummy
    return t.half().contiguous() if not fp8 and t.dtype == torch.float8_e4m3fn else t.contiguous()


class _Side(NamedTuple):
    """One side's kernel arguments: seven pointers (data, scales, zeros, meta, codebook, ids, table), the codebook's row
    count, and the side's constexprs (FORM, BITS, G, AXIS_TOKEN, SYM, CODEBOOK)."""

    pointers: tuple
    n_codebook: int
    constants: tuple


def _check_side(side: SideArgs, S: int, N: int, D: int, what: str) -> None:
    """Shapes the kernel relies on; a clear error instead of reading out of bounds."""
    if side.n_tokens != N:
        raise ValueError(f"{what}: {side.n_tokens} tokens, the keys have {N}")
    if side.form == args.FULL and tuple(side.data.shape) != (S, N, D):
        raise ValueError(f"{what}: full-precision tensor must be {(S, N, D)}, got {tuple(side.data.shape)}")
    if side.form in (args.CHANNELS, args.TRELLIS) and not (tuple(side.meta.shape) == tuple(side.scales.shape) == tuple(side.zeros.shape)
                                      == (S, D)):
        raise ValueError(f"{what}: the channel table, steps and low ends must be {(S, D)}, got "
                         f"{tuple(side.meta.shape)}, {tuple(side.scales.shape)}, {tuple(side.zeros.shape)}")
    if side.form == args.TRELLIS and (side.table is None or tuple(side.table.shape) != (9, 1 << args.TRELLIS_STATE_BITS)
                                      or side.table.dtype != torch.float32):
        raise ValueError(f"{what}: a trellis side reads its widths' value tables, (9, {1 << args.TRELLIS_STATE_BITS}) "
                         f"float32, got {None if side.table is None else (tuple(side.table.shape), side.table.dtype)}")
    if side.form == args.GROUPED:
        G, row_bytes = side.group_size, (D * side.bits + 7) // 8
        if side.bits not in (2, 4, 8):
            raise ValueError(f"{what}: the fused kernel reads 2-, 4- or 8-bit codes, got {side.bits}")
        if not side.axis_token and (D % G or G & (G - 1)):
            raise ValueError(f"{what}: per-token groups must be a power of two dividing D={D}, got {G}")
        if tuple(side.data.shape) != (S, N, row_bytes):
            raise ValueError(f"{what}: codes must be {(S, N, row_bytes)}, got {tuple(side.data.shape)}")


def _side(side: SideArgs, S: int, N: int, D: int, dummy: torch.Tensor, what: str, fp8: bool) -> _Side:
    _check_side(side, S, N, D, what)
    pointers = (_loadable(side.data, fp8, dummy), _loadable(side.scales, fp8, dummy),
                _loadable(side.zeros, fp8, dummy), _loadable(side.meta, fp8, dummy),
                _loadable(side.codebook, fp8, dummy), _loadable(side.ids, fp8, dummy), _loadable(side.table, fp8, dummy))
    n_cb = 0 if side.codebook is None else side.codebook.shape[1]
    constants = (side.form, side.bits or 2, side.group_size, side.axis_token, side.symmetric, side.codebook is not None)
    return _Side(pointers, n_cb, constants)


def _reads_codes(side: SideArgs, D: int, lowp: str) -> bool:
    """Whether the 8-bit path reads this key side's codes as operands: the rule of the layouts' `reads_codes`
    (quantwm/core/layouts), which the emulation follows (kernels import nothing of quantwm; tests/test_kernels.py
    checks the two agree)."""
    if side.form == args.CHANNELS:
        return lowp == "int8" or side.max_bits <= 4
    if side.form != args.GROUPED or (lowp == "e4m3" and side.bits > 4):
        return False
    G = side.group_size
    return G % BLOCK_N == 0 if side.axis_token else G >= 16 and D % G == 0


LOWP = {None: 0, "int8": 1, "e4m3": 2}
# 8 warps, no software pipelining: with 4 warps or 2-3 stages ptxas spills 1-3 KB per thread at D = 128 (sm_90,
# benchmarks/compile_check.py); of the six settings compiled these spill least. Key tiles are BLOCK_N = 32 rows
# (kernels/span_args.py): with 64, the rebuilt key and value tiles spill 0.6-0.9 KB per thread on sm_90; with
# 32, at most 0.33 KB (quantwm+jensen), none for BF16 spans.
NUM_WARPS = 8
NUM_STAGES = 1


def span_attention(q: torch.Tensor, acc: torch.Tensor, m: torch.Tensor, l: torch.Tensor, k: SideArgs, v: SideArgs,
                   scale: float, psac: PsacArgs | None = None, jensen: bool = False, lowp: str | None = None,
                   center: torch.Tensor | None = None) -> None:
    """Fold one span into the running softmax state, in place.

    q (S, Nq, D) post-RoPE queries (fp32 or bf16/fp16: the dot products run in q's dtype);
    acc (S, P, Nq, D), m and l (S, P, Nq) fp32: the state of P splits (start: acc 0, m -inf, l 0);
    k, v: the span's sides (kernels/span_args.py `SideArgs`, which its layout builds once); psac (keys only):
    `PsacArgs`; jensen: subtract the Jensen term (quantized keys only); lowp: None, "int8" or "e4m3", the 8-bit
    products, with `center` (S, D) fp32 the keys' centre.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be (S, Nq, D), got shape {tuple(q.shape)}")
    S, Nq, D = q.shape
    P = acc.shape[1]
    if tuple(acc.shape) != (S, P, Nq, D) or tuple(m.shape) != (S, P, Nq) or tuple(l.shape) != (S, P, Nq):
        raise ValueError("state must be acc (S, P, Nq, D), m and l (S, P, Nq) matching q")
    if not (acc.is_contiguous() and m.is_contiguous() and l.is_contiguous()):
        raise ValueError("the softmax state tensors must be contiguous (they are updated in place)")
    N = k.n_tokens
    if N == 0 or Nq == 0:
        return
    if jensen and k.form == args.FULL:
        raise ValueError("the Jensen term applies to quantized keys only")
    if lowp not in LOWP:
        raise ValueError(f"lowp must be None, 'int8' or 'e4m3', got {lowp!r}")
    cap = capability(q)
    fp8 = cap is None or cap >= (8, 9)
    if lowp is not None and not fp8:
        raise ValueError(f"lowp={lowp!r} multiplies e4m3 probabilities and values on fp8 tensor cores (compute "
                         f"capability 8.9 or newer: Ada, Hopper, Blackwell); this GPU is {cap[0]}.{cap[1]}")
    dummy = q
    mu, qcb, codes = dummy, dummy, False
    if lowp is not None:
        if center is None or tuple(center.shape) != (S, D):
            raise ValueError(f"lowp needs the keys' centre of shape {(S, D)}, got "
                             f"{None if center is None else tuple(center.shape)}")
        mu = center.float().contiguous()
        codes = _reads_codes(k, D, lowp)
        if codes and k.codebook is not None:  # each query's products with the codebook rows, gathered per key
            qcb = torch.bmm(q.float(), k.codebook.float().transpose(1, 2)).contiguous()
    ks, vs = _side(k, S, N, D, dummy, "keys", fp8), _side(v, S, N, D, dummy, "values", fp8)
    if psac is not None:
        R = psac.qs.shape[-1]
        if k.form == args.FULL or tuple(psac.codes.shape) != (S, N, (R * psac.bits + 7) // 8) or R > 16 or \
                psac.bits not in (2, 4, 8):
            raise ValueError("PSAC needs quantized keys, codes (S, N, R*bits/8), R <= 16 and bits 2, 4 or 8")
        pp, p_bits = (psac.qs.float().contiguous(), psac.c0.float().contiguous(), psac.codes.contiguous()), psac.bits
    else:
        R, pp, p_bits = 0, (dummy,) * 3, 4
    BLOCK_M = 64 if Nq > 32 else 16
    BLOCK_D = max(16, triton.next_power_of_2(D))
    split_len = triton.cdiv(triton.cdiv(N, P), BLOCK_N) * BLOCK_N
    # splits past the span's last tile would load their state and store it back unchanged: not launched
    grid = (S, triton.cdiv(Nq, BLOCK_M), min(P, triton.cdiv(N, split_len)))
    _span_attention_kernel[grid](
        q.contiguous(), acc, m, l, *ks.pointers, *vs.pointers, *pp, mu, qcb,
        Nq, N, D, P, split_len, float(scale) * math.log2(math.e), -(float(scale) ** 2 / 24) * math.log2(math.e),
        ks.n_codebook, vs.n_codebook, R, *ks.constants, *vs.constants,
        PSAC=psac is not None, P_BITS=p_bits, JENSEN=jensen, DOT_F32=_dot_f32(q.dtype),
        LOWP=LOWP[lowp], K_CODES=codes, INTERP=os.environ.get("TRITON_INTERPRET") == "1",
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, BLOCK_R=16, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
