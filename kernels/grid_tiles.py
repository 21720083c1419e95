"""JIT helpers the allocator's kernels share (kernels/channel_errors.py, kernels/pack_channels.py,
kernels/trellis_choice.py): a channel's uniform grid as `Channels` stores it (quantwm/core/layouts/channels.py,
docs/method.md §2.6), and a value's code on it. Triton JIT functions only.
"""
import triton
import triton.language as tl

FP16_TINY = tl.constexpr(6.103515625e-05)  # torch.finfo(torch.float16).tiny: the least step a grid stores (a
# constexpr: a kernel may read no other global)


@triton.jit
def _channel_grid(lo, hi, alpha, b, top):
    """(mid, low, step) of channels whose range is [lo, hi], clip alpha and width b bits (top = 2^b − 1), float32:
    the range shrunk by alpha about its middle mid, 2^b levels from low by step, both rounded to fp16 as stored (the
    step at least fp16's least normal); a 0-bit channel has no grid (low 0, step 1: it decodes to 0)."""
    mid = (hi + lo) / 2
    half = (hi - lo) / 2 * alpha
    low = (mid - half).to(tl.float16).to(tl.float32)
    step = tl.where(half > 0, tl.math.div_rn(2 * half, tl.maximum(top, 1).to(tl.float32)), 1.0)
    step = tl.maximum(step.to(tl.float16).to(tl.float32), FP16_TINY)
    return mid, tl.where(b > 0, low, 0.0), tl.where(b > 0, step, 1.0)


@triton.jit
def _grid_code(x, low, step, top):
    """The code (float32) of x on the grid low + code · step: round((x − low) / step) half to even, as torch.round,
    clamped to [0, top] (low, step and top float32, each of x's shape or broadcast to it)."""
    v = tl.math.div_rn(x - low, step)
    f = tl.floor(v)
    frac = v - f
    q = tl.where(frac > 0.5, f + 1, tl.where(frac < 0.5, f, f + (f - 2 * tl.floor(f * 0.5))))
    return tl.minimum(tl.maximum(q, 0.0), top)
