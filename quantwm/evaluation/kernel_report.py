"""`quantwm selfcheck`: what runs on this machine, whether it is right, and how fast, in one report.

    python -m quantwm selfcheck                      # the built-in shapes of --model (default wan-1.3b on a GPU)
    python -m quantwm selfcheck --model wan-14b --json report.json
    python -m quantwm selfcheck --heads 24 --head-dim 128 --chunk-tokens 3120 --lengths 8192,32768

It prints the device, the torch and Triton versions, and then:

1. **paths**: which path each method's spans take (`fused kernel`, or `reference` and why), from a one-layer
   cache of three committed chunks (at most 4 heads and 256 tokens a chunk) read by a fourth;
2. **self-check**: every kernel's first-use check against its PyTorch reference (quantwm/core/selfcheck.py), one
   line per (kernel, layout, dtype, device, shape class) with both errors; a FAILED line means that kernel is not
   used here, and the command exits 1 naming it (quantwm/cli.py);
3. **timing** (quantwm/evaluation/kernel_timing.py): fused 2-bit and 8-bit attention against BF16 SDPA (flash
   where available) at each cache length, and the quantize cost per chunk.

On a CPU it says so: the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set by the command before
anything imports them) at tiny shapes, which checks what they compute, not how fast they are.
"""
from __future__ import annotations

import importlib
import os

import torch

from ..core import selfcheck
from ..core.attention import chunk_spans
from ..core.backend import device_name
from ..core.cache import CacheConfig, KVCache
from .kernel_timing import PRESETS as TIMING
from .kernel_timing import print_rows, time_paths
from .memory import PRESETS as MODELS

PATH_METHODS = ("bf16", "rtn", "kivi", "qvg", "qvg-pro", "quantwm", "quantwm+jensen", "quantwm@2.5", "quantwm-paper",
                "nvfp4", "int8k-fp8v")


def shapes(model: str | None, heads: int | None, head_dim: int | None, chunk_tokens: int | None,
           lengths: list[int] | None, cuda: bool) -> dict:
    """The timing shapes: a model of `memory.PRESETS` (its heads, head dim and chunk of tokens), or the tiny preset
    on a CPU, with any explicit value winning."""
    if model is not None and model not in MODELS:
        raise ValueError(f"unknown model {model!r}; known: {', '.join(MODELS)}")
    name = model or ("wan-1.3b" if cuda else "tiny")
    m = MODELS[name]
    base = dict(TIMING["wan-1.3b" if name != "tiny" else "tiny"])
    if name != "tiny":
        base.update(heads=m.heads, head_dim=m.head_dim, chunk=m.tokens_per_frame * m.chunk_frames,
                    lengths=(8192, 32768))
    if not cuda and name != "tiny":  # the interpreter cannot run Wan's shapes in any reasonable time
        base = dict(TIMING["tiny"])
        name = f"tiny (asked for {name}: no CUDA device)"
    for key, value in (("heads", heads), ("head_dim", head_dim), ("chunk", chunk_tokens), ("lengths", lengths)):
        if value is not None:
            base[key] = tuple(value) if key == "lengths" else value
    return {"name": name, **base}


def span_paths(heads: int, head_dim: int, chunk: int, device) -> dict[str, str]:
    """Per method, the path its spans take: "fused kernel" or "reference (...)"."""
    out = {}
    for spec in PATH_METHODS:
        method, _, budget = spec.partition("@")
        try:
            cache = KVCache(CacheConfig(method, budget=float(budget) if budget else None, track_queries=True), 1)
            g = torch.Generator().manual_seed(0)
            for i in range(4):  # the fourth chunk's attend reads the quantized span (and runs its self-check)
                q, k, v = (torch.randn(1, heads, chunk, head_dim, generator=g).to(device, torch.bfloat16)
                           for _ in range(3))
                cache.attend(0, q, k, v, chunk=i, commit=i < 3)
            fused = chunk_spans(cache, 0) is not None
            out[spec] = "fused kernel" if fused else "reference (no kernel reads its stored format)"
        except ValueError as e:
            out[spec] = f"not run: {e}"
    return out


def report(model: str | None = None, heads: int | None = None, head_dim: int | None = None,
           chunk_tokens: int | None = None, lengths: list[int] | None = None, method: str = "quantwm",
           budget: float | None = None) -> dict:
    """Print the report (see the module docstring) and return it as a dict."""
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ["QUANTWM_KERNELS"] = "triton"
    try:
        triton = importlib.import_module("triton").__version__
    except ImportError:
        triton = "not installed: the PyTorch references run everywhere"
    shape = shapes(model, heads, head_dim, chunk_tokens, lengths, cuda)
    print(f"device: {device_name()}  torch {torch.__version__}  triton {triton}")
    if not cuda:
        print("no CUDA device: the kernels run under the Triton interpreter at tiny shapes (a check of what they "
              "compute; the times below say nothing about speed)")
    print(f"shapes: {shape['name']}: {shape['heads']} heads x {shape['head_dim']}, chunks of {shape['chunk']} tokens",
          flush=True)
    device = torch.device("cuda" if cuda else "cpu")
    paths = span_paths(min(shape["heads"], 4), shape["head_dim"], min(shape["chunk"], 256), device)
    print("\npaths (a one-layer cache of three committed chunks, read by a fourth):")
    for spec, path in paths.items():
        print(f"  {spec:<16} {path}")
    rows = time_paths(shape, method, reps=shape["reps"], budget=budget)
    print("\nself-check (each kernel against its PyTorch reference on first use):")
    for v in selfcheck.verdicts():
        print(f"  {v.line()}")
    print(f"\ntiming ({method}{'' if budget is None else f' at {budget:g} bits'}):")
    print_rows(rows)
    failed = selfcheck.fallbacks()
    print(f"\n{len(selfcheck.verdicts())} kernel checks, {len(failed)} failed"
          + (": those kernels run their PyTorch reference in this process" if failed else ""))
    return {"device": device_name(), "torch": torch.__version__, "triton": triton, "shapes": shape, "paths": paths,
            "selfcheck": [v.__dict__ for v in selfcheck.verdicts()], "rows": rows, "method": method, "budget": budget}
