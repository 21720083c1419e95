"""The history Queries' S re-aimed at the frames that read a span (FrameShift, QueryStats.anchored, SpanContext.aim)."""
import pytest
import torch

from quantwm.core.cache import CacheConfig, KVCache
from quantwm.core.methods import get_method
from quantwm.core.rope import FrameShift, Rope3D
from quantwm.core.stats import QueryStats
from quantwm.evaluation.metrics import second_moment


def test_a_frame_shift_is_rope_at_a_later_frame():
    D, grid = 48, (4, 5)
    rope, shift = Rope3D(D, grid), FrameShift(D, 20)
    x = torch.randn(1, 1, 20, D)
    p = torch.arange(20) + 40  # frame 2
    here, later = rope(x, p)[0, 0].double(), rope(x, p + 60)[0, 0].double()  # frame 5
    assert torch.allclose(here @ shift.matrix(3), later, atol=1e-5)
    assert torch.allclose(later @ shift.matrix(-3), here, atol=1e-5)
    assert shift.frames(60) == 3 and shift.frames(61) is None


def test_bad_frame_shifts_and_aims_are_refused():
    with pytest.raises(ValueError, match="tokens_per_frame"):
        FrameShift(48, 0)
    with pytest.raises(ValueError, match="head_dim"):
        FrameShift(7, 4)
    with pytest.raises(ValueError, match="frame_shift"):
        KVCache(CacheConfig("quantwm", budget=2.5), 1, frame_shift=20)
    with pytest.raises(ValueError, match="aim_chunks"):
        get_method("quantwm-alloc", budget=2.5, aim_chunks=-1)


def test_a_seeded_or_unshifted_accumulator_keeps_no_anchored_moment():
    s = QueryStats(2, 8)
    s.update(torch.randn(1, 2, 5, 8), anchor=torch.eye(8))
    assert s.anchored is not None
    s.update(torch.randn(1, 2, 5, 8))  # queries without their frame: the anchored moment would mix them wrongly
    assert s.anchored is None
    t = QueryStats(2, 8)
    t.load(torch.eye(8).expand(2, 8, 8))
    assert t.anchored is None


def test_the_aimed_s_is_the_next_chunks_queries_not_the_history_average():
    """Queries whose pre-RoPE law is fixed, rotated by their positions: the S of the chunk that comes next is the
    history's moved to its frames, which the plain running S (averaged over every past frame) is not."""
    torch.manual_seed(0)
    B, H, D, grid, F = 1, 2, 48, (8, 8), 2  # 2 frames a chunk
    tpf, N = grid[0] * grid[1], F * grid[0] * grid[1]
    rope = Rope3D(D, grid, theta=10.0)  # fast temporal pairs: S turns visibly from frame to frame
    cache = KVCache(CacheConfig("quantwm", budget=2.5, sink_chunks=1, recent_chunks=1), 1,
                    frame_shift=FrameShift(D, tpf, theta=10.0))
    A = torch.randn(H, D, 4)
    direction = torch.randn(H, 1, D)

    def queries(chunk):
        pre = (torch.randn(B, H, N, 4) @ A.transpose(1, 2)) + 3 * direction  # a mean direction: S has structure
        return rope(pre, torch.arange(chunk * N, (chunk + 1) * N))

    seen = []
    for chunk in range(4):
        q = queries(chunk)
        seen.append(q)
        cache.attend(0, q, torch.randn(B, H, N, D), torch.randn(B, H, N, D), chunk=chunk, commit=True)
    st = cache.layers[0]
    span = next(c for c in cache.spans(0) if c.quantized)
    aimed = cache.aimed(st, span, 1).double()  # at chunk 4's frames
    truth = second_moment(torch.cat([queries(4) for _ in range(20)], 2)[0]).double()
    plain = second_moment(torch.cat(seen, 2)[0]).double()
    err = lambda S: float((S - truth).norm() / truth.norm())  # noqa: E731
    assert err(aimed) < 0.1 and err(plain) > 2 * err(aimed)
