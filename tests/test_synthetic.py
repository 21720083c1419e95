"""Tests for quantwm.evaluation.synthetic: the query subspace's dimension sets the trace's top-8 energy."""
import pytest

from quantwm.evaluation.metrics import query_energy, second_moment
from quantwm.evaluation.synthetic import QUERY_DIMS_FOR_TOP8, make_synthetic_trace


@pytest.mark.parametrize("target", sorted(QUERY_DIMS_FOR_TOP8))
def test_query_dims_give_the_named_top8_energy(target):
    w = make_synthetic_trace(seed=11, n_layers=1, n_heads=4, content_dim=QUERY_DIMS_FOR_TOP8[target])
    (t,) = w.layers.values()
    top8 = float(query_energy(second_moment(t["q_hist"].float()))[1].mean())
    assert top8 == pytest.approx(float(target.rstrip("%")) / 100, abs=0.04)


def test_query_dims_outside_the_slow_rope_channels_are_refused():
    with pytest.raises(ValueError, match="must lie in 1..24"):
        make_synthetic_trace(content_dim=25)
