"""What a commit costs a GPU, counted op by op and priced by a stated model (issue 42: "a commit path that costs
a few percent of a chunk").

    python benchmarks/commit_cost.py                          # every quantizing method, 2.5 bits, Wan-1.3B + LingBot
    python benchmarks/commit_cost.py --methods quantwm,kivi --preset wan-1.3b --where --json out/commit_cost.json
    python benchmarks/commit_cost.py --dry-run --methods kivi,quantwm    # CPU, tiny shapes: checks the script
    python benchmarks/commit_cost.py --methods quantwm-trellis --set trellis_kinds=v    # a method option (--set)

Per (preset, method) a one-layer `KVCache(CacheConfig(method, budget=B, selfcheck=False), 1)` (B=1; a chunk is
frames_per_chunk x tokens_per_frame tokens at the preset's heads x head dim, quantwm.evaluation.memory.PRESETS) is
fed chunks of seeded random BF16 q/k/v: a denoising pass (`attend`), then the commit (`commit`, what the clean pass's
`attend(commit=True)` adds). Counted per layer and chunk, for the first quantized span and for the 3 commits after it
(steady state: their mean and max): (a) the commit, (b) the warm attend of the next chunks (a denoising pass over a
cache that holds quantized spans, no commit).

Counted by benchmarks/op_count.py (its docstring has the rule): every ATen op, split into launching ops (a kernel
on the GPU; each Triton kernel launch counts as one), views (`func.is_view`) and metadata-only ops (empty,
empty_strided, _unsafe_view, size queries, ...: no kernel), and every host sync once: the dispatch level's
(_local_scalar_dense, nonzero, unique, masked_select, boolean indexing, host<->device copies, and the linear algebra
whose CUDA kernel checks its info on the host: `_linalg_check_errors`, visible after cholesky/inv/solve, hidden inside
`_linalg_eigh`/`_linalg_svd`, counted by name) folded with `quantwm.core.syncs.HostSyncs`' calls (.item(), .cpu(),
torch.tensor, ...). `--where` prints each sync's source (the innermost quantwm/ frame) and where the model's time goes.

Cost model (the constants below, printed in the header): a launching op costs the GPU
max(KERNEL_FLOOR_US, bytes / (HBM_BW x BW_EFFICIENCY), FLOPs / (rate x FLOP_UTILISATION)), with op_count's bytes
(its tensors' distinct elements, in and out) and FLOPs (2MNK for matmuls, elementwise = output numel, ...); rate:
BF16 tensor cores for bf16/fp16 matmuls, FP32 (FP64) otherwise. eigh and svd, which cuSOLVER runs matrix by matrix,
cost at least EIGH_US_PER_MATRIX per matrix. A commit's GPU time = sum over its kernels + syncs x SYNC_DRAIN_US.
Its host time = launching ops x HOST_US_PER_LAUNCH, hidden behind the GPU while the host runs ahead (a sync ends
that: the host then waits, which SYNC_DRAIN_US prices); both are printed, the share uses the GPU time.
The BF16 chunk: --passes forward passes (Self-Forcing: 4 denoising steps + the clean pass that writes the cache) of
the whole model over the chunk's tokens: 2·params·tokens (the blocks' linear weights) + 4·Nq·Nkv·D·H per layer, Nkv
= --window-frames latent frames (Self-Forcing's 21-frame cache), at CHUNK_UTILISATION of BF16 peak. Share of the
chunk = commit GPU time x layers / chunk time; the warm attend's syncs: syncs x drain x layers x passes / chunk.

Paths: on CUDA what a GPU runs. On the CPU the same dispatch decisions (QUANTWM_KERNELS=triton): each kernel
launch is counted once and its PyTorch twin (`<name>_ref`, exact for codes) computes its output, except the fused
attention's kernel, counted but not run (its twin reads layouts, not the kernel's arguments, and nothing counted
reads its output); the Triton interpreter would take minutes per launch at full shapes. `--reference` counts the
PyTorch reference path instead. On CUDA both are also timed with CUDA events (commit = attend+commit minus a plain
attend on the same chunk) on an otherwise idle stream, so the host's launch time shows where it exceeds the GPU's (an
upper bound of what the commit adds behind a model's queued work), beside a BF16 SDPA over the same cache length;
the syncs `torch.cuda.set_sync_debug_mode("warn")` reports are counted as a cross-check of the counter's.
Known limits: code that branches on the device is counted as the CPU runs it (the cache's NaN/Inf input check is
one host read per attend on the CPU; on an accelerator a device flag read with the next commit's checks), as are
host-to-device copies (op_count.py); the queries hold most of their energy in QUERY_DIMS directions per head
with a decaying spectrum, the same in every chunk (a model's are so; with iid queries S stays isotropic and every
span would store a new basis): a video whose queries move more stores new bases more often; the budget rule's
candidate table (core/budget.py measured_bits: CPU, once per process) is warmed before counting; the kernels' first-use self-check (once per
process) is off; Triton kernels' bytes are their tensor arguments'.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from op_count import LOOPED, Kernel, Tally, TritonLaunches, counting

# ---- the cost model (H200 SXM; every figure printed in the header) --------------------------------------------
HOST_US_PER_LAUNCH = 5.0   # eager PyTorch's host time per op (dispatcher + launch), the usual ~5 µs of a GPU op
KERNEL_FLOOR_US = 2.5      # the least a launched kernel occupies the GPU: launch latency and an almost empty grid
HBM_BW = 4.8e12            # B/s, H200 HBM3e (NVIDIA H200 datasheet)
BW_EFFICIENCY = 0.7        # share of HBM peak a streaming kernel reaches (small, strided ones reach less)
BF16_FLOPS = 989e12        # H200 dense BF16 tensor-core peak (datasheet; 1979 is with sparsity)
FP32_FLOPS = 67e12         # H200 FP32 peak (datasheet); fp32 matmuls too: PyTorch leaves TF32 off for matmuls
FP64_FLOPS = 34e12         # H200 FP64 vector peak (datasheet)
FLOP_UTILISATION = 0.5     # share of peak a commit's kernel reaches (small grids; a guess, the CUDA timing checks it)
EIGH_US_PER_MATRIX = 1800.0  # pytorch/pytorch#174674: torch.linalg.eigh on 500 matrices of 100x100, 914 ms on a GPU
SYNC_DRAIN_US = 20.0       # per host sync: the queue drains, the GPU idles until the host launches again
QUERY_DIMS = 16            # the chunks' queries: this many directions per head hold most of their energy
CHUNK_UTILISATION = 0.4    # the BF16 model's share of BF16 peak over a chunk (large GEMMs and flash attention)
COST_MODEL = {k: v for k, v in globals().items() if k.isupper() and isinstance(v, float)}

# ---- the BF16 model a chunk runs (the shapes the presets leave out) ---------------------------------------------
MODEL_DIMS = {  # preset -> (model dim, FFN dim): Wan 2.1 1.3B and 14B; LingBot-World is Wan-14B-class
    "wan-1.3b": (1536, 8960), "matrix-game-2": (1536, 8960), "wan-14b": (5120, 13824), "lingbot-world": (5120, 13824)}
DRY_SHAPES = (2, 64, 32, 3)  # --dry-run: heads, head dim, tokens per latent frame, frames per chunk (96-token chunks)
STEADY = 3  # commits after the first quantized span that make the steady state


def kernel_us(k: Kernel) -> float:
    """The cost model's GPU time of one launching op, µs."""
    if k.dtype == torch.float64:
        rate = FP64_FLOPS
    else:
        rate = BF16_FLOPS if k.matmul and k.dtype in (torch.bfloat16, torch.float16) else FP32_FLOPS
    return max(KERNEL_FLOOR_US, k.matrices * EIGH_US_PER_MATRIX, k.nbytes / (HBM_BW * BW_EFFICIENCY) * 1e6,
               k.flops / (rate * FLOP_UTILISATION) * 1e6)


def price(t: Tally) -> dict:
    """Every figure of a counted call, the cost model applied (ms per layer)."""
    us, lines, launches = Counter(), Counter(), Counter()
    for k in t.kernels:
        us[k.name] += kernel_us(k)
        lines[k.source] += kernel_us(k)
        launches[k.source] += 1
    n, kernels = len(t.syncs), sum(us.values())
    decompositions = sum(us[name] for name in LOOPED)
    return {"ops": t.ops, "launches": t.launches, "views": t.views, "metadata": t.metadata, "host_ops": t.host_ops,
            "triton": t.triton, "syncs": n, "bytes": t.bytes, "flops": t.flops, "kernel_ms": kernels / 1e3,
            "decomposition_ms": decompositions / 1e3, "drain_ms": n * SYNC_DRAIN_US / 1e3,
            "gpu_ms": (kernels + n * SYNC_DRAIN_US) / 1e3, "host_ms": t.launches * HOST_US_PER_LAUNCH / 1e3,
            "sync_calls": [list(s) for s in t.syncs], "top_ops": dict(t.by_op.most_common(12)),
            "top_ms": {name: v / 1e3 for name, v in us.most_common(12)},
            "top_lines": {line: [launches[line], v / 1e3] for line, v in lines.most_common(16)}}


# ---- the run ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shapes:
    """A preset's shapes as counted (B = 1): layers, heads, head dim, tokens per latent frame, frames per chunk."""

    preset: str
    layers: int
    heads: int
    head_dim: int
    tokens_per_frame: int
    chunk_frames: int

    @property
    def chunk(self) -> int:
        return self.tokens_per_frame * self.chunk_frames


def preset_shapes(preset: str, dry: bool) -> Shapes:
    from quantwm.evaluation.memory import PRESETS

    if preset not in PRESETS or preset not in MODEL_DIMS:
        raise ValueError(f"unknown preset {preset!r}; known presets: {', '.join(MODEL_DIMS)}")
    p = PRESETS[preset]
    H, D, T, F = DRY_SHAPES if dry else (p.heads, p.head_dim, p.tokens_per_frame, p.chunk_frames)
    return Shapes(preset, p.layers, H, D, T, F)


def chunk_model(s: Shapes, passes: int, window_frames: int) -> dict:
    """The BF16 model's FLOPs and estimated time for one chunk (module docstring)."""
    dim, ffn = MODEL_DIMS[s.preset]
    params = s.layers * (8 * dim * dim + 2 * dim * ffn)  # self- and cross-attention q,k,v,o; the FFN's two
    nq, nkv = s.chunk, window_frames * s.tokens_per_frame
    linear, attention = 2.0 * params * nq, 4.0 * nq * nkv * s.head_dim * s.heads * s.layers
    flops = passes * (linear + attention)
    return {"params": params, "tokens": nq, "kv_tokens": nkv, "passes": passes, "linear_flops": passes * linear,
            "attention_flops": passes * attention, "flops": flops, "ms": flops / (BF16_FLOPS * CHUNK_UTILISATION) * 1e3}


def chunk_inputs(i: int, s: Shapes, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Chunk i's q, k, v: (1, H, N, D) BF16, seeded by the chunk index."""
    g = torch.Generator(device="cpu").manual_seed(1000 + i)
    q, k, v = (torch.randn(1, s.heads, s.chunk, s.head_dim, generator=g) for _ in range(3))
    # queries as a model's: most of their energy in a QUERY_DIMS-dimensional subspace per head, the same in every
    # chunk (seeded once), so S settles and a stored basis holds as it does in a video (iid queries keep S
    # isotropic, its top directions arbitrary, and every span would store a new basis)
    basis = torch.linalg.qr(torch.randn(s.heads, s.head_dim, s.head_dim, generator=torch.Generator().manual_seed(7)))[0]
    spread = 3 * 0.85 ** torch.arange(QUERY_DIMS, dtype=torch.float32)  # a decaying spectrum: distinct directions
    coords = torch.randn(1, s.heads, s.chunk, QUERY_DIMS, generator=g) * spread
    q = 0.3 * q + coords @ basis[:, :, :QUERY_DIMS].transpose(1, 2)
    return tuple(t.to(device, torch.bfloat16) for t in (q, k, v))


def make_cache(method: str, s: Shapes, budget: float | None, target: str, check_inputs: bool, options: tuple = ()):
    """A one-layer cache (pre-RoPE methods get the 3-D RoPE they read keys through); `options`: --set's
    (key, value) pairs, every method's (CacheConfig.method_options)."""
    from math import isqrt

    from quantwm.core.cache import CacheConfig, KVCache
    from quantwm.core.methods import get_method
    from quantwm.core.rope import Rope3D

    config = dict(method=method, target=target, budget=budget, check_inputs=check_inputs, selfcheck=False,
                  method_options=options)
    if getattr(get_method(method), "pre_rope", False):
        T = s.tokens_per_frame
        h = max(d for d in range(1, isqrt(T) + 1) if T % d == 0)
        return KVCache(CacheConfig(**config, rope="pre"), 1, rope=Rope3D(s.head_dim, (h, T // h)))
    return KVCache(CacheConfig(**config), 1)


def _quantized(cache) -> int:
    return sum(v.quantized for v in cache.inspect(0))


class _SyncDebug:
    """On CUDA, the syncs torch.cuda.set_sync_debug_mode("warn") reports within the block (`.count`)."""

    def __init__(self, cuda: bool):
        self.cuda, self.count = cuda, 0

    def __enter__(self):
        if self.cuda:
            import warnings
            self._catch = warnings.catch_warnings(record=True)
            self._seen = self._catch.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")
            self.count = sum("synchroniz" in str(w.message) for w in self._seen)
            self._catch.__exit__(*exc)


def count_method(method: str, s: Shapes, a, device: torch.device, launches: TritonLaunches) -> dict:
    """Attend and commit chunks until the first quantized span and STEADY commits after it are counted; the
    denoising pass of each chunk after the first span is counted as a warm attend."""
    cuda = device.type == "cuda"
    cache = make_cache(method, s, a.budget or None, a.target, not a.no_check_inputs, a.options)
    commits, attends, first = [], [], None
    for i in range(3 + 2 * STEADY + 8):
        q, k, v = chunk_inputs(i, s, device)
        if first is None:
            cache.attend(0, q, k, v, chunk=i)
        else:
            with counting(launches, cuda) as tally, _SyncDebug(cuda) as debug:
                cache.attend(0, q, k, v, chunk=i)
            attends.append({**price(tally), "cuda_sync_debug": debug.count if cuda else None})
            if len(attends) == STEADY + 1:
                break
        held = _quantized(cache)
        with counting(launches, cuda) as tally, _SyncDebug(cuda) as debug:
            cache.commit(0, i)
        if first is None and _quantized(cache) > held:
            first = i
        if first is not None and len(commits) <= STEADY:
            commits.append({**price(tally), "cuda_sync_debug": debug.count if cuda else None})
    else:
        raise RuntimeError(f"{method}: no span was quantized, or too few after it, in {i + 1} chunks")
    return {"first_span_chunk": first, "configuration": cache.configuration, "bits_per_element": cache.bits_per_element(),
            "commit": _summary(commits), "attend": _summary(attends)}


def _summary(figs: list[dict]) -> dict:
    """The first span's figures, each steady chunk's, and their mean and max."""
    later = figs[1:]
    keys = [k for k, v in later[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return {"first": figs[0], "steady": later, "mean": {k: statistics.fmean(f[k] for f in later) for k in keys},
            "max": {k: max(f[k] for f in later) for k in keys}}


def _event_ms(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def time_method(method: str, s: Shapes, a, device: torch.device, first: int) -> dict:
    """CUDA: a fresh cache over the same chunks; per chunk from the first span on, attend+commit minus a plain
    attend (CUDA events), and a BF16 SDPA over the same cache length (median of 5)."""
    import torch.nn.functional as F

    cache = make_cache(method, s, a.budget or None, a.target, not a.no_check_inputs, a.options)
    commit, attend, sdpa = [], [], []
    for i in range(first + STEADY + 1):
        q, k, v = chunk_inputs(i, s, device)
        if i < first:
            cache.attend(0, q, k, v, chunk=i, commit=True)
            continue
        cache.attend(0, q, k, v, chunk=i)  # warm-up: the same pass once more
        plain = _event_ms(partial(cache.attend, 0, q, k, v, chunk=i))
        both = _event_ms(partial(cache.attend, 0, q, k, v, chunk=i, commit=True))
        commit.append(both - plain)
        attend.append(plain)
        K, V = (torch.randn(1, s.heads, cache.seq_len(0), s.head_dim, device=device, dtype=torch.bfloat16)
                for _ in range(2))
        reference = partial(F.scaled_dot_product_attention, q, K, V)
        reference()
        sdpa.append(statistics.median(_event_ms(reference) for _ in range(5)))
    return {"commit_ms": commit, "attend_ms": attend, "sdpa_bf16_ms": sdpa}


# ---- the report -------------------------------------------------------------------------------------------------
def estimate(row: dict, s: Shapes, chunk: dict) -> dict:
    """The cost model's commit time and shares of the chunk (module docstring)."""
    c, att = row["commit"], row["attend"]
    share = lambda ms: ms * s.layers / chunk["ms"]  # noqa: E731
    drain = lambda n: n * SYNC_DRAIN_US / 1e3 * s.layers * chunk["passes"] / chunk["ms"]  # noqa: E731
    return {"commit_gpu_ms": {"first": c["first"]["gpu_ms"], "steady": c["mean"]["gpu_ms"], "max": c["max"]["gpu_ms"]},
            "commit_host_ms": {"first": c["first"]["host_ms"], "steady": c["mean"]["host_ms"], "max": c["max"]["host_ms"]},
            "commit_share": {"first": share(c["first"]["gpu_ms"]), "steady": share(c["mean"]["gpu_ms"]),
                             "max": share(c["max"]["gpu_ms"])},
            "commit_host_share": {"steady": share(c["mean"]["host_ms"])},
            "attend_sync_share": {"first": drain(att["first"]["syncs"]), "steady": drain(att["mean"]["syncs"])}}


def _pair(first, steady, fmt="{:.0f}") -> str:
    return f"{fmt.format(first)}/{fmt.format(steady)}"


def table(rows: list[dict]) -> str:
    """One row per (preset, method): the commit's counts (first span / steady mean), its estimated GPU and host ms
    per layer and its share of the BF16 chunk; then the warm attend's counts and its syncs' share."""
    head = (f"{'preset':<14}{'method':<17}{'bits':>6}  {'ops':>11} {'launching':>11} {'views':>11} {'syncs':>7} "
            f"{'GPU ms/layer':>13} {'eigh/svd ms':>12} {'host ms':>11} {'share of chunk':>15}")
    lines = ["commit (first span / steady mean over 3 chunks), per layer and chunk:", head]
    for r in rows:
        c, e = r["commit"], r["estimate"]
        f, m = c["first"], c["mean"]
        lines.append(f"{r['preset']:<14}{r['method']:<17}{r['bits_per_element']:>6.3f}  "
                     f"{_pair(f['ops'], m['ops']):>11} {_pair(f['launches'], m['launches']):>11} "
                     f"{_pair(f['views'], m['views']):>11} {_pair(f['syncs'], m['syncs'], '{:.3g}'):>7} "
                     f"{_pair(e['commit_gpu_ms']['first'], e['commit_gpu_ms']['steady'], '{:.2f}'):>13} "
                     f"{_pair(f['decomposition_ms'], m['decomposition_ms'], '{:.1f}'):>12} "
                     f"{_pair(f['host_ms'], m['host_ms'], '{:.2f}'):>11} "
                     f"{_pair(100 * e['commit_share']['first'], 100 * e['commit_share']['steady'], '{:.2f}%'):>15}")
    lines += ["", "warm attend (a denoising pass over the cache; first after the first span / steady mean), per layer:",
              f"{'preset':<14}{'method':<17}{'':>6}  {'ops':>11} {'launching':>11} {'views':>11} {'syncs':>7} "
              f"{'syncs share of chunk':>21}"]
    for r in rows:
        f, m, e = r["attend"]["first"], r["attend"]["mean"], r["estimate"]
        lines.append(f"{r['preset']:<14}{r['method']:<17}{'':>6}  {_pair(f['ops'], m['ops']):>11} "
                     f"{_pair(f['launches'], m['launches']):>11} {_pair(f['views'], m['views']):>11} "
                     f"{_pair(f['syncs'], m['syncs'], '{:.3g}'):>7} "
                     f"{_pair(100 * e['attend_sync_share']['first'], 100 * e['attend_sync_share']['steady'], '{:.2f}%'):>21}")
    timed = [r for r in rows if r.get("measured")]
    if timed:
        lines += ["", "measured on CUDA (events), ms per layer: commit first/steady mean (estimated), plain attend, "
                  "BF16 SDPA at the same cache length, syncs set_sync_debug_mode saw (commit/attend, steady mean):"]
        for r in timed:
            t, e = r["measured"], r["estimate"]["commit_gpu_ms"]
            dbg = (r["commit"]["mean"].get("cuda_sync_debug"), r["attend"]["mean"].get("cuda_sync_debug"))
            lines.append(f"{r['preset']:<14}{r['method']:<17} commit {t['commit_ms'][0]:.2f}/"
                         f"{statistics.fmean(t['commit_ms'][1:]):.2f} ({e['first']:.2f}/{e['steady']:.2f})  attend "
                         f"{statistics.fmean(t['attend_ms'][1:]):.2f}  bf16 sdpa {statistics.fmean(t['sdpa_bf16_ms'][1:]):.2f}"
                         f"  syncs {dbg[0]:.3g}/{dbg[1]:.3g}  measured share {100 * t['commit_share']:.2f}%")
    return "\n".join(lines)


def where(rows: list[dict]) -> str:
    """Every counted sync by source, per (preset, method) and phase (steady: summed over the 3 chunks)."""
    lines = []
    for r in rows:
        lines.append(f"{r['preset']} {r['method']}: k {r['configuration']['k']}; v {r['configuration']['v']}")
        for phase in ("commit", "attend"):
            for part, figs in (("first", [r[phase]["first"]]), ("steady x3", r[phase]["steady"])):
                seen = Counter(tuple(x) for f in figs for x in f["sync_calls"])
                body = "; ".join(f"{n}x {name} at {w}" for (name, w), n in seen.most_common()) or "none"
                lines.append(f"  {phase} {part}: {body}")
        ms = r["commit"]["mean"]["gpu_ms"]
        top = Counter()
        for f in r["commit"]["steady"]:
            top.update({n: t / len(r["commit"]["steady"]) for n, t in f["top_ms"].items()})
        lines.append(f"  commit steady, the model's {ms:.2f} ms: " + ", ".join(
            f"{n} {t:.2f}" for n, t in top.most_common(8)) + f", syncs {r['commit']['mean']['drain_ms']:.2f}")
        last = r["commit"]["steady"][-1].get("top_lines", {})  # the last steady commit, by the line that launched
        lines.append("  by source line (last steady commit: launching ops, ms): " + "; ".join(
            f"{line} {n}x {t:.3f}" for line, (n, t) in list(last.items())[:12]))
    return "\n".join(lines)


def header(device: str, path: str, a, chunks: dict) -> str:
    budget = a.budget or "None (each method's fixed bits)"
    lines = [f"commit cost on {device}, torch {torch.__version__}; path: {path}",
             f"cache: CacheConfig(method, budget={budget}, target={a.target}, "
             f"check_inputs={not a.no_check_inputs}, selfcheck=False"
             + "".join(f", {k}={v!r}" for k, v in a.options) + "), B=1, bf16 random q/k/v",
             "cost model: " + ", ".join(f"{k}={v:g}" for k, v in COST_MODEL.items())]
    for name, c in chunks.items():
        lines.append(f"BF16 chunk {name}: {c['params'] / 1e9:.2f}B block params, {c['tokens']} tokens, "
                     f"Nkv={c['kv_tokens']} ({a.window_frames} latent frames), {c['passes']} passes: "
                     f"{c['flops'] / 1e12:.1f} TFLOP -> {c['ms']:.1f} ms at {CHUNK_UTILISATION:.0%} of BF16 peak")
    return "\n".join(lines)


def resolve_methods(text: str | None) -> list[str]:
    from quantwm.core.methods import method_sources, parse_method_name

    names = [m.strip() for m in text.split(",") if m.strip()] if text else \
        [n for n, _, _ in method_sources() if n != "bf16"]
    if not names:
        raise ValueError("--methods is empty")
    for m in names:
        parse_method_name(m)  # unknown: ValueError naming the known ones
    return names


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", help="comma-separated (default: every method `python -m quantwm methods` lists but bf16)")
    ap.add_argument("--budget", type=float, default=2.5, help="bits per element (0: each method's fixed bits)")
    ap.add_argument("--target", default="kv", choices=("k", "v", "kv"))
    ap.add_argument("--preset", default="wan-1.3b,lingbot-world", help=f"comma-separated, of {', '.join(MODEL_DIMS)}")
    ap.add_argument("--passes", type=int, default=5, help="forward passes per chunk (Self-Forcing: 4 steps + clean)")
    ap.add_argument("--window-frames", type=int, default=21, help="latent frames attended (Self-Forcing: 21)")
    ap.add_argument("--no-check-inputs", action="store_true", help="CacheConfig(check_inputs=False)")
    ap.add_argument("--set", action="append", metavar="KEY=VALUE", default=[],
                    help="a method option for every method counted, as quantwm's --set (repeatable)")
    ap.add_argument("--reference", action="store_true", help="count the PyTorch reference path, not the kernels")
    ap.add_argument("--where", action="store_true", help="print every sync's source and each configuration")
    ap.add_argument("--json", metavar="OUT", help="write every figure here")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes (2 heads x 64, 96-token chunks)")
    return ap.parse_args(argv)


def kernel_path(cuda: bool, reference: bool) -> tuple[str, bool]:
    """Set how this process runs the kernels (before they are imported); (its description, whether the kernels'
    PyTorch twins stand in for them)."""
    import importlib.util

    if reference:
        os.environ["QUANTWM_KERNELS"] = "ref"
        return "the PyTorch reference path (--reference)", False
    if cuda:
        return "what this GPU runs (QUANTWM_KERNELS=" + os.environ.get("QUANTWM_KERNELS", "auto") + ")", False
    if importlib.util.find_spec("triton") is None:
        os.environ["QUANTWM_KERNELS"] = "ref"
        return "the PyTorch reference path (no Triton here)", False
    os.environ.setdefault("TRITON_INTERPRET", "1")  # kernels/ imports without a GPU; nothing runs in it
    os.environ["QUANTWM_KERNELS"] = "triton"
    return ("the kernels' path, each launch counted once and run by its PyTorch twin (span_attention counted, "
            "not run)"), True


class _kernels:
    """QUANTWM_KERNELS set to `mode` within the block (quantwm.core.backend reads it at every call)."""

    def __init__(self, mode: str):
        self.mode, self.saved = mode, None

    def __enter__(self):
        self.saved = os.environ.get("QUANTWM_KERNELS")
        os.environ["QUANTWM_KERNELS"] = self.mode

    def __exit__(self, *exc):
        if self.saved is None:
            os.environ.pop("QUANTWM_KERNELS", None)
        else:
            os.environ["QUANTWM_KERNELS"] = self.saved


def main(argv=None) -> int:
    a = parse(argv)
    try:
        methods = resolve_methods(a.methods)
        from quantwm.cli_values import set_options

        a.options = set_options(a.set)
        shapes = [preset_shapes(p.strip(), a.dry_run) for p in a.preset.split(",") if p.strip()]
        if not shapes or a.passes < 1 or a.window_frames < 1 or a.budget < 0:
            raise ValueError("need a preset, --passes >= 1, --window-frames >= 1 and --budget >= 0")
    except ValueError as e:
        print(f"commit_cost: {e}", file=sys.stderr)
        return 2
    from quantwm.core.budget import fit_methods

    cuda = torch.cuda.is_available() and not a.dry_run
    device = torch.device("cuda" if cuda else "cpu")
    path, twins = kernel_path(cuda, a.reference)
    chunks = {s.preset: chunk_model(s, a.passes, a.window_frames) for s in shapes}
    name = torch.cuda.get_device_name(0) if cuda else "cpu" + (" (dry run: tiny shapes)" if a.dry_run else "")
    print(header(name, path, a, chunks), flush=True)
    rows, left_out, t0 = [], {}, time.perf_counter()
    with TritonLaunches(twins) as launches:
        for s in shapes:
            budget = a.budget or None
            with _kernels("ref"):  # the budget rule's table: once per process, on the host (and warmed here)
                try:
                    fits, out = fit_methods(methods, budget, budget, s.head_dim, s.chunk, a.target, dict(a.options))
                except ValueError as e:  # an option a method does not take (--set): the request's error
                    print(f"commit_cost: {e}", file=sys.stderr)
                    return 2
            out.update({m: "bf16 quantizes nothing: no commit cost" for m in fits if m == "bf16"})
            left_out[s.preset] = out
            for m in out:
                print(f"left out at {s.preset}: {m}: {out[m]}", flush=True)
            for m in (m for m in fits if m not in out):
                t = time.perf_counter()
                try:
                    row = {"preset": s.preset, "method": m, "shapes": s.__dict__, **count_method(m, s, a, device, launches)}
                except ValueError as e:  # a cache this configuration cannot build
                    left_out[s.preset][m] = str(e)
                    print(f"left out at {s.preset}: {m}: {e}", flush=True)
                    continue
                row["estimate"] = estimate(row, s, chunks[s.preset])
                if cuda:
                    row["measured"] = time_method(m, s, a, device, row["first_span_chunk"])
                    row["measured"]["commit_share"] = statistics.fmean(row["measured"]["commit_ms"][1:]) * s.layers \
                        / chunks[s.preset]["ms"]
                row["seconds"] = round(time.perf_counter() - t, 1)
                rows.append(row)
                print(f"  {s.preset} {m}: counted in {row['seconds']:.0f} s", flush=True)
    print()
    print(table(rows))
    if a.where:
        print()
        print(where(rows))
    print(f"\n{len(rows)} rows in {time.perf_counter() - t0:.0f} s")
    if a.json:
        report = {"device": name, "torch": torch.__version__, "path": path, "args": vars(a), "cost_model": COST_MODEL,
                  "chunk": chunks, "left_out": left_out, "rows": rows}
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(report, indent=1, default=str))
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
