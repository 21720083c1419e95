"""quantwm/core/fp8.py: the low-precision attention path's rounding points (the kernel's twin)."""
import pytest
import torch

from quantwm.core.fp8 import E4M3_MAX, e4m3, int8, lowp_attention, lowp_dots, row_quantize


def test_e4m3_keeps_representable_values_and_rounds_the_rest():
    exact = torch.tensor([0.0, 1.0, -1.5, 448.0, 0.015625, 240.0, 2 ** -9])
    assert torch.equal(e4m3(exact), exact)
    assert e4m3(torch.tensor([1.06])).item() == 1.0 and e4m3(torch.tensor([1.97])).item() == 2.0


@pytest.mark.parametrize("bad", [float("inf"), 1000.0])
def test_e4m3_saturates_rather_than_overflowing(bad):
    assert e4m3(torch.tensor([bad, -bad])).tolist() == [E4M3_MAX, -E4M3_MAX]


def test_int8_rounds_half_to_even_and_clamps():
    assert int8(torch.tensor([0.5, 1.5, -2.5, 300.0, -300.0])).tolist() == [0.0, 2.0, -2.0, 127.0, -127.0]


@pytest.mark.parametrize("fmt, top, rel", [("int8", 127.0, None), ("e4m3", E4M3_MAX, 2 ** -4)])
def test_row_scales_put_each_row_on_the_format_range(fmt, top, rel):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 130, 16, generator=g) * torch.logspace(-2, 2, 130)[:, None]
    x[0, 5] = 0  # a zero row gets scale 1
    codes, scales = row_quantize(x, fmt)
    assert scales.shape == (2, 130, 1) and scales[0, 5].item() == 1.0
    assert torch.allclose(codes.abs().amax(-1)[x.abs().amax(-1) > 0], torch.tensor(top))
    bound = scales / 2 if rel is None else x.abs() * rel + scales * 2 ** -10
    assert ((codes * scales - x).abs() <= bound * (1 + 1e-6)).all()


def test_lowp_dots_are_exact_but_for_rounding_whatever_the_centre():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 40, 64, generator=g), torch.randn(2, 300, 64, generator=g)
    k[..., :4] += 20  # outlier channels: the centre takes them out of the scales
    exact = q @ k.transpose(-1, -2)
    spread = (exact - exact.mean(-1, keepdim=True)).std()
    errs = {}
    for fmt in ("int8", "e4m3"):
        errs[fmt] = (lowp_dots(q, k, qk=fmt) - exact).abs().mean() / spread
        assert errs[fmt] < 0.05  # q·μ comes back exactly: no per-query offset
    assert errs["int8"] < errs["e4m3"]  # 8 bits a side against 4
    far = lowp_dots(q, k, torch.zeros(2, 64))  # a poor centre is still exact up to (larger) rounding
    assert (far - exact).abs().mean() / spread < 0.2
    assert torch.equal(lowp_dots(q, k, qk="bf16"), q.bfloat16().float() @ k.bfloat16().float().transpose(-1, -2))
    with pytest.raises(ValueError, match="unknown low-precision format 'fp4'"):
        lowp_dots(q, k, qk="fp4")


def test_lowp_attention_is_close_to_exact_attention_and_takes_the_bias_in_fp32():
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(2, 50, 64, generator=g), torch.randn(2, 200, 64, generator=g), torch.randn(2, 200, 64, generator=g)
    bias = -5 * torch.rand(2, 50, 200, generator=g)
    ref = torch.softmax(0.125 * q @ k.transpose(-1, -2) + bias, -1) @ v
    for fmt, tol in (("int8", 0.05), ("e4m3", 0.1)):
        out = lowp_attention(q, k, v, 0.125, bias, qk=fmt)
        assert ((out - ref).norm() / ref.norm()) < tol  # P and V in e4m3: 3 mantissa bits
    wrong = lowp_attention(q, k, v, 0.125, qk="int8")
    assert ((wrong - ref).norm() / ref.norm()) > 0.1  # the bias matters: it is applied


def _layout(x, bits, G, axis, symmetric):
    from quantwm.core.layouts import Grouped
    from quantwm.core.quant import quantize_groups

    return Grouped(quantize_groups(x, bits, G, axis, symmetric))


@pytest.mark.parametrize("bits, G, axis, symmetric", [(2, 64, "channel", False), (2, 32, "channel", True),
                                                      (8, 16, "channel", False), (2, 64, "token", False),
                                                      (4, 32, "token", True)])
def test_code_dots_round_only_the_queries(bits, G, axis, symmetric):
    """Keys read as codes lose nothing: with queries that INT8 holds exactly (integers, row maximum 127) the
    per-token-group products are the decoded keys' products; token groups round q times the scales, no more."""
    from quantwm.core.fp8 import code_dots
    from quantwm.core.layouts import Codebook

    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 150, 64, generator=g) * 3 + 1
    grouped = _layout(x, bits, G, axis, symmetric)
    layout = Codebook(((torch.randn(2, 3, 64, generator=g), torch.randint(0, 3, (2, 150), generator=g)),), grouped)
    assert layout.reads_codes("int8")
    q = torch.randint(-126, 127, (2, 30, 64), generator=g).float()
    q[..., 0] = 127
    exact = q @ layout.decode().transpose(1, 2)
    diff = (code_dots(q, layout.code_form()) - exact).abs()
    if axis == "channel":
        assert diff.max() / exact.abs().max() < 1e-6
    else:  # each product errs by at most half a step of q ⊙ s (its row's INT8 step) times Σ|u|
        u = layout.code_form().u.abs().sum(-1)  # (2, 150)
        group = torch.arange(150) // G
        step = (q[:, :, None, :] * grouped.q.scale.float()[:, None]).abs().amax(-1) / 127  # (2, 30, groups)
        bound = step[:, :, group] / 2 * u[:, None, :]
        assert 0 < diff.max() and (diff <= bound * (1 + 1e-4) + 1e-3).all()


def test_reads_codes_takes_the_layouts_the_kernel_can_dot():
    from quantwm.core.layouts import Full

    x = torch.randn(1, 96, 64)
    assert _layout(x, 2, 64, "channel", False).reads_codes("int8")
    assert not _layout(x, 2, 8, "channel", False).reads_codes("int8")  # groups under 16 channels: no tensor-core dot
    assert not _layout(x, 2, 48, "token", False).reads_codes("int8")  # token groups that split a key block
    assert _layout(x, 8, 64, "channel", False).reads_codes("int8")
    assert not _layout(x, 8, 64, "channel", False).reads_codes("e4m3")  # e4m3 holds integers up to 16
    assert not Full(x).reads_codes("int8")
