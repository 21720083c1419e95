"""quantwm/core/allocate.py and quantwm-alloc (QuantWM at a budget B): the allocator stays within its budget, spends bits where the
history Queries look, decodes exactly what it stored, and chooses the same way every time."""
import pytest
import torch

from quantwm.core.allocate import CLIPS, allocate, encode_channels, error_tables
from quantwm.core.layouts import Channels, Codebook
from quantwm.core.layouts.channels import channel_offsets
from quantwm.core.methods import get_method
from quantwm.core.methods.base import SpanContext


def _span(S=3, N=256, D=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(S, 1, D, generator=g) * 3 + 0.1  # channels of very different spread
    return torch.randn(S, N, D, generator=g) * scale + torch.randn(S, 1, D, generator=g)


def _focused_stats(S, D, dims=8):
    """A history whose Queries live on the first `dims` channels (plus a little everywhere)."""
    stats = 0.01 * torch.eye(D).repeat(S, 1, 1)
    stats[:, :dims, :dims] += torch.eye(dims) * 10
    return stats


@pytest.mark.parametrize("N, D", [(128, 64), (576, 128), (1728, 128), (200, 40)])
@pytest.mark.parametrize("budget", [2.25, 2.5, 3.0, 4.0])
@pytest.mark.parametrize("kind", ["k", "v"])
def test_every_span_stays_within_its_budget(N, D, budget, kind):
    x = _span(2, N, D, seed=N + D)
    ctx = SpanContext(stats=_focused_stats(2, D), history=100)
    enc = get_method("quantwm", budget=budget).encode(x, kind, ctx)
    bits = 8 * enc.nbytes() / x.numel()
    assert budget - 0.05 < bits <= budget + 1e-9  # within the budget, and spending nearly all of it


def test_decode_reads_only_what_was_stored_and_every_coded_value_sits_on_its_grid():
    x = _span(2, 300, 64, seed=3)
    m = get_method("quantwm", budget=3.0)
    assert m.name == "quantwm-alloc"  # the family's method at a budget
    enc = m.encode(x, "v", SpanContext())
    assert isinstance(enc, Codebook) and isinstance(enc.residual, Channels)
    ch = enc.residual
    bits, low, step = ch.bits.long(), ch.low.float(), ch.step_.float()
    r = ch.decode()
    levels = (r - low[:, None]) / step[:, None]
    coded = bits[:, None, :].expand_as(r) > 0
    assert torch.allclose(levels[coded], levels[coded].round(), atol=1e-3)  # on the grid low + k * step
    assert (levels[coded] >= -1e-3).all() and (levels[coded] <= (2 ** bits[:, None, :].expand_as(r)[coded] - 1) + 1e-3).all()
    assert (r[~coded] == 0).all()  # a 0-bit channel decodes to its centroid
    assert torch.equal(enc.decode(), m.encode(x, "v", SpanContext()).decode())  # deterministic
    side = enc.kernel_side  # what the fused kernel reads: one buffer and a table of offsets and widths
    needed = sum((300 * b + 7) // 8 for b in bits.flatten().tolist())
    assert side.data is ch.codes and needed <= side.data.numel()  # a buffer sized by the budget, not read back
    assert (side.data[needed:] == 0).all()
    assert torch.equal(side.meta & 15, bits) and torch.equal(side.meta >> 4, channel_offsets(ch.bits, 300))
    step = enc.step()  # +jensen's Δ: the grid step of coded channels, 0 where a channel has no grid
    assert step.shape == x.shape and torch.equal(step[:, 0] > 0, bits > 0)


def test_channel_codes_round_trip_at_every_width():
    g = torch.Generator().manual_seed(1)
    r = torch.randn(2, 50, 9, generator=g)
    bits = torch.tensor([list(range(9)), list(range(8, -1, -1))])
    ch = encode_channels(r, bits, torch.ones(2, 9))
    out = ch.decode()
    step = ch.step_.float()
    err = (out - r).abs()
    coded = bits > 0
    assert (err.amax(1)[coded] <= step[coded] / 2 + 1e-3).all()  # unclipped grids: within half a step everywhere
    # one buffer, a byte offset per channel; 3-, 5-, 6- and 7-bit codes straddle bytes
    assert ch.codes.numel() == sum((50 * b + 7) // 8 for b in bits.flatten().tolist()) and ch.max_bits == 8
    one_row = Codebook(((torch.ones(2, 1, 9), None),), ch)  # a mean row: folded into the kernel's low ends
    assert torch.equal(one_row.decode(), out + 1)
    assert torch.equal(one_row.kernel_side.zeros, torch.where(bits > 0, ch.low.float(), 0.0) + 1)


def test_bits_go_where_the_history_queries_look():
    S, N, D = 2, 512, 64
    g = torch.Generator().manual_seed(5)
    x = torch.randn(S, N, D, generator=g)  # every channel alike: only the Queries tell them apart
    stats = _focused_stats(S, D)
    enc = get_method("quantwm", budget=2.5).encode(x, "k", SpanContext(stats=stats, history=100))
    bits = enc.residual.bits.float()
    assert (bits[:, :8].mean(1) >= bits[:, 8:].mean(1) + 2).all()
    # and the logit error under those Queries is lower than a Euclidean allocation's at the same budget
    q = torch.randn(S, 256, 8, generator=g) @ torch.eye(D)[:8] * 3

    def logit_err(method):
        e = method.decode(method.encode(x, "k", SpanContext(stats=stats, history=100))) - x
        return torch.bmm(q, e.transpose(1, 2)).square().mean()

    assert logit_err(get_method("quantwm", budget=2.5)) < 0.5 * logit_err(get_method("quantwm", budget=2.5, qsac=False))


def test_allocation_fits_stops_only_when_no_upgrade_pays_and_prefers_heavier_channels():
    g = torch.Generator().manual_seed(2)
    E = torch.rand(3, 10, 1, generator=g) * torch.tensor([1.0, 0.3, 0.1, 0.03, 0.01])  # error falls with bits
    w = torch.ones(3, 10, 1)
    w[:, 0] = 100.0  # channel 0 weighs most
    cost = torch.tensor([0.0, 10, 20, 30, 40])
    available = torch.tensor([100.0, 150.0, 400.0])
    levels = allocate(w * E, cost, available)
    spent = cost[levels].sum(-1)
    assert (spent <= available).all()
    weighted = w * E
    for s in range(3):
        for i in range(10):
            for lv in range(levels[s, i] + 1, 5):  # any upgrade that still fits gains nothing
                if spent[s] - cost[levels[s, i]] + cost[lv] <= available[s]:
                    assert weighted[s, i, lv] >= weighted[s, i, levels[s, i]] - 1e-9
    assert (levels[:, 0] == levels.amax(1)).all()
    assert torch.equal(levels, allocate(w * E, cost, available))


def test_error_tables_pick_the_clip_that_lowers_the_error():
    g = torch.Generator().manual_seed(4)
    r = torch.randn(1, 1000, 2, generator=g)  # within SAMPLE_TOKENS: the tables see every token
    r[0, 0] = 40.0  # one outlier token: shrinking the range pays at few bits
    E, alpha = error_tables(r)
    assert alpha[0, :, 1].min() < 1.0 and alpha[0, :, 1].min() in CLIPS
    assert torch.allclose(E[0, :, 0], r[0].square().sum(0))  # 0 bits: the whole residual's energy
    assert (E[0, :, 8] < E[0, :, 2]).all() and (E[0, :, 2] < E[0, :, 0]).all()


@pytest.mark.parametrize("bad", [0, -1, 17, float("nan"), "2.5"])
def test_bad_budgets_are_refused_by_name(bad):
    with pytest.raises(ValueError, match="budget must be a number of bits per element"):
        get_method("quantwm", budget=bad)


def test_a_budget_the_tables_cannot_fit_says_so():
    with pytest.raises(ValueError, match="quantwm cannot fit 0.1 bits per element on spans of 8 tokens"):
        get_method("quantwm", budget=0.1).encode(torch.randn(1, 8, 64), "k", SpanContext())


def test_a_span_whose_channels_all_get_zero_bits_decodes_to_its_centroids():
    x = _span(2, 4096, 64, seed=11)
    enc = get_method("quantwm", budget=0.02).encode(x, "v", SpanContext())  # the tables alone nearly fill it
    assert (enc.residual.codes == 0).all() and enc.residual.max_bits == 0  # the budget's buffer, empty
    assert torch.equal(enc.decode(), enc.rows()) and enc.code_form().u.abs().sum() == 0


def test_a_budget_runs_the_allocator_with_options_of_the_fixed_configuration_left_aside():
    m = get_method("quantwm", budget=2.5, lam=4.0, psac=False, qsac=False)
    assert m.name == "quantwm-alloc" and m.budget == 2.5 and m.qsac is False  # lam and psac do not apply to it
    from quantwm.core.budget import configure

    opts, bits = configure("quantwm", 2.5, 64, 256, "k", options={"lam": 4.0})
    assert "budget" in opts and bits <= 2.5
