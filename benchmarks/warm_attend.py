"""An attend over a warm cache waits on nothing and builds nothing: the sync-free claim, checked on a device.

    python benchmarks/warm_attend.py                 # CUDA: Wan-1.3B heads (12 x 128), 6 chunks of 1560 tokens
    python benchmarks/warm_attend.py --dry-run       # CPU: tiny shapes, kernels under the Triton interpreter

A `quantwm` cache at a 2.5-bit budget (the default configuration on CUDA) is filled with committed chunks, then a chunk's
denoising passes attend over it:

1. on CUDA under `torch.cuda.set_sync_debug_mode("error")` (any host-device sync raises), and on any device
   counted by `quantwm.core.backend.HostSyncs`; no kernel view may be built (`layouts.views_built`);
2. on CUDA, captured in a CUDA graph and replayed: the replay must equal an eager attend on the same inputs;
   the eager and replayed times per attend are printed. The graph holds the attend with `observe=False`: the
   running S is updated outside it (`cache.observe`), since its weight n / (count + n) is a Python number that a
   replay would repeat unchanged.

Prints one line per check and exits 1 if one fails. `--method` and `--budget` choose another cache.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

if "--dry-run" in sys.argv:  # the interpreter must be set before the kernels are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("QUANTWM_KERNELS", "triton")

import torch  # noqa: E402

from quantwm.core.cache import CacheConfig, KVCache  # noqa: E402
from quantwm.core.layouts import views_built  # noqa: E402
from quantwm.core.syncs import HostSyncs  # noqa: E402


def warm_cache(method: str, budget: float | None, H: int, D: int, N: int, chunks: int, device) -> KVCache:
    # the default configuration on CUDA (its NaN/Inf check a device flag read at commit); on the CPU that check is
    # read at once (free there), so the dry run turns it off to count the same
    cache = KVCache(CacheConfig(method, budget=budget, check_inputs=device.type != "cpu"), 1)
    g = torch.Generator(device="cpu").manual_seed(0)
    for i in range(chunks):
        q, k, v = (torch.randn(1, H, N, D, generator=g).to(device, torch.bfloat16) for _ in range(3))
        cache.attend(0, q, k, v, chunk=i, commit=True)
    return cache


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, the Triton interpreter")
    ap.add_argument("--method", default="quantwm")
    ap.add_argument("--budget", type=float, default=2.5, help="bits per element (0: the method's fixed format)")
    ap.add_argument("--passes", type=int, default=20)
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.dry_run
    if not cuda and not a.dry_run:
        print("no CUDA device: run with --dry-run for the CPU check")
        return 1
    device = torch.device("cuda" if cuda else "cpu")
    H, D, N, chunks = (12, 128, 1560, 6) if cuda else (1, 32, 32, 4)  # the dry run: one small head (interpreted kernels)
    cache = warm_cache(a.method, a.budget or None, H, D, N, chunks, device)
    g = torch.Generator(device="cpu").manual_seed(1)
    q, k, v = (torch.randn(1, H, N, D, generator=g).to(device, torch.bfloat16) for _ in range(3))
    passes = a.passes if cuda else 3
    print(f"warm attend: {a.method} at {a.budget or 'its fixed format'} bits, {H} heads x {D}, {chunks} chunks of {N} "
          f"tokens, {cache.configuration['k']}")
    failed = 0
    built = views_built()
    if cuda:
        torch.cuda.set_sync_debug_mode("error")
    try:
        with HostSyncs() as syncs:
            for _ in range(passes):
                cache.attend(0, q, k, v, chunk=chunks)
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    ok = not syncs.calls and views_built() == built
    failed += not ok
    print(f"{'ok' if ok else 'FAILED':6s} {passes} attends: {len(syncs.calls)} host syncs {sorted(set(syncs.calls))}, "
          f"{views_built() - built} kernel views built")
    if not cuda:
        print("skip   CUDA graph capture: no CUDA device (dry run)")
        return 1 if failed else 0
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(passes):
        eager = cache.attend(0, q, k, v, chunk=chunks)
    torch.cuda.synchronize()
    eager_ms = (time.perf_counter() - t) / passes * 1e3
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graphs asks
        cache.attend(0, q, k, v, chunk=chunks, observe=False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cache.attend(0, q, k, v, chunk=chunks, observe=False)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(passes):
        graph.replay()
        cache.observe(0, q)  # S outside the graph
    torch.cuda.synchronize()
    graph_ms = (time.perf_counter() - t) / passes * 1e3
    same = torch.allclose(out.float(), eager.float(), rtol=0, atol=1e-3)
    failed += not same
    print(f"{'ok' if same else 'FAILED':6s} CUDA graph: captured and replayed, max |replay - eager| "
          f"{(out.float() - eager.float()).abs().max().item():.2e}; {eager_ms:.2f} ms eager, {graph_ms:.2f} ms replayed "
          "per attend")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
