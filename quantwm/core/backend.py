"""Which implementation runs: the Triton kernels of kernels/ (the CUDA fast path) or the PyTorch references.

    QUANTWM_KERNELS=auto    (default) kernels for CUDA tensors when Triton imports, references otherwise
    QUANTWM_KERNELS=ref     references everywhere: the switch for debugging a suspected kernel bug
    QUANTWM_KERNELS=triton  kernels everywhere, CPU included; on CPU set TRITON_INTERPRET=1 before the first
                            import of kernels/ (this is how the tests drive the kernels through the cache)
    QUANTWM_KERNELS=trust   as auto, without the kernels' first-use self-check (quantwm/core/selfcheck.py)

Triton is imported lazily, on first use, so `import quantwm` works on machines without it.
"""
from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from functools import cache

import torch

MODES = ("auto", "ref", "triton", "trust")


def mode() -> str:
    m = os.environ.get("QUANTWM_KERNELS", "auto").strip().lower() or "auto"
    if m not in MODES:
        raise ValueError(f"QUANTWM_KERNELS must be one of {', '.join(MODES)}, got {m!r}")
    return m


@cache
def _triton_available() -> bool:
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def use_kernels(t: torch.Tensor) -> bool:
    """Whether work on tensor `t` goes to a Triton kernel."""
    m = mode()
    if m == "ref":
        return False
    if m == "triton":
        return True
    return t.is_cuda and _triton_available()


def kernel(name: str) -> Callable:
    """The launcher `name` from kernels/<name>.py, installed as `quantwm.kernels.<name>` (imported on first use)."""
    return getattr(importlib.import_module(f"quantwm.kernels.{name}"), name)


def device_name() -> str:
    """The device the app and benchmarks report: the CUDA GPU's name, or the CPU."""
    if torch.cuda.is_available():
        return f"cuda:0 ({torch.cuda.get_device_name(0)})"
    return "cpu"

