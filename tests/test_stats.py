"""Tests for quantwm.core.stats: the running history-Query second moment S = E[q qᵀ] per head."""
import pytest
import torch

from quantwm.core.stats import QueryStats


def _second(q: torch.Tensor) -> torch.Tensor:
    """Mean of q qᵀ over batch and tokens, per head: (B, H, N, D) -> (H, D, D) float64."""
    qd = q.double()
    return torch.einsum("bhnd,bhne->hde", qd, qd) / (q.shape[0] * q.shape[2])


def test_stats_identity_before_any_query():
    s = QueryStats(3, 8)
    m = s.matrix()
    assert m.shape == (3, 8, 8)
    assert m.dtype == torch.float32
    assert torch.equal(m, torch.eye(8).expand(3, 8, 8))
    assert s.count == 0


def test_stats_identity_matrix_is_a_fresh_tensor():
    s = QueryStats(2, 4)
    m = s.matrix()
    m.mul_(5)
    assert torch.equal(s.matrix(), torch.eye(4).expand(2, 4, 4))


def test_stats_single_update_equals_mean_outer_product():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 10, 6, generator=g)
    s = QueryStats(3, 6)
    s.update(q)
    assert s.count == 20
    torch.testing.assert_close(s.matrix(), _second(q).float(), rtol=1e-6, atol=1e-6)


def test_stats_cumulative_mean_over_calls_of_different_sizes():
    g = torch.Generator().manual_seed(1)
    qs = [torch.randn(1, 2, n, 8, generator=g) * (i + 1) for i, n in enumerate((5, 17, 3, 40))]
    s = QueryStats(2, 8)
    for q in qs:
        s.update(q)
    expected = _second(torch.cat(qs, 2))  # the mean over all queries, not over calls
    assert s.count == 65
    torch.testing.assert_close(s.matrix().double(), expected, rtol=1e-5, atol=1e-5)
    per_call_mean = torch.stack([_second(q) for q in qs]).mean(0)
    assert not torch.allclose(s.matrix().double(), per_call_mean, rtol=1e-3, atol=1e-3)


def test_stats_ema_weights_update_calls():
    g = torch.Generator().manual_seed(2)
    qs = [torch.randn(1, 2, n, 4, generator=g) * (i + 1) for i, n in enumerate((6, 2, 9))]
    d = 0.75
    s = QueryStats(2, 4, decay=d)
    for q in qs:
        s.update(q)
    b0, b1, b2 = (_second(q) for q in qs)
    expected = d * (d * b0 + (1 - d) * b1) + (1 - d) * b2  # the first call seeds S
    torch.testing.assert_close(s.matrix().double(), expected, rtol=1e-5, atol=1e-5)
    assert s.count == 17


def test_stats_update_with_no_tokens_is_a_no_op():
    s = QueryStats(2, 4)
    s.update(torch.zeros(1, 2, 0, 4))
    assert s.count == 0
    assert torch.equal(s.matrix(), torch.eye(4).expand(2, 4, 4))


@pytest.mark.parametrize("shape", [(2, 5, 4), (1, 3, 5, 4), (1, 2, 5, 6), (1, 2, 5, 4, 1)])
def test_stats_update_rejects_bad_shapes(shape):
    s = QueryStats(2, 4)
    with pytest.raises(ValueError, match=r"queries must be \(B, 2, N, 4\)"):
        s.update(torch.randn(*shape))
    assert s.count == 0


@pytest.mark.parametrize("decay", [0.0, 1.0, -0.5, 1.5])
def test_stats_decay_outside_open_unit_interval_raises(decay):
    with pytest.raises(ValueError, match="decay"):
        QueryStats(2, 4, decay=decay)


@pytest.mark.parametrize("decay", [None, 1e-3, 0.5, 0.999])
def test_stats_decay_valid_values_accepted(decay):
    assert QueryStats(2, 4, decay=decay).decay == decay


def test_stats_load_seeds_matrix_and_count():
    seed = torch.randn(2, 4, 4, dtype=torch.float64)
    seed = seed @ seed.transpose(-1, -2)
    s = QueryStats(2, 4)
    s.load(seed.float(), count=10)
    assert s.count == 10
    torch.testing.assert_close(s.matrix(), seed.float())


def test_stats_load_then_update_continues_the_cumulative_mean():
    g = torch.Generator().manual_seed(3)
    calib = torch.randn(1, 2, 30, 4, generator=g)
    new = torch.randn(1, 2, 10, 4, generator=g) * 3
    s = QueryStats(2, 4)
    s.load(_second(calib).float(), count=30)
    s.update(new)
    torch.testing.assert_close(s.matrix().double(), _second(torch.cat([calib, new], 2)), rtol=1e-5, atol=1e-5)


def test_stats_load_does_not_alias_callers_tensor():
    seed = torch.eye(4, dtype=torch.float64).expand(2, 4, 4).clone() * 2
    before = seed.clone()
    s = QueryStats(2, 4)
    s.load(seed, count=1)
    s.update(torch.randn(1, 2, 5, 4))
    assert torch.equal(seed, before), "QueryStats.update modified the calibration tensor passed to load()"


def test_stats_load_rejects_wrong_shape():
    s = QueryStats(2, 4)
    with pytest.raises(ValueError, match="calibration statistics must be"):
        s.load(torch.eye(4).expand(3, 4, 4))
    assert s.count == 0
