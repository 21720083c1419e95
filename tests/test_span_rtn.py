"""span-rtn (quantwm/core/methods/span_rtn.py): the allocator's per-channel span format with one width for every
channel: its widths, its clip search, its bytes, its budget rule, and the fused kernel reading it."""
import pytest
import torch

from quantwm.core.allocate import encode_channels
from quantwm.core.attention import chunk_spans, merge_splits, new_state, span_attention_ref
from quantwm.core.budget import candidates, configure
from quantwm.core.cache import CacheConfig, KVCache
from quantwm.core.layouts import Channels
from quantwm.core.methods import SpanContext, get_method

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: the Triton interpreter (conftest.py)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _rel_err(x_hat, x):
    return ((x_hat - x).square().sum() / x.square().sum()).item()


def _spread_channels(seed=1, S=2, N=512, D=64):
    """Channels whose ranges differ by 10^4 (log-spaced scales, shuffled) and whose centres differ too."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-2, 2, D)[torch.randperm(D, generator=g)]
    return torch.randn(S, N, D, generator=g) * scales + torch.randn(S, 1, D, generator=g) * 3


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_span_rtn_gives_every_channel_the_same_width(bits):
    x = _spread_channels()
    enc = get_method("span-rtn", bits=bits).encode(x, "k", SpanContext())
    assert isinstance(enc, Channels)
    assert (enc.bits == bits).all() and enc.max_bits == bits
    assert _rel_err(enc.decode(), x) < {2: 0.15, 3: 0.05, 4: 0.015, 8: 1e-4}[bits]  # measured 0.131, 0.041, 0.012, 5e-5


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_span_rtn_is_no_worse_than_rtn_on_channels_of_very_different_ranges(bits):
    x = _spread_channels()
    errs = {}
    for name in ("rtn", "span-rtn"):
        m = get_method(name, bits=bits)
        errs[name] = _rel_err(m.decode(m.encode(x, "k", SpanContext())), x)
    assert errs["span-rtn"] <= errs["rtn"], errs  # measured at 2 bits: 0.131 vs rtn's 0.588


def test_span_rtn_clips_each_channel_by_least_squared_error():
    # N <= 1024: the clip search sees the whole span, so no channel does worse than its unclipped grid
    x = _spread_channels(seed=2)
    S, N, D = x.shape
    enc = get_method("span-rtn", bits=2).encode(x, "k", SpanContext())
    full = encode_channels(x, torch.full((S, D), 2), torch.ones(S, D))
    per_channel = (enc.decode() - x).square().sum(1)
    assert (per_channel <= (full.decode() - x).square().sum(1) * (1 + 1e-4)).all()
    assert per_channel.sum() < 0.9 * (full.decode() - x).square().sum()  # and clipping pays on Gaussian channels


@pytest.mark.parametrize("N, bits", [(100, 2), (97, 3), (64, 8)])
def test_span_rtn_bytes_are_codes_plus_five_bytes_a_channel(N, bits):
    S, D = 2, 64
    enc = get_method("span-rtn", bits=bits).encode(_randn(S, N, D, seed=3), "v", SpanContext())
    assert enc.nbytes() == sum(t.numel() * t.element_size() for t in enc.components().values())
    assert enc.nbytes() == S * D * (5 + (N * bits + 7) // 8)  # width, fp16 low end and step; packed codes
    assert 8 * enc.nbytes() / (S * N * D) == pytest.approx(bits + 40 / N, abs=8 / N)


def test_span_rtn_options_and_grid():
    for bad in (1, 5, 6):
        with pytest.raises(ValueError, match="2, 3, 4, 8"):
            get_method("span-rtn", bits=bad)
    with pytest.raises(ValueError, match="group_size"):
        get_method("span-rtn", group_size=64)
    assert "3-bit asymmetric (8 levels) per channel over the span" in get_method("span-rtn", bits=3).grid()


def test_span_rtn_budget_rule_is_its_widths_richest_first():
    assert candidates("span-rtn", 128) == [{"bits": 8}, {"bits": 4}, {"bits": 3}, {"bits": 2}]
    assert configure("span-rtn", 2.5, 128, 1728, "k") == ({"bits": 2}, pytest.approx(2 + 40 / 1728))
    assert configure("span-rtn", 4.5, 128, 1728, "v")[0] == {"bits": 4}


@pytest.mark.parametrize("bits", [3, 2])
def test_the_fused_kernel_reads_span_rtn_spans_as_its_torch_twin(bits):
    from quantwm.kernels import span_attention as sa

    S, N, D = 2, 97, 64
    g = torch.Generator().manual_seed(4)
    cache = KVCache(CacheConfig("span-rtn", k_bits=bits, v_bits=bits, sink_chunks=0, recent_chunks=0), 1)
    k, v = (torch.randn(1, S, N, D, generator=g).to(DEVICE) for _ in range(2))
    cache.write(0, k, v, 0)
    cache.commit(0, 0)
    (ks, vs), = chunk_spans(cache, 0)  # not None: the kernel has a view of both halves
    assert ks.kernel_side is not None and vs.kernel_side is not None
    q = torch.randn(S, 20, D, generator=g).to(DEVICE)
    outs = []
    for P in (3, 1):
        acc, m, l = new_state(S, P, 20, D, DEVICE)
        if P == 3:
            sa.span_attention(q, acc, m, l, ks.kernel_side, vs.kernel_side, 0.125, psac=None, jensen=False)
        else:
            span_attention_ref(q, acc, m, l, ks, vs, 0.125)
        outs.append(merge_splits(acc, m, l).cpu())
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


# --- values="channels": the baselines' Values in this format -----------------------------------------

@pytest.mark.parametrize("name, options", [("rtn", {}), ("kivi", {}), ("kivi-pre", {}), ("turboquant", {}),
                                           ("turboquant", {"outlier_channels": 16, "outlier_bits": 3}), ("oscar", {})])
@pytest.mark.parametrize("bits", [2, 3])
def test_values_channels_changes_only_the_values(name, options, bits):
    x, ctx = _spread_channels(N=200), lambda: SpanContext(stats=torch.eye(64).expand(2, 64, 64) * 2, history=3)
    own, channels = get_method(name, bits=bits, **options), get_method(name, bits=bits, values="channels", **options)
    assert torch.equal(channels.encode(x, "k", ctx()).decode(), own.encode(x, "k", ctx()).decode())  # Keys alike
    v = channels.encode(x, "v", ctx())
    assert isinstance(v, Channels) and (v.bits == bits).all()
    assert torch.equal(v.decode(), get_method("span-rtn", bits=bits).encode(x, "v", SpanContext()).decode())
    assert not isinstance(own.encode(x, "v", ctx()), Channels)  # the default keeps the method's own Values
    assert "Values span-rtn's per-channel grids" in channels.grid() and "span-rtn" not in own.grid()


def test_values_option_names_its_choices_and_needs_a_width_span_rtn_codes():
    with pytest.raises(ValueError, match="own, channels"):
        get_method("kivi", values="tokens")
    with pytest.raises(ValueError, match="bits=1"):
        get_method("turboquant", bits=1, values="channels")
    assert get_method("turboquant", bits=1).values == "own"


def test_a_budget_measures_values_channels_in_span_rtns_format():
    opts, bits = configure("kivi", 2.5, 128, 1728, "v", options={"values": "channels"})
    assert opts == {"bits": 2, "values": "channels"}  # the widths alone: KIVI's group size does not apply
    assert bits == pytest.approx(2 + 8 * 5 * 128 / (1728 * 128))  # span-rtn's 2 bits plus its per-channel tables
    assert configure("turboquant", 3.0, 128, 1728, "v", options={"values": "channels"})[0] == {
        "bits": 2, "values": "channels"}  # no outlier split for span-rtn's Values
    assert configure("kivi", 2.5, 128, 1728, "k", options={"values": "channels"})[0] == {
        "bits": 2, "group_size": 64, "values": "channels"}  # the Keys' rule as without the option
