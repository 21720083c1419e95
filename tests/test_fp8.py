"""quantwm/core/fp8.py: the FP8 path's rounding points, emulated."""
import pytest
import torch

from quantwm.core.fp8 import E4M3_MAX, block_quantize, e4m3, fp8_attention, fp8_logits


def test_e4m3_keeps_representable_values_and_rounds_the_rest():
    exact = torch.tensor([0.0, 1.0, -1.5, 448.0, 0.015625, 240.0])
    assert torch.equal(e4m3(exact), exact)
    assert e4m3(torch.tensor([1.06])).item() == 1.0 and e4m3(torch.tensor([1000.0])).item() == E4M3_MAX


def test_block_scales_put_each_block_on_the_e4m3_range():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 130, 16, generator=g) * torch.logspace(-2, 2, 130)[:, None]
    codes, scales = block_quantize(x, 64)
    assert codes.abs().amax() <= E4M3_MAX and scales.shape == x.shape
    assert ((codes * scales - x).abs() <= x.abs() * 2 ** -4 + scales * 2 ** -9).all()  # e4m3: 3 mantissa bits


def test_fp8_logits_are_the_exact_ones_up_to_a_per_query_shift_and_rounding():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 40, 64, generator=g), torch.randn(2, 300, 64, generator=g)
    k[..., :4] += 20  # outlier channels: the smoothing takes them out of the scale
    exact = 0.125 * q @ k.transpose(-1, -2)
    got = fp8_logits(q, k, 0.125)
    shift = exact - got  # a per-query constant (q · mean key), plus e4m3 rounding
    spread = (exact - exact.mean(-1, keepdim=True)).std()
    assert (shift - shift.mean(-1, keepdim=True)).std() < 0.05 * spread  # e4m3: 3 mantissa bits a side


def test_fp8_attention_is_close_to_exact_attention_and_takes_the_bias_in_fp32():
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(2, 50, 64, generator=g), torch.randn(2, 200, 64, generator=g), torch.randn(2, 200, 64, generator=g)
    bias = -torch.rand(2, 50, 200, generator=g)
    ref = torch.softmax(0.125 * q @ k.transpose(-1, -2) + bias, -1) @ v
    out = fp8_attention(q, k, v, 0.125, bias)
    assert ((out - ref).norm() / ref.norm()) < 0.08  # e4m3 keeps 3 mantissa bits; outputs here are near-averages
    # the online softmax over blocks gives the same result whatever the block count, up to e4m3 rounding of P
    assert ((fp8_attention(q, k, v, 0.125, bias, block=32) - out).norm() / out.norm()) < 0.08


@pytest.mark.parametrize("bad", [float("inf")])
def test_e4m3_saturates_rather_than_overflowing(bad):
    assert e4m3(torch.tensor([bad, -bad])).tolist() == [E4M3_MAX, -E4M3_MAX]


def test_int8_qk_is_finer_than_e4m3_and_unknown_formats_are_refused():
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 64, 64, generator=g), torch.randn(1, 256, 64, generator=g)
    exact = 0.125 * q @ (k - k.mean(-2, keepdim=True)).transpose(-1, -2)
    errs = {f: (fp8_logits(q, k, 0.125, qk=f) - exact).abs().mean() for f in ("e4m3", "int8")}
    assert errs["int8"] < errs["e4m3"]
    with pytest.raises(ValueError, match="unknown low-precision format 'fp4'"):
        block_quantize(q, 64, fmt="fp4")
