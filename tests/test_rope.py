"""Tests for quantwm.core.rope: 3-D (time, row, column) rotary embedding, Wan-style."""
import math

import pytest
import torch

from quantwm.core.rope import Rope3D, token_coords

GRID = (3, 4)  # 3 rows x 4 columns = 12 tokens per frame
TPF = GRID[0] * GRID[1]


def test_token_coords_row_major_per_frame():
    pos = torch.arange(2 * TPF)
    c = token_coords(pos, GRID)
    assert c.shape == (2 * TPF, 3)
    assert c.dtype == torch.long
    expected = torch.tensor([(f, r, w) for f in range(2) for r in range(GRID[0]) for w in range(GRID[1])])
    assert torch.equal(c, expected)
    # spot checks: token 5 is frame 0, row 1, col 1; token 12 starts frame 1; token 23 is the last of frame 1
    assert c[5].tolist() == [0, 1, 1]
    assert c[12].tolist() == [1, 0, 0]
    assert c[23].tolist() == [1, 2, 3]


def test_token_coords_accepts_non_long_positions():
    c = token_coords(torch.tensor([14.0, 7.0]), GRID)
    assert c.dtype == torch.long
    assert c.tolist() == [[1, 0, 2], [0, 1, 3]]


@pytest.mark.parametrize("head_dim", [5, 7, 4, 2, 0, 63])
def test_rope_bad_head_dim_raises(head_dim):
    with pytest.raises(ValueError, match="head_dim"):
        Rope3D(head_dim, GRID)


def test_rope_channel_split_wan_style():
    r = Rope3D(64, GRID)
    assert r.split == (24, 20, 20)
    assert sum(Rope3D(6, GRID).split) == 6


def test_rope_preserves_norms():
    rope = Rope3D(64, GRID)
    x = torch.randn(2, 3, 2 * TPF, 64)
    y = rope(x, torch.arange(2 * TPF) + 5)
    assert y.shape == x.shape and y.dtype == x.dtype
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(y, x, atol=1e-3)  # it did rotate


def test_rope_inverse_undoes_forward():
    rope = Rope3D(64, GRID)
    x = torch.randn(1, 2, 30, 64)
    pos = torch.arange(30) * 7 + 3
    y = rope(x, pos)
    torch.testing.assert_close(rope(y, pos, inverse=True), x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rope(rope(x, pos, inverse=True), pos), x, rtol=1e-5, atol=1e-5)


def test_rope_position_zero_is_identity():
    rope = Rope3D(64, GRID)
    x = torch.randn(1, 1, 1, 64)
    torch.testing.assert_close(rope(x, torch.tensor([0])), x)


def test_rope_first_pair_rotates_by_frame_index_interleaved():
    # channels (0, 1) form the first time pair with frequency 1: frame f rotates them by f radians
    rope = Rope3D(12, GRID)
    x = torch.zeros(1, 1, 1, 12)
    x[..., 0] = 1.0
    y = rope(x, torch.tensor([2 * TPF]))  # frame 2, row 0, col 0
    torch.testing.assert_close(y[0, 0, 0, :2], torch.tensor([math.cos(2.0), math.sin(2.0)]), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y[0, 0, 0, 2:], torch.zeros(10))


@pytest.mark.parametrize("axis,shift", [("t", TPF), ("row", GRID[1]), ("col", 1)])
def test_rope_shift_along_one_axis_rotates_only_that_axis_channels(axis, shift):
    rope = Rope3D(64, GRID)
    x = torch.randn(1, 1, 1, 64)
    p = torch.tensor([TPF + 1])  # frame 1, row 0, col 1: shifting by a row or a column stays in the frame
    diff = (rope(x, p + shift) - rope(x, p)).abs()[0, 0, 0]
    spans = {"t": slice(0, 24), "row": slice(24, 44), "col": slice(44, 64)}
    mask = torch.zeros(64, dtype=torch.bool)
    mask[spans[axis]] = True
    assert diff[~mask].max() < 1e-6
    assert diff[mask].max() > 1e-3


def _dot(rope, q, k, m, n):
    return (rope(q, torch.tensor([m])) * rope(k, torch.tensor([n]))).sum().item()


def test_rope_relative_property_depends_only_on_position_difference():
    rope = Rope3D(64, GRID)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, 64, generator=g), torch.randn(1, 1, 1, 64, generator=g)
    m, n = 2 * TPF + 5, TPF + 2  # (2, 1, 1) and (1, 0, 2)
    base = _dot(rope, q, k, m, n)
    for shift in (TPF, 3 * TPF, GRID[1]):  # whole frames; one row (no wrap: rows 1->2 and 0->1)
        assert _dot(rope, q, k, m + shift, n + shift) == pytest.approx(base, rel=1e-4, abs=1e-4)
    # shifting both by one column: (2,1,1)->(2,1,2) and (1,0,2)->(1,0,3), no wrap
    assert _dot(rope, q, k, m + 1, n + 1) == pytest.approx(base, rel=1e-4, abs=1e-4)
    # moving only one of them changes the dot product
    assert abs(_dot(rope, q, k, m + TPF, n) - base) > 1e-3
    assert abs(_dot(rope, q, k, m, n + 1) - base) > 1e-3


def test_rope_preserves_dtype_bf16():
    rope = Rope3D(64, GRID)
    x = torch.randn(1, 2, 5, 64).to(torch.bfloat16)
    y = rope(x, torch.arange(5))
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float().norm(dim=-1), x.float().norm(dim=-1), rtol=2e-2, atol=2e-2)


def test_frame_shift_keeps_a_bounded_number_of_matrices():
    """A long rollout asks for a new frame count every chunk: the kept matrices stay few (they held 8 MiB at 256),
    and one asked for again after eviction is the same matrix."""
    from quantwm.core.rope import FrameShift, _frame_matrix

    fs = FrameShift(64, 16)
    first = fs.matrix(-2).clone()
    for f in range(0, 600, 2):
        fs.matrix(f)
        fs.matrix(-f)
    assert _frame_matrix.cache_info().currsize <= 16
    assert torch.equal(fs.matrix(-2), first)
