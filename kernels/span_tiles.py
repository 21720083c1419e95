"""Tile helpers of the fused span-attention kernel (kernels/span_attention.py): rounding to 8-bit formats, the
8-bit dots, unpacking codes, reading the allocator's per-channel codes, rebuilding a key or value tile from a
span side (kernels/span_args.py's forms) and the integer-code QKᵀ of the 8-bit path. Triton JIT functions only.
"""
import triton
import triton.language as tl

from . import span_args

# the side forms of kernels/span_args.py as constexprs, which JIT code may read
FULL: tl.constexpr = tl.constexpr(span_args.FULL)
GROUPED: tl.constexpr = tl.constexpr(span_args.GROUPED)
CHANNELS: tl.constexpr = tl.constexpr(span_args.CHANNELS)
TRELLIS: tl.constexpr = tl.constexpr(span_args.TRELLIS)
STATE_BITS: tl.constexpr = tl.constexpr(span_args.TRELLIS_STATE_BITS)


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
def _unpack(codes_ptr, s, rows, d, N, width, m2, BITS: tl.constexpr):
    """The (BLOCK_N, BLOCK_D) int32 codes of token rows `rows` of stream s (0 outside m2); a row packs `width`
    codes of BITS bits."""
    PER: tl.constexpr = 8 // BITS
    row_bytes = (width * BITS + 7) // 8
    b = tl.load(codes_ptr + (s * N + rows[:, None]).to(tl.int64) * row_bytes + d[None, :] // PER, mask=m2, other=0)
    return (b.to(tl.int32) >> ((d[None, :] % PER) * BITS)) & ((1 << BITS) - 1)


@triton.jit
def _channel_codes(codes_ptr, meta_ptr, s, rows, d, D, m2, dmask):
    """(codes (BN, BD) int32, bits (BD,) int32) of the allocator's channels (a CHANNELS side) for token rows `rows` of stream s:
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
def _code_dots(q_lp, q_sc, q3, qsum, qf32, codes_ptr, scale_ptr, zero_ptr, meta_ptr, ids_ptr, qcb_ptr, s, qi, qmask,
               rows, n0, d, N, Nq, D, n_cb, rmask, dmask, FORM: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
               AXIS_TOKEN: tl.constexpr, SYM: tl.constexpr, CODEBOOK: tl.constexpr,
               LOWP: tl.constexpr, INTERP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """q·k̂ (BM, BN) of a key tile read as its codes u = code - 2^(b-1), exact 8-bit operands (fp8.code_dots):
    k̂ = u s + z' (+ codebook row), z' = zero + 2^(b-1) s (s when symmetric; the allocator's low end + 2^(b-1) s,
    its channels one token group)."""
    m2 = rmask[:, None] & dmask[None, :]
    ALLOC: tl.constexpr = FORM == CHANNELS
    if ALLOC:
        code, bits = _channel_codes(codes_ptr, meta_ptr, s, rows, d, D, m2, dmask)
        half = tl.where(bits > 0, 1 << tl.maximum(bits - 1, 0), 0)  # (BD,)
        u = tl.where(m2, code - half[None, :], 0).to(tl.float32)
    else:
        u = tl.where(m2, _unpack(codes_ptr, s, rows, d, N, D, m2, BITS) - (1 << (BITS - 1)), 0).to(tl.float32)
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
            sidx = (s * ((N + G - 1) // G) + n0 // G).to(tl.int64) * D + d
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
def _trellis_values(codes_ptr, meta_ptr, table_ptr, s, rows, d, N, D, m2, dmask):
    """(values (BN, BD) fp32, bits (BD,) int32) of a TRELLIS side's samples `rows` of stream s (meta = offset * 32 +
    16 on a grid channel + bits). A trellis channel's state is the STATE_BITS bits of its stream ending where the
    sample's code ends, the bits before the stream's first read from its end where it holds at least STATE_BITS
    bits (tail-biting), else 0 (each part at most two bytes, all the channel's own), and its value that width's entry
    for the state in table_ptr, the (9, 2^STATE_BITS) fp32 tables of quantwm/core/trellis.py's `tables` (one load);
    a grid channel's value is its code.
    0-bit channels and rows outside m2 read 0."""
    meta = tl.load(meta_ptr + s * D + d, mask=dmask, other=0)
    bits = (meta & 15).to(tl.int32)
    grid = ((meta >> 4) & 1) != 0  # a channel on its uniform grid: code t at bits [t b, t b + b)
    base = (meta >> 5)[None, :] * 8  # the channel's first bit (int64)
    end = (rows[:, None] + 1) * bits[None, :]  # int32 from here: a stream holds fewer than 2^31 bits
    first = tl.maximum(end - STATE_BITS, 0)
    length = end - first
    live = m2 & (bits[None, :] > 0)
    state = (_stream_bits(codes_ptr, base + first, length, live) << STATE_BITS) >> length  # in the state's top bits
    if tl.min(rows, axis=0) < STATE_BITS - 1:  # a tile holding a channel's first samples (the span's first tile)
        n_bits = N * bits[None, :]  # the stream's length
        wrap = live & (end < STATE_BITS) & (n_bits >= STATE_BITS)
        missing = tl.where(wrap, STATE_BITS - end, 0)  # the window's oldest bits: the stream's last ones
        state |= _stream_bits(codes_ptr, base + (n_bits - missing), missing, wrap)
    value = tl.load(table_ptr + ((bits << STATE_BITS)[None, :] + state), mask=live, other=0.0)
    on_grid = live & grid[None, :]
    code = _stream_bits(codes_ptr, base + rows[:, None] * bits[None, :], bits[None, :], on_grid)
    return tl.where(live, tl.where(on_grid, code.to(tl.float32), value), 0.0), bits


@triton.jit
def _stream_bits(codes_ptr, pos, length, live):
    """The `length` (at most 17) bits of the code buffer from bit `pos` (int64) on, little-endian (int32; 0 where not
    live)."""
    byte = pos // 8
    shift = (pos % 8).to(tl.int32)
    b0 = tl.load(codes_ptr + byte, mask=live, other=0).to(tl.int32)
    b1 = tl.load(codes_ptr + byte + 1, mask=live & (shift + length > 8), other=0).to(tl.int32)
    b2 = tl.load(codes_ptr + byte + 2, mask=live & (shift + length > 16), other=0).to(tl.int32)
    return ((b0 | (b1 << 8) | (b2 << 16)) >> shift) & ((1 << length) - 1)


@triton.jit
def _rebuild(data_ptr, scale_ptr, zero_ptr, meta_ptr, cb_ptr, ids_ptr, table_ptr, s, rows, d, N, D, n_cb, rmask, dmask,
             FORM: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, AXIS_TOKEN: tl.constexpr, SYM: tl.constexpr,
             CODEBOOK: tl.constexpr):
    """A (BLOCK_N, BLOCK_D) fp32 tile of rebuilt keys or values for token rows `rows` of stream s (0 outside the
    tile's rows), from a side of form FORM (kernels/span_args.py): FULL reads data_ptr as (S, N, D) values;
    GROUPED unpacks its codes against per-group scales and zeros; CHANNELS reads its codes through the channel
    table meta_ptr against per-channel steps (scale_ptr) and low ends (zero_ptr); TRELLIS its trellis states
    through the same table, against per-channel scales (scale_ptr) and means (zero_ptr)."""
    m2 = rmask[:, None] & dmask[None, :]
    if FORM == TRELLIS:
        value, _ = _trellis_values(data_ptr, meta_ptr, table_ptr, s, rows, d, N, D, m2, dmask)
        scale = tl.load(scale_ptr + s * D + d, mask=dmask, other=0.0).to(tl.float32)
        mean = tl.load(zero_ptr + s * D + d, mask=dmask, other=0.0).to(tl.float32)
        x = tl.where(m2, mean[None, :] + value * scale[None, :], 0.0)
        if CODEBOOK:
            ids = tl.load(ids_ptr + s * N + rows, mask=rmask, other=0).to(tl.int64)
            x += tl.load(cb_ptr + (s * n_cb + ids[:, None]) * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
    elif FORM == CHANNELS:
        code, _ = _channel_codes(data_ptr, meta_ptr, s, rows, d, D, m2, dmask)
        step = tl.load(scale_ptr + s * D + d, mask=dmask, other=0.0).to(tl.float32)
        low = tl.load(zero_ptr + s * D + d, mask=dmask, other=0.0).to(tl.float32)
        x = tl.where(m2, low[None, :] + code.to(tl.float32) * step[None, :], 0.0)
        if CODEBOOK:
            ids = tl.load(ids_ptr + s * N + rows, mask=rmask, other=0).to(tl.int64)
            x += tl.load(cb_ptr + (s * n_cb + ids[:, None]) * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
    elif FORM == GROUPED:
        code = _unpack(data_ptr, s, rows, d, N, D, m2, BITS).to(tl.float32)
        if AXIS_TOKEN:  # scales (S, ceil(N/G), D)
            sidx = (s * ((N + G - 1) // G) + rows[:, None] // G).to(tl.int64) * D + d[None, :]
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
        x = tl.load(data_ptr + (s * N + rows[:, None]).to(tl.int64) * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
    return x


