"""benchmarks/turboquant_split.py's diagnostic: TurboQuant's two instances shrink their parts by different factors
(a Lloyd-Max code decodes to its cell's mean: E[x̂ | x] ≈ (1 − D_b) x), and `shrunk_alike` scales the wider
instance's channels so that both shrink alike, leaving plain spans and the class as they were."""
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import turboquant_split as ts  # noqa: E402

from quantwm.core.layouts.rotated import Rotated  # noqa: E402
from quantwm.core.lloyd_max import lloyd_max  # noqa: E402
from quantwm.core.methods import SpanContext, get_method  # noqa: E402


def _slope(x_hat: torch.Tensor, x: torch.Tensor) -> float:
    """The least-squares slope of x_hat on x over every element: how much the decode shrinks x."""
    return ((x_hat * x).sum() / x.square().sum()).item()


def test_the_split_shrinks_its_parts_unlike_and_the_diagnostic_alike():
    x = torch.randn(2, 1728, 128, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.2, 3, 128)
    split = get_method("turboquant", bits=2, outlier_channels=32, outlier_bits=3).encode(x, "k", SpanContext())
    plain = get_method("turboquant", bits=2).encode(x, "k", SpanContext())
    out = torch.zeros(2, 128, dtype=torch.bool).scatter_(1, split.channels.long(), True)[:, None, :].expand_as(x)
    d2, d3 = lloyd_max(2).mse, lloyd_max(3).mse
    before = Rotated.__dict__["decode"]
    decoded = split.decode()
    assert _slope(decoded[out], x[out]) == pytest.approx(1 - d3, abs=0.01)  # 0.965: the 3-bit instance
    assert _slope(decoded[~out], x[~out]) == pytest.approx(1 - d2, abs=0.01)  # 0.882: the 2-bit one
    assert _slope(plain.decode(), x) == pytest.approx(1 - d2, abs=0.01)  # one instance: one factor
    with ts.shrunk_alike():
        alike = split.decode()
        assert torch.equal(plain.decode(), get_method("turboquant", bits=2).encode(x, "k", SpanContext()).decode())
    assert _slope(alike[out], x[out]) == pytest.approx(1 - d2, abs=0.01)
    torch.testing.assert_close(alike[~out], decoded[~out], rtol=0, atol=0)
    assert Rotated.__dict__["decode"] is before and torch.equal(split.decode(), decoded)


def test_it_needs_a_trace_or_the_builtin_model(capsys):
    with pytest.raises(SystemExit):
        ts.main([])
    assert "give --trace (one or more) or --builtin" in capsys.readouterr().err
