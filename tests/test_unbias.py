"""Channels.unbiased and the allocator's `unbias` (docs/method.md §2.6): a coded Value channel's decode stretched
about its mean so that its least-squares slope on the values it coded is 1, in the same bytes; Keys untouched."""
import pytest
import torch

from quantwm.core.allocate import encode_channels
from quantwm.core.layouts.trellis import TrellisChannels
from quantwm.core.methods import SpanContext, get_method


def _slopes(x_hat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Per channel (S, D): the least-squares slope of x_hat's deviation from its mean on x's."""
    dx, dh = x - x.mean(1, keepdim=True), x_hat - x_hat.mean(1, keepdim=True)
    return (dh * dx).sum(1) / dx.square().sum(1)


def _span(seed=0, S=2, N=512, D=16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(S, N, D, generator=g) * (torch.rand(S, 1, D, generator=g) * 2 + 0.5)


@pytest.mark.parametrize("coder", ["grid", "trellis"])
def test_a_shrunk_channel_is_stretched_to_slope_one_in_the_same_bytes(coder):
    r = _span()
    bits = torch.tensor([[2, 3, 4, 0] * 4, [3, 2, 0, 4] * 4])
    alpha = torch.full(bits.shape, 0.55)  # a clipped grid shrinks its channel (a 1-bit one may stretch it instead)
    coded = (encode_channels(r, bits, alpha, None) if coder == "grid"
             else TrellisChannels.code(r, bits, alpha))
    before, fixed = coded.decode(), coded.unbiased(r)
    live = bits > 0
    assert (_slopes(before, r)[live] < 1).all() and _slopes(before, r)[live].min() < 0.95  # shrunk: clip, cell means
    after = fixed.decode()
    assert torch.allclose(_slopes(after, r)[live], torch.ones(int(live.sum())), atol=0.01)  # fp16 tables
    assert torch.allclose(after.mean(1), before.mean(1), atol=1e-2)  # stretched about the channel's mean
    assert (after[:, :, ~live[0]][0] == 0).all()  # a 0-bit channel still decodes to 0
    assert type(fixed) is type(coded) and fixed.nbytes() == coded.nbytes()
    assert torch.equal(fixed.codes, coded.codes) and torch.equal(fixed.bits, coded.bits)
    if coder == "grid":  # coding with unbias: the same stretch from the packing's sums (1 fp16 ulp: another order)
        direct = encode_channels(r, bits, alpha, None, unbias=True)
        assert torch.equal(direct.codes, coded.codes)
        for a, b in ((direct.low, fixed.low), (direct.step_, fixed.step_)):
            assert ((a.float() - b.float()).abs() <= b.float().abs() * 2 ** -10).all()
        assert torch.equal(direct.low_read, torch.where(bits > 0, direct.low.float(), 0.0))
    if coder == "trellis":
        assert torch.equal(fixed.on_grid, coded.on_grid)
        # coding with unbias reuses the choice's decodes: the same tables as unbiasing the coded span afterwards
        direct = TrellisChannels.code(r, bits, alpha, unbias=True)
        assert torch.equal(direct.low, fixed.low) and torch.equal(direct.step_, fixed.step_)
        assert torch.equal(direct.codes, fixed.codes)
    # the mean squared error rises (noise kept, bias removed) but the error is now uncorrelated with the values
    err = after - r
    assert (_slopes(err + r, r) - 1)[live].abs().max() < 0.01


def test_an_unshrunk_or_constant_channel_is_left_as_it_is():
    r = _span(1, S=1, N=256, D=4)
    r[0, :, 3] = 2.0  # constant
    coded = encode_channels(r, torch.tensor([[8, 8, 0, 2]]), torch.ones(1, 4), None)  # 8 bits, no clip: slope ~1
    fixed = coded.unbiased(r)
    assert torch.equal(fixed.step_[0, 2:], coded.step_[0, 2:]) and torch.equal(fixed.low[0, 2:], coded.low[0, 2:])
    assert torch.allclose(_slopes(fixed.decode(), r)[0, :2], torch.ones(2), atol=2e-3)


@pytest.mark.parametrize("method", ["quantwm-alloc", "quantwm-trellis"])
def test_the_allocator_unbiases_values_not_keys(method):
    x = _span(2, S=2, N=384, D=32)
    ctx = SpanContext()
    assert get_method(method, budget=2.0).unbias  # on by default in both (quantwm-alloc: `quantwm` at a budget)
    on, off = get_method(method, budget=2.0, unbias=True), get_method(method, budget=2.0, unbias=False)
    assert torch.equal(on.encode(x, "k", ctx).decode(), off.encode(x, "k", ctx).decode())  # Keys untouched
    v_on, v_off = on.encode(x, "v", ctx), off.encode(x, "v", ctx)
    assert v_on.nbytes() == v_off.nbytes()
    r = x - v_on.decode() + v_on.residual.decode()  # the residual the channels coded (x less its centroids)
    coded = v_on.residual.bits > 0
    assert torch.allclose(_slopes(v_on.residual.decode(), r)[coded], torch.ones(int(coded.sum())), atol=0.02)
    assert (_slopes(v_off.residual.decode(), r)[coded] < 1).float().mean() > 0.9
    with pytest.raises(ValueError, match="unbias must be true or false, got 'yes'"):
        get_method(method, budget=2.0, unbias="yes")
