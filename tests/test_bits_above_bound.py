"""benchmarks/bits_above_bound.py: the decomposition of quantwm's distance above the bound adds up."""
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bits_above_bound as bab  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    trace = bab.make_trace("aligned", 100003, tmp_path_factory.mktemp("bab"), query_dims=8, heads=2, head_dim=32,
                           grid=(8, 8), cached_frames=6, chunk_frames=2)
    return bab.decompose_layer(trace, 0, budget=2.5)


@pytest.mark.parametrize("meter", ["history", "reading"])
def test_bits_above_bound_parts_add_up_to_the_total(tiny, meter):
    steps, parts = tiny[meter]["steps"], tiny[meter]["parts"]
    assert list(steps) == list(bab.STEPS) and list(parts) == list(bab.PARTS)
    assert all(math.isfinite(v) for v in [*steps.values(), *parts.values()])
    assert sum(parts.values()) == pytest.approx(steps["quantwm"] - steps["fractional"], abs=1e-9)
    assert abs(steps["fractional"]) < 1e-6  # the bound's own rates sit on it
    assert steps["quantwm"] > 0


def test_bits_above_bound_side_information_is_the_stored_bytes(tiny):
    assert tiny["bits"] == pytest.approx(tiny["bits_cache"], rel=1e-9)
    assert tiny["history"]["parts"]["side information"] == pytest.approx(sum(tiny["side"].values()), abs=1e-12)
    assert tiny["bits"] <= 2.5 + 1e-9
    # the codes are one tensor of the span: every other stored byte is side information, none of it negative
    assert 0 < tiny["code_bits"] <= tiny["bits"] and all(v >= 0 for v in tiny["side"].values()), tiny["side"]


def test_lloyd_tables_never_above_the_uniform_grid():
    z = torch.randn(1, 300, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    z = z - z.mean(1, keepdim=True)
    assert (bab.lloyd_tables(z) <= bab.uniform_tables(z)[0] * (1 + 1e-6)).all()
