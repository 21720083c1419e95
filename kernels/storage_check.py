"""A stored table's storage check in one launch, for a span quantized with its checks deferred (an accelerator's
commit): the twin of quantwm.core.quant.storage_check_ref, what quantwm.core.quant.to_storage runs there.

Given x (n,) float32, its cast s = x.to(dt) (fp8-e4m3 or fp16, made by PyTorch, so the rounding is PyTorch's) and
rms (0-dim float32) = ‖x‖ / √n: whether every element survives the cast, |s_i − x_i| − STORAGE_REL_TOL |x_i| <=
STORAGE_RMS_TOL rms with |x_i| at most dt's largest value (quantwm.core.quant._fits; a NaN fails it), written as
a 0-dim bool; and s's negative zeros made positive, in place (through s's integer view). One program walks the
table BLOCK elements at a time: the tables it takes are a span's mean rows and centroids, a few thousand elements;
the ops it replaces were about twenty launches a table, each over the table.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _storage_check_kernel(x_ptr, s_ptr, bits_ptr, rms_ptr, ok_ptr, n, largest, REL: tl.constexpr, RMS: tl.constexpr,
                          BLOCK: tl.constexpr):
    limit = RMS * tl.load(rms_ptr)
    bad = tl.zeros((BLOCK,), tl.int32)
    for i in range(0, n, BLOCK):
        o = i + tl.arange(0, BLOCK)
        m = o < n
        x = tl.load(x_ptr + o, mask=m, other=0.0)
        s = tl.load(s_ptr + o, mask=m, other=0.0).to(tl.float32)
        ax = tl.abs(x)
        excess = tl.abs(s - x) + (-REL) * ax  # the relative part taken off, as torch.add(err, ax, alpha=-REL)
        fits = excess <= tl.where(ax <= largest, limit, -1.0)  # a NaN fails
        bad += tl.where(m & (fits == 0), 1, 0)
        word = tl.load(bits_ptr + o, mask=m, other=0)
        tl.store(bits_ptr + o, tl.where(s == 0.0, 0, word).to(word.dtype), mask=m)  # −0 -> +0
    tl.store(ok_ptr, tl.sum(bad, axis=0) == 0)


def storage_check(x: torch.Tensor, s: torch.Tensor, rms: torch.Tensor, largest: float, rel: float,
                  rms_tol: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x float32, s = x.to(dt) of x's shape in float8_e4m3fn or float16, rms 0-dim float32 (‖x‖ / √n), largest:
    dt's largest finite value, the tolerances rel and rms_tol (quantwm.core.quant's STORAGE_REL_TOL and
    STORAGE_RMS_TOL, powers of two) -> (s, its negative zeros made positive in place; 0-dim bool: every element
    fits)."""
    if x.dtype != torch.float32 or s.shape != x.shape or s.dtype not in (torch.float8_e4m3fn, torch.float16):
        raise ValueError(f"the storage check takes x float32 and its cast (same shape) in float8_e4m3fn or float16, "
                         f"got {x.dtype} {tuple(x.shape)} and {s.dtype} {tuple(s.shape)}")
    if rms.numel() != 1 or s.device != x.device or rms.device != x.device:
        raise ValueError("the storage check's rms is one value, and every tensor on x's device")
    if not s.is_contiguous():
        raise ValueError("the storage check writes its cast in place: it must be contiguous")
    if not x.numel():
        return s, torch.ones((), dtype=torch.bool, device=x.device)
    ok = torch.empty((), dtype=torch.bool, device=x.device)  # the kernel writes it
    words = s.view(torch.uint8 if s.element_size() == 1 else torch.int16)
    _storage_check_kernel[(1,)](x.contiguous(), s, words, rms.float().reshape(()).contiguous(), ok, x.numel(),
                                float(largest), REL=float(rel), RMS=float(rms_tol), BLOCK=BLOCK, num_warps=4)
    return s, ok
