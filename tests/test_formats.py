"""quantwm/core/methods/formats.py: nvfp4 and int8k-fp8v against references written from the formats' definitions,
one element at a time in plain Python floats."""
import math
import struct

import pytest
import torch

from quantwm.core.cache import CacheConfig, KVCache
from quantwm.core.methods import REGISTRY, SpanContext, get_method, make_method
from quantwm.core.methods.allocator import QuantWMAlloc

# not fixed formats: the allocator and its presets, whose budget sets their widths
ALLOCATORS = tuple(m for m, c in REGISTRY.items() if issubclass(c, QuantWMAlloc))
FORMATS = sorted(m for m in REGISTRY if not REGISTRY[m].takes_bits and m not in ("bf16", *ALLOCATORS))  # fixed formats

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e4m3_values() -> list[float]:
    """Every finite non-negative fp8-e4m3 (e4m3fn) value, from the format: 4 exponent bits (bias 7), 3 mantissa
    bits, subnormals at exponent 0, no infinities, S.1111.111 is NaN (so the largest is 448)."""
    out = []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue
            out.append(m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return sorted(out)


E4M3 = e4m3_values()


def round_to(grid: list[float], a: float) -> float:
    """Nearest value of a sorted non-negative grid to |a| (saturating), ties to the even code, with the sign.
    Both grids list their values in code order, so a value's index is its code (its last bit: the mantissa's)."""
    mag = min(abs(a), grid[-1])
    best = min(range(len(grid)), key=lambda i: (abs(grid[i] - mag), i % 2))
    return math.copysign(grid[best], a) if grid[best] else 0.0


def f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def nvfp4_ref(x: list[list[float]]) -> list[list[float]]:
    """One stream (N tokens x D): the per-stream fp32 scale, e4m3 block scales per 16, e2m1 elements."""
    amax = max(abs(v) for row in x for v in row)
    g = f32(amax / (6 * 448)) if amax > 0 else 1.0
    out = []
    for row in x:
        new = []
        for b in range(0, len(row), 16):
            block = row[b:b + 16]
            s = round_to(E4M3, f32(f32(max(abs(v) for v in block) / 6) / g))
            d = f32(s * g)
            new += [round_to(E2M1, f32(v / d)) * d if d > 0 else 0.0 for v in block]
        out.append(new)
    return out


def test_nvfp4_round_trip_equals_the_formats_definition():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 32, generator=g) * torch.tensor([0.01, 3.0]).view(2, 1, 1)
    x[1, 0, :16] = 0.0  # an all-zero block
    x[0, 2, 3] = 40.0  # an outlier that sets the stream's scale
    m = get_method("nvfp4")
    enc = m.encode(x, "k", SpanContext())
    got = m.decode(enc)
    for s in range(2):
        want = torch.tensor(nvfp4_ref(x[s].tolist()))
        assert torch.allclose(got[s], want, rtol=1e-6, atol=0), (got[s] - want).abs().max()
    assert enc.nbytes() == 2 * 5 * 32 // 2 + 2 * 5 * 2 + 2 * 4  # codes, one fp8 scale per 16, fp32 per stream
    assert 8 * enc.nbytes() / x.numel() == pytest.approx(4.5 + 2 * 32 / x.numel())


def test_e2m1_rounds_every_tie_to_the_even_code():
    from quantwm.core.methods.formats import e2m1_codes, e2m1_values

    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, 7.0, -100.0])
    assert e2m1_values(e2m1_codes(ties)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -1.0, 6.0, -6.0]
    for v in torch.linspace(-7, 7, 281).tolist():
        assert e2m1_values(e2m1_codes(torch.tensor([v]))).item() == round_to(E2M1, v)


def test_int8_keys_and_fp8_values_equal_the_formats_definition():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 70, 8, generator=g) * 2  # 70 tokens: a full block of 64 and a short one
    m = get_method("int8k-fp8v")
    k = m.decode(m.encode(x, "k", SpanContext()))[0]
    v = m.decode(m.encode(x, "v", SpanContext()))[0]
    rows = x[0].tolist()
    for start in (0, 64):
        block = rows[start:start + 64]
        s = f32(max(abs(a) for r in block for a in r) / 127)
        want = [[max(-127, min(127, round(f32(a / s)))) * s for a in r] for r in block]
        assert torch.allclose(k[start:start + 64], torch.tensor(want), rtol=1e-6, atol=0)
    for c in range(8):
        col = [r[c] for r in rows]
        s = f32(max(abs(a) for a in col) / 448)
        want = [round_to(E4M3, f32(a / s)) * s for a in col]
        assert torch.allclose(v[:, c], torch.tensor(want), rtol=1e-6, atol=0)


def test_the_fixed_formats_take_no_bits_and_report_their_own():
    assert make_method("nvfp4", 2).grid().endswith("(4.5 bits)")
    # spans of 64 tokens x 64 channels: nvfp4 4.5 bits + an fp32 per stream; int8 Keys 8 + an fp32 per 64 x 64
    # block, fp8 Values 8 + an fp32 per channel (a real span of 4680 tokens makes both about 8.007)
    for name, want in (("nvfp4", 4.5 + 32 / 64 ** 2), ("int8k-fp8v", 8 + (32 / 64 ** 2 + 32 / 64) / 2)):
        cache = KVCache(CacheConfig(method=name, k_bits=2, v_bits=2), 1)
        g = torch.Generator().manual_seed(2)
        for i in range(4):
            k, v = (torch.randn(1, 2, 64, 64, generator=g) for _ in range(2))
            cache.attend(0, k, k, v, chunk=i, commit=True)
        assert cache.bits_per_element() == pytest.approx(want), name


def test_nvfp4_refuses_a_head_dim_it_cannot_block():
    with pytest.raises(ValueError, match="divisible by 16"):
        get_method("nvfp4").encode(torch.randn(1, 4, 24), "k", SpanContext())


def test_steps_are_the_rounding_cells():
    x = torch.tensor([[[0.1, 0.5, 1.0, 6.0] * 4]])
    m = get_method("nvfp4")
    enc = m.encode(x, "k", SpanContext())
    err = (m.decode(enc) - x).abs()
    assert (err <= enc.step() / 2 + 1e-7).all()  # every element within half its cell
    m8 = get_method("int8k-fp8v")
    for kind in ("k", "v"):
        y = torch.randn(1, 9, 16, generator=torch.Generator().manual_seed(3))
        enc = m8.encode(y, kind, SpanContext())
        assert ((m8.decode(enc) - y).abs() <= enc.step() / 2 + 1e-7).all()


@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize("name", FORMATS)
def test_a_format_keeps_the_method_contract(name, kind):
    assert FORMATS == ["int8k-fp8v", "nvfp4"]
    x = torch.randn(2, 97, 64, generator=torch.Generator().manual_seed(4))
    m = get_method(name)
    enc = m.encode(x, kind, SpanContext())
    assert enc.nbytes() == sum(t.numel() * t.element_size() for t in enc.components().values())
    x_hat = m.decode(enc)
    assert x_hat.shape == x.shape and x_hat.dtype == torch.float32
    assert 0 < ((x_hat - x).square().sum() / x.square().sum()).item() < 0.02  # quantized, and closely
    bf = x.bfloat16()
    assert torch.equal(m.decode(m.encode(bf, kind, SpanContext())), m.decode(m.encode(bf.float(), kind, SpanContext())))
    x[1, 5, 7] = float("nan")
    with pytest.raises(ValueError, match="NaN/Inf"):
        m.encode(x, kind, SpanContext())
