"""Every Triton kernel against its PyTorch twin under TRITON_INTERPRET=1 (set in conftest.py).

Packed codes and cluster ids must match exactly; attention outputs are judged by flash-attention's rule:
the kernel's error against a float64 reference is at most twice the error of the reference computed in the
input dtype. Sizes are awkward on purpose (lengths 1, 97, 289, 1025; groups that do not divide the span).
Every kernel runs with tl.dot wrapped by a check that its operands are GPU-legal (all dims >= 16).
"""
from __future__ import annotations

import os

import pytest
import torch
import triton.language as tl
from quantwm.kernels import allocate_levels as _al
from quantwm.kernels import channel_errors as _ce
from quantwm.kernels import kmeans_assign as _km
from quantwm.kernels import pack_bits as _pb
from quantwm.kernels import pack_channels as _pc
from quantwm.kernels import qsac_assign as _qa
from quantwm.kernels import quantize_pack as _qp
from quantwm.kernels import span_attention as _sa
from quantwm.kernels import trellis_choice as _tc
from quantwm.kernels import unpack_bits as _ub
from quantwm.kernels import unshrink_channels as _uc
from quantwm.kernels.span_args import full_side

from quantwm.core import trellis
from quantwm.core.allocate import CLIPS, allocate_levels_ref, channel_errors_ref, error_tables
from quantwm.core.attention import chunk_spans, merge_splits, new_state, span_attention_ref
from quantwm.core.cache import CacheConfig, KVCache
from quantwm.core.kmeans import kmeans_assign_ref
from quantwm.core.layouts import Channels, Codebook, Full, Grouped
from quantwm.core.layouts.channels import channel_bytes, channel_offsets, pack_channels_ref, unshrink_channels_ref
from quantwm.core.layouts.trellis import trellis_choice_ref
from quantwm.core.qsac import qsac_assign_ref
from quantwm.core.quant import pack_bits_ref, quantize_groups, quantize_pack_ref, unpack_bits_ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: the interpreter (conftest.py)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _move(x):
    if isinstance(x, torch.Tensor):
        return x.to(DEVICE)
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # SideArgs, PsacArgs
        return type(x)(*map(_move, x))
    return {k: _move(v) for k, v in x.items()} if isinstance(x, dict) else x


def on_device(launcher):
    """The launcher run on DEVICE (these are the CUDA tests when a GPU is present), CPU tensors in and out."""
    def run(*args, **kwargs):
        out = launcher(*map(_move, args), **{k: _move(v) for k, v in kwargs.items()})
        return out.cpu() if isinstance(out, torch.Tensor) else out
    return run


pack_bits, unpack_bits = on_device(_pb.pack_bits), on_device(_ub.unpack_bits)
quantize_pack, kmeans_assign, qsac_assign = on_device(_qp.quantize_pack), on_device(_km.kmeans_assign), on_device(_qa.qsac_assign)


def span_attention(q, acc, m, l, *args, **kwargs):
    """span_attention on DEVICE; the softmax state it updates in place is copied back."""
    state = [x.to(DEVICE) for x in (acc, m, l)]
    _sa.span_attention(_move(q), *state, *map(_move, args), **{k: _move(v) for k, v in kwargs.items()})
    for x, y in zip((acc, m, l), state):
        x.copy_(y)


@pytest.fixture(autouse=True)
def gpu_legal_dots(monkeypatch):
    """Fail any tl.dot whose operand tiles a GPU would reject (a matrix dimension below 16; a batched dot's
    leading dimension may be anything); under the interpreter only (compiled on a GPU, Triton rejects them)."""
    if not INTERPRETED:
        return []
    orig = tl.dot
    shapes = []

    def checked(a, b, *args, **kwargs):
        dims = [int(getattr(x, "value", x)) for x in (*a.shape[-2:], *b.shape[-2:])]
        assert min(dims) >= 16, f"tl.dot on tiles {tuple(a.shape)} x {tuple(b.shape)}: a GPU needs dims >= 16"
        shapes.append(dims)
        return orig(a, b, *args, **kwargs)

    checked.__triton_builtin__ = True
    monkeypatch.setattr(tl, "dot", checked)
    return shapes


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("n", [1, 97, 1025])
def test_pack_bits_kernel_matches_ref_and_unpacks_exactly(bits, n):
    codes = torch.randint(0, 2 ** bits, (3, n), generator=torch.Generator().manual_seed(n + bits))
    packed = pack_bits(codes, bits)
    assert torch.equal(packed, pack_bits_ref(codes, bits))
    assert torch.equal(unpack_bits(packed, bits, n).long(), unpack_bits_ref(packed, bits, n))


def test_pack_kernels_reject_unsupported_bits_and_bad_rows():
    with pytest.raises(ValueError, match="bits"):
        pack_bits(torch.zeros(2, 8, dtype=torch.uint8), 3)
    with pytest.raises(ValueError, match="expected 2"):
        unpack_bits(torch.zeros(2, 3, dtype=torch.uint8), 2, 8)


@pytest.mark.parametrize("axis,group", [("channel", 16), ("channel", 64), ("token", 32)])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("T", [1, 97])
def test_quantize_pack_kernel_codes_equal_ref(axis, group, symmetric, bits, T):
    x = torch.randn(3, T, 64, generator=torch.Generator().manual_seed(T)) * 3
    for scale_dtype in ("fp16", "fp8"):
        q = quantize_groups(x, bits, group, axis, symmetric, scale_dtype)
        ref = quantize_pack_ref(x, q.scale, q.zero, bits, group, axis, symmetric)
        assert torch.equal(ref, q.codes)
        assert torch.equal(quantize_pack(x, q.scale, q.zero, bits, group, axis, symmetric), ref)


def test_quantize_pack_kernel_rounds_half_to_even_like_torch():
    x = torch.tensor([[[0.5, 1.5, 2.5, -0.5, 0.49999997, 2.5000002, 3.0, 0.0]]])  # steps of exactly 1
    scale, zero = torch.ones(1, 1, 1, dtype=torch.float16), torch.zeros(1, 1, 1, dtype=torch.float16)
    assert torch.equal(quantize_pack(x, scale, zero, 2, 8), quantize_pack_ref(x, scale, zero, 2, 8))


@pytest.mark.parametrize("N,K", [(1, 1), (97, 13), (1025, 37)])
def test_kmeans_assign_kernel_ids_equal_ref(N, K):
    g = torch.Generator().manual_seed(N)
    x, c = torch.randn(2, N, 48, generator=g), torch.randn(2, K, 48, generator=g)
    assert torch.equal(kmeans_assign(x, c), kmeans_assign_ref(x, c))


def test_kmeans_assign_kernel_ties_go_to_the_lowest_centroid():
    x = torch.zeros(1, 20, 16)
    c = torch.stack([torch.ones(16), -torch.ones(16), torch.ones(16)])[None]  # all three equally far
    assert torch.equal(kmeans_assign(x, c), torch.zeros(1, 20, dtype=torch.long))


@pytest.mark.parametrize("N,K,group", [(1, 1, 32), (97, 13, 32), (200, 7, 64)])
def test_qsac_assign_kernel_ids_equal_exact_ref(N, K, group):
    g = torch.Generator().manual_seed(N)
    x, c = torch.randn(2, N, 64, generator=g), torch.randn(2, K, 64, generator=g) * 0.5
    w = torch.rand(2, 64, generator=g) * 2
    ids = qsac_assign(x, c, w, group, 2, 16.0)
    assert torch.equal(ids, qsac_assign_ref(x, c, w, group, 2, 16.0, candidates=None))
    assert not torch.equal(ids, kmeans_assign_ref(x, c)) or K == 1  # the range term changes choices


def _span_cache(method: str, N: int, H: int = 2, D: int = 64, seed: int = 0):
    """A one-layer cache whose single committed chunk of N tokens is quantized (no BF16 sink or recent);
    "quantwm@3": at a budget of 3 bits per element (the allocator's mixed-width channels)."""
    g = torch.Generator().manual_seed(seed)
    name, _, budget = method.partition("@")
    cache = KVCache(CacheConfig(name, sink_chunks=0, recent_chunks=0, budget=float(budget) if budget else None,
                                track_queries=True), 1)
    q0 = torch.randn(1, H, N, D, generator=g)
    cache.observe(0, q0)
    cache.write(0, torch.randn(1, H, N, D, generator=g) * 2, torch.randn(1, H, N, D, generator=g), 0)
    cache.commit(0, 0)
    return cache


def fold_kernel(q, acc, m, l, k, v, scale, jensen=False, lowp=None, P=None):
    """The kernel over two layouts' sides, as quantwm.core.attention.fused_attention launches it."""
    span_attention(q, acc, m, l, k.kernel_side, v.kernel_side, scale, psac=k.psac_args(q.float()), jensen=jensen,
                   lowp=lowp, center=k.center if lowp else None)


def fold_ref(q, acc, m, l, k, v, scale, jensen=False, lowp=None):
    """The PyTorch twin over the same layouts."""
    span_attention_ref(q, acc, m, l, k.keys_read(), v, scale, psac=k.psac_args(q.float()), jensen=jensen, lowp=lowp)


@pytest.mark.parametrize("method, N, dtype", [
    (m, N, dtype) for dtype, lengths in ((torch.bfloat16, (1, 97, 1025)), (torch.float16, (1, 97, 289)))
    for N in lengths for m in ("bf16", "rtn", "kivi", "qvg", "quantwm", "quantwm+jensen", "kivi+jensen")] + [
    (m, N, torch.bfloat16) for N in (97, 289) for m in ("quantwm@3", "quantwm+jensen@3")] + [  # a budget: N > 1
    ("quantwm-trellis@3", 97, torch.bfloat16)])  # the TRELLIS form (its fp32 twin: below and tests/test_trellis.py)
def test_span_attention_kernel_error_within_twice_the_input_dtype_reference(method, N, dtype):
    cache = _span_cache(method, N)
    (k, v), = chunk_spans(cache, 0)
    S, D = 2, 64
    q32 = torch.randn(S, 33, D, generator=torch.Generator().manual_seed(7))
    q = q32.to(dtype)
    scale = D ** -0.5
    # the exact math on the stored tensors, in float64
    K = cache.keys(0)[0].double()  # (H, N, D): decoded keys with U â, what the reference path attends to
    V = cache.values(0)[0].double()
    bias = cache.logit_bias(0, q.float()[None], scale)
    qd = q.double()
    logits = scale * qd @ K.transpose(1, 2) + (0 if bias is None else bias[0].double())
    exact = logits.softmax(-1) @ V
    low = torch.nn.functional.scaled_dot_product_attention(
        q, K.to(dtype), V.to(dtype), attn_mask=None if bias is None else bias[0].to(dtype), scale=scale)
    acc, m, l = new_state(S, 4, 33, D, "cpu")
    fold_kernel(q, acc, m, l, k, v, scale, jensen="+jensen" in method)
    out = merge_splits(acc, m, l)
    err_kernel = (out.double() - exact).abs().max().item()
    err_low = (low.double() - exact).abs().max().item()
    assert err_kernel <= 2 * err_low, (err_kernel, err_low)


@pytest.mark.parametrize("method", ["rtn", "qvg", "quantwm+jensen", "quantwm+jensen@3", "quantwm-trellis+jensen@3"])
def test_span_attention_kernel_matches_its_torch_twin_in_fp32(method):
    cache = _span_cache(method, 97)
    (k, v), = chunk_spans(cache, 0)
    q = torch.randn(2, 20, 64, generator=torch.Generator().manual_seed(3))
    outs = []
    for fold, P in ((fold_kernel, 3), (fold_ref, 1)):
        acc, m, l = new_state(2, P, 20, 64, "cpu")
        fold(q, acc, m, l, k, v, 0.125, jensen="+jensen" in method)
        outs.append(merge_splits(acc, m, l))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_span_attention_state_folds_spans_like_one_softmax():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 17, 32, generator=g), torch.randn(2, 150, 32, generator=g), torch.randn(2, 150, 32, generator=g)
    acc, m, l = new_state(2, 2, 17, 32, "cpu")
    for sl in (slice(0, 1), slice(1, 97), slice(97, 150)):
        span_attention(q, acc, m, l, full_side(k[:, sl]), full_side(v[:, sl]), 0.2)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.2)
    torch.testing.assert_close(merge_splits(acc, m, l), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lowp,method", [(lowp, m) for lowp in ("int8", "e4m3")
                                          for m in ("bf16", "kivi", "quantwm+jensen", "quantwm@3")]
                         + [("int8", "quantwm-trellis@3")])  # trellis keys are rebuilt tiles in either format
def test_lowp_kernel_matches_its_emulation_with_one_split(method, lowp):
    """The 8-bit path rounds where quantwm/core/fp8.py does: with one split the only difference left is fp32
    summation order; with splits and bf16 queries it stays within e4m3's rounding of P of the emulation."""
    from quantwm.core.fp8 import BLOCK

    assert _sa.BLOCK_N == BLOCK  # the emulation's PV blocks are the kernel's key tiles
    cache = _span_cache(method, 97)
    (k, v), = chunk_spans(cache, 0)
    q = torch.randn(2, 20, 64, generator=torch.Generator().manual_seed(3))
    kw = dict(jensen="+jensen" in method, lowp=lowp)
    outs = {}
    for name, fold, P, qq in (("kernel", fold_kernel, 1, q), ("emulation", fold_ref, 1, q),
                              ("split bf16", fold_kernel, 3, q.bfloat16()), ("exact", fold_ref, 1, q)):
        acc, m, l = new_state(2, P, 20, 64, "cpu")
        fold(qq, acc, m, l, k, v, 0.125, **{**kw, "lowp": None if name == "exact" else lowp})
        outs[name] = merge_splits(acc, m, l)
    # on a GPU exp2 is the hardware's approximation: a probability near a rounding boundary of e4m3 may land
    # one step away, which moves the output by about 1e-4
    tol = 1e-5 if DEVICE.type == "cpu" else 2e-3
    torch.testing.assert_close(outs["kernel"], outs["emulation"], rtol=tol, atol=tol)
    rel = {n: ((outs[n] - outs["exact"]).norm() / outs["exact"].norm()).item() for n in ("kernel", "split bf16")}
    assert 0 < rel["kernel"] < (0.05 if lowp == "int8" else 0.1), rel  # rounding happened, and stayed small
    assert rel["split bf16"] < 1.5 * rel["kernel"] + 0.01, rel


def _code_layout(S, N, D, bits, G, axis, symmetric, K, seed=0):
    """A quantized key layout (with a codebook of K rows when K > 0)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S, N, D, generator=g) * torch.linspace(0.5, 3, D) + 1.0
    grouped = Grouped(quantize_groups(x, bits, G, axis, symmetric))
    if not K:
        return grouped
    codebook = torch.randn(S, K, D, generator=g).to(torch.float8_e4m3fn)
    return Codebook(((codebook, torch.randint(0, K, (S, N), generator=g, dtype=torch.int32)),), grouped)


@pytest.mark.parametrize("bits, G, axis, symmetric, K, D", [
    (2, 64, "channel", False, 2, 64),  # quantwm at D = 64: one group per token, a codebook
    (2, 64, "channel", False, 0, 128),  # two groups per token: the batched dot
    (4, 16, "channel", True, 0, 48),  # four groups, the last one past D (padded tile)
    (8, 32, "channel", False, 0, 64),
    (2, 64, "token", False, 0, 64),  # KIVI's keys: token groups spanning two key blocks
    (4, 32, "token", True, 3, 64)])
@pytest.mark.parametrize("lowp", ["int8", "e4m3"])
def test_lowp_kernel_reads_codes_as_its_emulation_does(bits, G, axis, symmetric, K, D, lowp):
    """Keys read as their integer codes (the layout's reads_codes): the kernel equals the emulation (one split)
    for every group layout, and both stay close to exact attention over the same stored keys."""
    S, N = 2, 97
    k = _code_layout(S, N, D, bits, G, axis, symmetric, K)
    assert k.reads_codes(lowp) == (lowp == "int8" or bits <= 4)
    v = Full(torch.randn(S, N, D, generator=torch.Generator().manual_seed(1)))
    q = torch.randn(S, 20, D, generator=torch.Generator().manual_seed(2))
    outs = {}
    for name, fold, mode in (("kernel", fold_kernel, lowp), ("emulation", fold_ref, lowp), ("exact", fold_ref, None)):
        acc, m, l = new_state(S, 1, 20, D, "cpu")
        fold(q, acc, m, l, k, v, D ** -0.5, lowp=mode)
        outs[name] = merge_splits(acc, m, l)
    tol = 1e-5 if DEVICE.type == "cpu" else 2e-3
    torch.testing.assert_close(outs["kernel"], outs["emulation"], rtol=tol, atol=tol)
    rel = ((outs["kernel"] - outs["exact"]).norm() / outs["exact"].norm()).item()
    assert 0 < rel < (0.05 if lowp == "int8" else 0.1), rel


def test_the_kernel_reads_codes_exactly_where_the_emulation_does():
    layouts = [_code_layout(1, 40, D, bits, G, axis, sym, 0) for bits in (2, 4, 8) for sym in (False, True)
               for D, G, axis in ((64, 64, "channel"), (64, 8, "channel"), (48, 16, "channel"), (64, 32, "token"),
                                  (64, 48, "token"), (64, 64, "token"))]
    layouts += [Full(torch.zeros(1, 40, 64))] + [
        Channels.pack(torch.zeros(1, 40, 3, dtype=torch.long), torch.tensor([widths]), torch.zeros(1, 3), torch.ones(1, 3))
        for widths in ([0, 4, 4], [0, 6, 4])]
    for layout in layouts:
        side = layout.kernel_side
        if side is None:  # groups the kernel cannot read at all
            continue
        for lowp in ("int8", "e4m3"):
            assert _sa._reads_codes(side, layout.shape[-1], lowp) == layout.reads_codes(lowp), (layout.describe(), lowp)


def test_lowp_kernel_refuses_a_missing_centre_and_unknown_formats():
    q = torch.randn(1, 4, 16)
    side = full_side(torch.randn(1, 5, 16))
    acc, m, l = new_state(1, 1, 4, 16, "cpu")
    with pytest.raises(ValueError, match="centre"):
        span_attention(q, acc, m, l, side, side, 1.0, lowp="int8")
    with pytest.raises(ValueError, match="lowp must be"):
        span_attention(q, acc, m, l, side, side, 1.0, lowp="fp4", center=torch.zeros(1, 16))


def test_span_attention_rejects_bad_state_and_jensen_on_full_keys():
    q = torch.randn(1, 4, 16)
    side = full_side(torch.randn(1, 5, 16))
    acc, m, l = new_state(1, 1, 4, 16, "cpu")
    with pytest.raises(ValueError, match="state"):
        span_attention(q, acc[:, :, :3], m, l, side, side, 1.0)
    with pytest.raises(ValueError, match="Jensen"):
        span_attention(q, acc, m, l, side, side, 1.0, jensen=True)


@pytest.mark.parametrize("n, D", [(1, 16), (97, 128), (161, 40)])  # 128: two blocks of 64 channels; 161: five tiles and one row
def test_channel_errors_kernel_matches_ref_at_every_width(n, D):
    g = torch.Generator().manual_seed(n + D)
    x = torch.randn(3, n, D, generator=g) * (torch.rand(1, 1, D, generator=g) * 3 + 0.01)
    x[0, 0, 0] = 30.0  # an outlier: the clipped candidates matter
    x[1, :, 1] = 0.5  # a flat channel: a zero range (step 1)
    x[2, :, 2] = torch.arange(n) * 0.25  # values on exact half-steps: ties round to even
    qmax, clips = torch.tensor([2.0 ** b - 1 for b in range(9)]), torch.tensor(CLIPS)
    lo, hi = x.amin(1), x.amax(1)
    E_ref, A_ref = channel_errors_ref(x, lo, hi, qmax, clips, 1.5)
    E_low, _ = channel_errors_ref(x.half().float(), lo.half().float(), hi.half().float(), qmax, clips, 1.5)
    E, A = (t.cpu() for t in _ce.channel_errors(*map(_move, (x, lo, hi, qmax, clips)), 1.5))
    assert E.shape == A.shape == (9, 3, D)
    # float sums in another order (and a tie's code one step apart): far below the error of the same tables on
    # fp16-rounded inputs, the reference's own precision
    assert (E - E_ref).abs().max() <= 2 * (E_low - E_ref).abs().max() + 1e-4 * E_ref.abs().max()
    assert torch.allclose(E, E_ref, rtol=1e-4, atol=1e-4 * float(E_ref.abs().max()))
    assert (A == A_ref).float().mean() > 0.99 and (A[0] == 1).all()  # the clip; near-equal ones may swap


def test_error_tables_pick_the_same_clips_on_the_kernel_path(monkeypatch):
    g = torch.Generator().manual_seed(7)
    r = torch.randn(2, 300, 24, generator=g)
    r[:, 0] = 25.0
    E_ref, A_ref = error_tables(r)
    monkeypatch.setenv("QUANTWM_KERNELS", "triton")
    E, A = error_tables(r)
    assert torch.equal(A, A_ref) and torch.isin(A, torch.tensor(CLIPS)).all()
    assert torch.allclose(E, E_ref, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("S, D, N", [(3, 40, 97), (2, 128, 1025), (1, 16, 1), (2, 9, 4680)])
def test_allocate_levels_kernel_equals_ref(S, D, N):
    g = torch.Generator().manual_seed(S * D + N)
    E = torch.rand(S, D, 9, generator=g).sort(-1, descending=True).values * torch.rand(S, D, 1, generator=g) * 10
    E[0, 0] = E[0, 1]  # two channels alike: ties go to the first, in both
    cost = torch.tensor([8.0 * ((N * b + 7) // 8) for b in range(9)])
    available = torch.full((S,), 2.5 * N * D) - torch.rand(S, generator=g) * 100
    available[-1] = 3.0 * N * D  # a stream with room to spare: the greedy fill runs
    from quantwm.core.allocate import BISECTION_STEPS

    assert _al.BISECTION_STEPS == BISECTION_STEPS  # the kernel runs the reference's rule, step for step
    ref = allocate_levels_ref(E, cost, available)
    out = _al.allocate_levels(*map(_move, (E, cost, available))).cpu()
    assert torch.equal(out, ref)
    assert (cost[out].sum(-1) <= available).all()


@pytest.mark.parametrize("N, D", [(1, 16), (97, 40), (1025, 9)])  # 1025: 33 blocks of 32 bytes a channel; 9: a part block of 16 channels
def test_pack_channels_kernel_bytes_and_grids_equal_ref_at_every_width(N, D):
    g = torch.Generator().manual_seed(N + D)
    S = 2
    bits = torch.randint(0, 9, (S, D), generator=g)
    bits[0, :9] = torch.arange(9)  # every width, 0 to 8: codes of 3, 5, 6 and 7 bits straddle bytes
    r = torch.randn(S, N, D, generator=g) * 3
    r[1, :, 1] = 0.75  # a flat channel: no range, step 1
    alpha = torch.tensor(CLIPS)[torch.randint(0, 6, (S, D), generator=g)]
    lo, hi = r.amin(1), r.amax(1)
    offsets = channel_offsets(bits, N)
    total = int(channel_bytes(N, bits).sum()) + 5  # a budget's spare bytes stay zero
    ref = pack_channels_ref(r, lo, hi, alpha, bits, offsets, total)
    out = [t.cpu() for t in _pc.pack_channels(*map(_move, (r, lo, hi, alpha, bits, offsets)), total)]
    assert torch.equal(out[0], ref[0]) and (out[0][-5:] == 0).all()
    assert all(torch.equal(a, b) for a, b in zip(out[1:], ref[1:]))  # the grids (fp16 and as read), bit for bit
    assert out[1].dtype == torch.float16 and out[3].dtype == torch.float32
    buf, low, step, low_read = ref
    assert torch.equal(low_read, torch.where(bits > 0, low.float(), 0.0))
    decoded = Channels(buf, bits.to(torch.uint8), low, step, N).decode()
    low, step = low.float(), step.float()
    top = (2 ** bits - 1)[:, None, :]
    codes = torch.minimum(torch.round((r - low[:, None]) / step[:, None]).clamp(min=0), top)
    expect = torch.where(bits[:, None, :] > 0, low[:, None] + codes * step[:, None], 0.0)
    assert torch.allclose(decoded, expect)  # what was packed reads back as the grid's codes


@pytest.mark.parametrize("N, D", [(1, 16), (97, 40), (1025, 3)])  # 1025: 33 blocks, more than unshrink's 32 at a time
def test_pack_channels_sums_and_unshrink_kernels_equal_their_refs(N, D):
    """The partial sums the packing gathers for `unbias` (each code once, in the block of its first bit) add up to
    the span's own sums; the stretch from them equals its twin's and the stretch from a full decode (fp16 tables)."""
    g = torch.Generator().manual_seed(7 * N + D)
    S = 2
    bits = torch.randint(0, 9, (S, D), generator=g)
    bits[0, :9] = torch.arange(min(D, 9))
    r = torch.randn(S, N, D, generator=g) * 3 + 1
    r[1, :, 1] = 0.75  # no spread: left as it is
    alpha = torch.tensor(CLIPS)[torch.randint(0, 6, (S, D), generator=g)]
    lo, hi = r.amin(1), r.amax(1)
    offsets = channel_offsets(bits, N)
    total = int(channel_bytes(N, bits).sum())
    ref = pack_channels_ref(r, lo, hi, alpha, bits, offsets, total, sums=True)
    out = [t.cpu() for t in _pc.pack_channels(*map(_move, (r, lo, hi, alpha, bits, offsets)), total, sums=True)]
    assert all(torch.equal(a, b) for a, b in zip(out[:4], ref[:4]))  # asking for the sums changes nothing else
    assert out[4].shape == ref[4].shape == (4, S * D, -(-N // 32))
    assert torch.allclose(out[4], ref[4], rtol=1e-5, atol=1e-3)  # the same sums, added in another order
    layout = Channels(ref[0], bits.to(torch.uint8), ref[1], ref[2], N)
    b = bits[:, None, :]
    u, c = r - ((hi + lo) / 2)[:, None], layout.int_codes().float() - ((1 << b) - 1) / 2
    whole = (torch.stack([u.sum(1), (u * u).sum(1), c.sum(1), (c * u).sum(1)]) * (bits > 0)).reshape(4, S * D)
    assert torch.allclose(ref[4].sum(2), whole, rtol=1e-5, atol=1e-3)
    mine = unshrink_channels_ref(ref[4], bits, ref[1], ref[2], N, 0.5)
    theirs = [t.cpu() for t in _uc.unshrink_channels(*map(_move, (out[4], bits, out[1], out[2])), N, 0.5)]
    ulp = lambda a, b: ((a.float() - b.float()).abs() <= b.float().abs() * 2 ** -10 + 1e-7).all()  # fp16: 1 ulp
    assert all(ulp(a, b) for a, b in zip(theirs, mine))
    fixed = layout.unbiased(r)
    assert ulp(mine[0], fixed.low) and ulp(mine[1], fixed.step_)
    assert torch.equal(mine[2], torch.where(bits > 0, mine[0].float(), 0.0))
    assert torch.equal(mine[1][1, 1], ref[2][1, 1]) and torch.equal(mine[0][bits == 0], ref[1][bits == 0])
    with pytest.raises(ValueError, match="least slope undone"):
        _uc.unshrink_channels(out[4], bits, out[1], out[2], N, 0.0)


@pytest.mark.parametrize("N, D", [(1, 16), (97, 40), (289, 9)])  # 9: a part block of channels; 1: a lone token
def test_trellis_choice_and_packing_from_states_equal_their_refs(N, D):
    """quantwm-trellis's commit after its search: the grid-or-trellis choice per channel (with and without the
    Values' stretch) and the codes packed from the states where the trellis is kept, against their twins."""
    g = torch.Generator().manual_seed(3 * N + D)
    S = 2
    bits = torch.randint(0, 9, (S, D), generator=g)
    bits[0, :9] = torch.arange(9)
    r = torch.randn(S, N, D, generator=g) * 2 + 0.5
    r[1, :, 2] = torch.randint(0, 2, (N,), generator=g).float()  # two levels: the grid wins where it has 1+ bits
    r[1, :, 1] = 0.75  # no spread
    alpha = torch.tensor(CLIPS)[torch.randint(0, 6, (S, D), generator=g)]
    lo, hi = r.amin(1), r.amax(1)
    states = torch.randint(0, 256, (S, D, N), generator=g, dtype=torch.uint8)
    states[bits == 0] = 0  # a 0-bit row's path
    low = torch.where(bits > 0, r.mean(1), 0.0).half().float()
    step = torch.where(bits > 0, r.std(1, correction=0).clamp_min(1e-3), 1.0).half().float()
    table = trellis.tables()
    ulp = lambda a, b: ((a.float() - b.float()).abs() <= b.float().abs() * 2 ** -10 + 1e-7).all()  # fp16: 1 ulp
    for unbias in (False, True):
        args = (r, states, table, lo, hi, alpha, bits, low, step, unbias, 0.5)
        want = trellis_choice_ref(*args)
        got = [t.cpu() for t in _tc.trellis_choice(*map(_move, args))]
        assert torch.equal(got[0], want[0]) and got[0].dtype == torch.bool, unbias
        same = ulp if unbias else torch.equal
        assert same(got[1], want[1]) and same(got[2], want[2]) and got[1].dtype == torch.float16, unbias
        assert torch.equal(got[3], torch.where(bits > 0, got[1].float(), 0.0))
    grid = want[0]
    assert grid[1, 2] == (bits[1, 2] > 0) and not grid[bits == 0].any()
    offsets = channel_offsets(bits, N)
    total = int(channel_bytes(N, bits).sum()) + 3
    ref = pack_channels_ref(r, lo, hi, alpha, bits, offsets, total, states=states, grid=grid)
    out = [t.cpu() for t in _pc.pack_channels(*map(_move, (r, lo, hi, alpha, bits, offsets)), total,
                                              states=_move(states), grid=_move(grid))]
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    codes = Channels(ref[0], bits.to(torch.uint8), ref[1], ref[2], N).int_codes()
    tops = states.permute(0, 2, 1).long() >> (8 - bits.long()[:, None])
    plain = pack_channels_ref(r, lo, hi, alpha, bits, offsets, total)[0]
    grid_codes = Channels(plain, bits.to(torch.uint8), ref[1], ref[2], N).int_codes()
    assert torch.equal(codes, torch.where(grid[:, None], grid_codes, torch.where(bits[:, None] > 0, tops, 0)))
    with pytest.raises(ValueError, match="states"):
        _tc.trellis_choice(r, states.permute(0, 2, 1), table, lo, hi, alpha, bits, low, step, False, 0.5)
    with pytest.raises(ValueError, match=r"widths' tables \(9, 256\)"):
        _tc.trellis_choice(r, states, trellis.codebook(), lo, hi, alpha, bits, low, step, False, 0.5)
    with pytest.raises(ValueError, match="go together"):
        _pc.pack_channels(r, lo, hi, alpha, bits, offsets, total, states=states)
    with pytest.raises(ValueError, match="least slope"):
        _tc.trellis_choice(r, states, table, lo, hi, alpha, bits, low, step, True, 0.0)


@pytest.mark.parametrize("dt", [torch.float8_e4m3fn, torch.float16])
def test_storage_check_equals_its_twin_bit_for_bit(dt):
    """kernels/storage_check.py: the cast's negative zeros made positive (the same bytes as the twin's) and the same
    fits flag, for a table that fits, one past the dtype's largest value, one holding a NaN, one too fine for it."""
    from quantwm.kernels import storage_check as _sc

    from quantwm.core.quant import storage_check_ref

    g = torch.Generator().manual_seed(7)
    words = torch.uint8 if dt == torch.float8_e4m3fn else torch.int16
    base = torch.randn(2100, generator=g) * 3  # more than one block of the one program
    base[[3, 4]] = torch.tensor([-0.0, -1e-12])  # negative zeros once cast
    big, nan, fine = base.clone(), base.clone(), base * 1e-6
    big[9] = 1e3 if dt == torch.float8_e4m3fn else 1e5
    nan[11] = float("nan")
    for x, fits in ((base, True), (big, False), (nan, False), (fine, dt == torch.float16)):
        rms = torch.linalg.vector_norm(x) * x.numel() ** -0.5
        largest = torch.finfo(dt).max
        want = storage_check_ref(x, x.to(dt), rms, largest)
        got = [t.cpu() for t in _sc.storage_check(*map(_move, (x, x.to(dt), rms)), largest, 2.0 ** -3, 2.0 ** -4)]
        assert torch.equal(got[0].view(words), want[0].view(words)) and bool(got[1]) == bool(want[1]) == fits
    assert bool((storage_check_ref(base, base.to(dt), rms, largest)[0].view(words) != (-0.0 * torch.ones(1)).to(dt)
                 .view(words)).all())  # no negative zero left
    with pytest.raises(ValueError, match="float32 and its cast"):
        _sc.storage_check(base.double(), base.to(dt), rms, largest, 2.0 ** -3, 2.0 ** -4)


def test_to_storage_through_the_kernel_stores_and_records_what_the_steps_do(monkeypatch):
    """Under deferred checks with the kernels on, to_storage takes kernels/storage_check.py: the same tensor, and
    the same check recorded, as its steps without the kernel (a table that fits, and one fp8 cannot hold)."""
    from quantwm.core.quant import deferred_checks, to_storage

    g = torch.Generator().manual_seed(8)
    for x, ok in ((torch.randn(3, 1, 40, generator=g), True), (torch.randn(3, 1, 40, generator=g) * 1e3, False)):
        out = {}
        for mode in ("ref", "triton"):
            monkeypatch.setenv("QUANTWM_KERNELS", mode)
            with deferred_checks() as checks:
                stored = to_storage(x, torch.float8_e4m3fn)
            out[mode] = (stored, checks.passed(), len(checks.flags))
        assert torch.equal(out["ref"][0].view(torch.uint8), out["triton"][0].view(torch.uint8))
        assert out["ref"][1:] == out["triton"][1:] == (ok, 1)


def test_key_rotate_and_key_covariance_equal_their_twins_to_fp32_rounding():
    """kernels/key_rotate.py (y = x U from BF16 parts of U) and kernels/key_covariance_sums.py (Σ y yᵀ of the shifted,
    masked keys from BF16 parts of y, in stretches): within FP32 rounding of the twins, on offset keys, a head dim
    below a tile, spans shorter than a stretch and longer than one, with and without kept tokens."""
    from quantwm.kernels import key_covariance_sums as _kc
    from quantwm.kernels import key_rotate as _kr

    from quantwm.core import query_basis
    from quantwm.core.query_basis import key_covariance_sums_ref, key_rotate_ref

    g = torch.Generator().manual_seed(9)
    for S, N, D in ((2, 600, 128), (3, 97, 64), (1, 1, 40)):
        x = (torch.randn(S, N, D, generator=g) * torch.linspace(0.1, 3, D) + 5).bfloat16()
        U = torch.linalg.qr(torch.randn(S, D, D, generator=g, dtype=torch.float64)).Q.float()
        y = _kr.key_rotate(*map(_move, (x, U))).cpu()
        torch.testing.assert_close(y, key_rotate_ref(x, U), rtol=1e-6, atol=2e-5)
        for keep in (None, torch.rand(N, generator=g) > 0.2):
            if keep is not None:
                keep[0] = True
            yy, y = (t.cpu() for t in _kc.key_covariance_sums(_move(x), _move(keep)))
            want = key_covariance_sums_ref(x, keep)
            torch.testing.assert_close(yy.sum(1), want[0][:, 0], rtol=1e-5, atol=1e-5 * float(want[0].abs().max()))
            torch.testing.assert_close(y.sum(1), want[1][:, 0], rtol=1e-5, atol=1e-5 * float(want[1].abs().max()))
            assert yy.shape[1] == y.shape[1] == (3 if N == 600 else 1)  # stretches of 256 tokens or more
            C = query_basis.key_covariance(x, keep)  # the reference path's covariance, from the twin's sums
            kept = x.float() if keep is None else x.float()[:, keep]
            truth = torch.stack([torch.cov(kept[s].double().T, correction=0).reshape(D, D) for s in range(S)])
            assert C.dtype == torch.float64 and (C - truth).abs().max() < 1e-4 * truth.abs().max() + 1e-6
    with pytest.raises(ValueError, match="bfloat16 and U"):
        _kr.key_rotate(x.float(), U)
    with pytest.raises(ValueError, match="kept tokens"):
        _kc.key_covariance_sums(x, torch.ones(N + 1, dtype=torch.bool))
