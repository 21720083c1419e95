"""Counting host-device syncs on any device: the check behind the cache's sync-free attend.

On CUDA, `torch.cuda.set_sync_debug_mode("error")` raises at a sync; on the CPU nothing waits, so the calls that
would wait are counted instead. `HostSyncs` is a torch function mode:

    with HostSyncs() as syncs:
        cache.attend(0, q, k, v, chunk=5)
    assert syncs.calls == []

It sees what goes through torch's Python API: values read on the host (.item(), .tolist(), bool/int/float/format
of a tensor, .cpu(), .numpy(), comparisons that return a Python bool such as torch.equal), shapes that depend on
values (nonzero, unique, masked_select, boolean-mask indexing, single-argument where, repeat_interleave with tensor
repeats) and host data copied to the device (torch.tensor). It cannot see a sync inside a C++ or Triton call:
benchmarks/warm_attend.py runs the CUDA check on a GPU.
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

HOST_READS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__format__", "cpu", "numpy",
                        "equal", "allclose", "is_nonzero", "_local_scalar_dense"})
VALUE_SHAPED = frozenset({"nonzero", "unique", "unique_consecutive", "masked_select", "argwhere", "nonzero_static"})
HOST_TO_DEVICE = frozenset({"tensor", "as_tensor"})


def _is_sync(name: str, args: tuple, kwargs: dict) -> bool:
    if name in HOST_READS or name in VALUE_SHAPED or name in HOST_TO_DEVICE:
        return True
    if name == "to":
        return "cpu" in map(str, (*args[1:], *kwargs.values()))
    if name == "where":
        return len(args) + len(kwargs) == 1
    if name == "repeat_interleave":
        return any(isinstance(a, torch.Tensor) for a in (*args[1:], *kwargs.values()))
    if name == "__getitem__":
        index = args[1] if len(args) > 1 else None
        parts = index if isinstance(index, tuple) else (index,)
        return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)
    return False


class HostSyncs(TorchFunctionMode):
    """Within `with HostSyncs() as h:`, h.calls lists the name of every call that would make the host wait on a
    CUDA device (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if _is_sync(name, args, kwargs):
            self.calls.append(name)
        return func(*args, **kwargs)
