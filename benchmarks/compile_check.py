"""Compile every Triton kernel for real GPUs on a machine without one: Triton's own compiler down to PTX and
ptxas's cubin, for Hopper (sm_90: H100/H200) and Ampere (sm_80: A100), with each kernel's registers, spills and
shared memory. The interpreter (how the tests run the kernels on a CPU) checks what a kernel computes; this
checks that a GPU would accept it, which the interpreter does not.

    python benchmarks/compile_check.py                      # every kernel and variant, sm_90 and sm_80
    python benchmarks/compile_check.py --targets 90 --only span_attention,kmeans --json out.json

Each launcher runs on CPU tensors with the shapes of Wan-1.3B's attention (12 heads x 128, spans of 4680 tokens
cut to 256 here: sizes are runtime arguments) and the launch is captured instead of run, so the compiled
signature is exactly the one the launcher would send for that GPU (`span_attention.capability` answers with the
target's compute capability: on sm_80 the launcher widens stored fp8 scales to fp16, and refuses `lowp`, whose
e4m3 products need sm_89 or newer, with its error message). Exit code 1 when a compile fails.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.pop("TRITON_INTERPRET", None)  # real JIT functions (before kernels/ is imported)
os.environ.pop("QUANTWM_KERNELS", None)  # the caches built for span_attention's inputs code on the CPU's reference path
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.uint8: "u8", torch.int8: "i8",
         torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv", torch.bool: "i1"}


class Captured(Exception):
    """Raised by a captured launch: carries the kernel and its arguments."""

    def __init__(self, fn, args, kwargs):
        super().__init__(fn.__name__)
        self.fn, self.args, self.kwargs = fn, args, kwargs


class Capture:
    """Stands in for a module's JIT kernel: `kernel[grid](...)` raises Captured instead of launching."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise Captured(self.fn, args, kwargs)
        return launch


def capture(module, name: str, launcher, *args, **kwargs) -> Captured:
    """The launch that `launcher(*args, **kwargs)` would make of `module.name`."""
    real = getattr(module, name)
    setattr(module, name, Capture(real))
    try:
        launcher(*args, **kwargs)
    except Captured as c:
        return c
    finally:
        setattr(module, name, real)
    raise RuntimeError(f"{launcher.__name__} returned without launching {name}")


def signature(c: Captured) -> tuple[dict, dict]:
    """Triton's (signature, constexprs) of a captured launch."""
    params = c.fn.params
    values = dict(zip([p.name for p in params], c.args))
    values.update(c.kwargs)
    sig, cx = {}, {}
    for p in params:
        v = values[p.name]
        if p.is_constexpr:
            sig[p.name], cx[p.name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + TYPES[v.dtype]
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            sig[p.name] = "i32" if -2 ** 31 <= v < 2 ** 31 else "i64"
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        else:
            raise TypeError(f"{p.name}: cannot type {type(v).__name__}")
    return sig, cx


def resources(cubin: bytes) -> dict:
    """Registers, spill stores and shared memory of a cubin, from cuobjdump (Triton ships it)."""
    tool = shutil.which("cuobjdump") or str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    found = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", out))
    return {k.lower(): int(v) for k, v in found.items()}


def variants(only: str | None, cc: int) -> list[tuple[str, Captured | ValueError]]:
    """(name, captured launch, or the launcher's refusal) of every kernel at representative shapes, as the
    launchers would send them to a GPU of compute capability `cc` (e.g. 90)."""
    from quantwm.kernels import (
        allocate_levels,
        channel_errors,
        key_covariance_sums,
        key_rotate,
        kmeans_assign,
        pack_bits,
        pack_channels,
        qsac_assign,
        quantize_pack,
        span_attention,
        storage_check,
        trellis_choice,
        trellis_viterbi,
        unpack_bits,
        unshrink_channels,
    )

    from quantwm.core.allocate import LEVELS, _tables, level_costs
    from quantwm.core.attention import chunk_spans, new_state
    from quantwm.core.cache import CacheConfig, KVCache
    from quantwm.core.layouts.channels import channel_bytes, channel_offsets

    span_attention.capability = lambda t: divmod(cc, 10)
    g = torch.Generator().manual_seed(0)
    H, N, D, Nq = 12, 256, 128, 64
    out = []
    for bits in (2, 4, 8):
        codes = torch.randint(0, 2 ** bits, (H * N, D), generator=g, dtype=torch.uint8)
        out.append((f"pack_bits bits={bits}", capture(pack_bits, "_pack_bits_kernel", pack_bits.pack_bits, codes, bits)))
        packed = torch.zeros(H * N, D * bits // 8, dtype=torch.uint8)
        out.append((f"unpack_bits bits={bits}",
                    capture(unpack_bits, "_unpack_bits_kernel", unpack_bits.unpack_bits, packed, bits, D)))
    x = torch.randn(H, N, D, generator=g)
    for axis, group in (("channel", 64), ("token", 64)):
        shape = (H, N, D // group) if axis == "channel" else (H, N // group, D)
        sc, zero = torch.rand(*shape, generator=g).half() + 0.1, torch.zeros(*shape).half()
        out.append((f"quantize_pack {axis} groups", capture(quantize_pack, "_quantize_pack_kernel",
                                                            quantize_pack.quantize_pack, x, sc, zero, 2, group, axis)))
    keys = x.bfloat16()  # the Keys in the Queries' basis, and their covariance (the allocator's, BF16 dots)
    out.append(("key_rotate", capture(key_rotate, "_key_rotate_kernel", key_rotate.key_rotate, keys,
                                      torch.linalg.qr(torch.randn(H, D, D, generator=g)).Q)))
    for keep in (None, torch.rand(N, generator=g) > 0.1):
        out.append(("key_covariance_sums" + " kept" * (keep is not None),
                    capture(key_covariance_sums, "_key_covariance_kernel", key_covariance_sums.key_covariance_sums, keys,
                            keep)))
    row = x.mean(1, keepdim=True)  # a stored table checked as it is cast (fp8 and fp16)
    rms = torch.linalg.vector_norm(row) * row.numel() ** -0.5
    for dt in (torch.float8_e4m3fn, torch.float16):
        out.append((f"storage_check {str(dt)[6:]}", capture(storage_check, "_storage_check_kernel",
                                                            storage_check.storage_check, row, row.to(dt), rms,
                                                            torch.finfo(dt).max, 2.0 ** -3, 2.0 ** -4)))
    widths = torch.randint(0, 9, (H, D), generator=g)  # QuantWM's allocator format: a width of 0-8 bits a channel
    lo, hi = x.amin(1), x.amax(1)
    pack_args = (x, lo, hi, torch.ones(H, D), widths, channel_offsets(widths, N), int(channel_bytes(N, widths).sum()))
    out.append(("pack_channels", capture(pack_channels, "_pack_channels_kernel", pack_channels.pack_channels,
                                         *pack_args)))
    out.append(("pack_channels sums", capture(pack_channels, "_pack_channels_kernel", pack_channels.pack_channels,
                                              *pack_args, sums=True)))  # quantwm's Values (unbias): the sums too
    sums = torch.randn(4, H * D, -(-N // pack_channels.BLOCK_B), generator=g)
    out.append(("unshrink_channels", capture(unshrink_channels, "_unshrink_channels_kernel",
                                             unshrink_channels.unshrink_channels, sums, widths, lo.half(),
                                             (hi - lo).half() / 3, N, 0.5)))
    qmax, clips = _tables(LEVELS)
    out.append(("channel_errors", capture(channel_errors, "_channel_errors_kernel", channel_errors.channel_errors, x, lo,
                                          hi, qmax, clips, 1.0)))
    out.append(("allocate_levels", capture(allocate_levels, "_allocate_levels_kernel", allocate_levels.allocate_levels,
                                           torch.rand(H, D, len(LEVELS), generator=g), level_costs(N),
                                           torch.full((H,), 2.5 * N * D))))
    from quantwm.core.trellis import tables
    search = (x, widths.flatten(), tables(), torch.zeros(H * D, dtype=torch.long))
    norm = {"mean": x.mean(1).flatten(), "scale": x.std(1).flatten()}  # the span read in place, normalised on load
    out.append(("trellis_viterbi", capture(trellis_viterbi, "_viterbi_kernel", trellis_viterbi.trellis_viterbi,
                                           *search)))  # tail-biting: the wider variant
    out.append(("trellis_viterbi states", capture(trellis_viterbi, "_viterbi_kernel", trellis_viterbi.trellis_viterbi,
                                                  *search, states=True, **norm)))  # what quantwm-trellis's commit runs
    out.append(("trellis_viterbi window", capture(trellis_viterbi, "_viterbi_kernel", trellis_viterbi.trellis_viterbi,
                                                  *search[:3], states=True, **norm)))  # the tail-biting start's search
    states = torch.randint(0, 256, (H, D, N), generator=g, dtype=torch.uint8)  # then its choice and packing
    choice = (x, states, tables(), lo, hi, torch.ones(H, D), widths, x.mean(1), x.std(1))
    for unbias in (False, True):
        out.append(("trellis_choice" + " unbias" * unbias, capture(trellis_choice, "_trellis_choice_kernel",
                                                                    trellis_choice.trellis_choice, *choice, unbias, 0.5)))
    out.append(("pack_channels states", capture(pack_channels, "_pack_channels_kernel", pack_channels.pack_channels,
                                                *pack_args, states=states, grid=widths % 2 == 0)))
    c = torch.randn(H, 64, D, generator=g)
    out.append(("kmeans_assign", capture(kmeans_assign, "_kmeans_assign_kernel", kmeans_assign.kmeans_assign, x, c)))
    w = torch.rand(H, D, generator=g)
    out.append(("qsac_assign", capture(qsac_assign, "_qsac_assign_kernel", qsac_assign.qsac_assign, x, c, w, 64, 2,
                                       16.0)))
    def attention(name, q, k, v, jensen, lowp, splits):
        """The span_attention launch for these layouts, or the launcher's refusal for this GPU."""
        acc, m, l = new_state(H, splits, q.shape[1], D, "cpu")
        try:
            launch = capture(span_attention, "_span_attention_kernel", span_attention.span_attention, q, acc, m, l,
                             k.kernel_side, v.kernel_side, D ** -0.5, psac=k.psac_args(q), jensen=jensen, lowp=lowp,
                             center=k.center if lowp else None)
        except ValueError as e:
            launch = e
        out.append((name, launch))

    prefixes = tuple(p for p in (only or "").split(",") if p)
    for method in ("bf16", "kivi", "quantwm", "quantwm+jensen", "quantwm@2.5", "quantwm-trellis+jensen@2.5"):  # @: budget
        if prefixes and not any(f"span_attention {method}".startswith(p) or p.startswith(f"span_attention {method}")
                                for p in prefixes):
            continue  # none of its variants asked for: its cache is not built (a trellis span codes for seconds)
        name, _, budget = method.partition("@")
        cache = KVCache(CacheConfig(name, sink_chunks=0, recent_chunks=0, budget=float(budget) if budget else None), 1)
        cache.observe(0, torch.randn(1, H, N, D, generator=g))
        cache.write(0, torch.randn(1, H, N, D, generator=g), torch.randn(1, H, N, D, generator=g), 0)
        cache.commit(0, 0)
        (k, v), = chunk_spans(cache, 0)
        q = torch.randn(H, Nq, D, generator=g).bfloat16()
        for lowp in (None, "int8", "e4m3"):
            attention(f"span_attention {method} lowp={lowp}", q, k, v, "+jensen" in method, lowp, 1)
        if method == "quantwm":  # a chunk of few queries takes 16-row query tiles
            for lowp in (None, "int8"):
                attention(f"span_attention quantwm, 16 queries, lowp={lowp}", q[:, :16], k, v, False, lowp, 4)
    return [(n, c) for n, c in out if not prefixes or n.startswith(prefixes)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default="90,80", help="CUDA compute capabilities, e.g. 90,80")
    ap.add_argument("--only", help="variants whose name starts with one of these (comma-separated)")
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args(argv)
    rows, failed = [], 0
    print(f"{'kernel variant':<46} {'sm':>3} {'status':<8} {'s':>5} {'regs':>5} {'stack B':>7} {'shared B':>8}")
    for cc in (int(t) for t in a.targets.split(",")):
        for name, c in variants(a.only, cc):
            t = time.perf_counter()
            row = {"variant": name, "sm": cc}
            if isinstance(c, ValueError):
                row.update(status="refused", error=str(c))
            else:
                try:
                    sig, cx = signature(c)
                    options = {o: c.kwargs[o] for o in ("num_warps", "num_stages") if o in c.kwargs}
                    k = triton.compile(ASTSource(c.fn, sig, cx), target=GPUTarget("cuda", cc, 32), options=options)
                    row.update(status="ok", **resources(k.asm["cubin"]), shared_triton=k.metadata.shared)
                except Exception as e:  # noqa: BLE001 - reported per variant, not raised
                    lines = [x for x in str(e).splitlines() if x.strip().strip("^")]
                    row.update(status="FAILED", error=f"{type(e).__name__}: {lines[-1] if lines else ''}"[:200])
                    failed += 1
            row["seconds"] = round(time.perf_counter() - t, 1)
            rows.append(row)
            print(f"{name:<46} {cc:>3} {row['status']:<8} {row['seconds']:>5.1f} {row.get('reg', '-'):>5} "
                  f"{row.get('stack', '-'):>7} {row.get('shared_triton', '-'):>8}"
                  + (f"  {row['error']}" if "error" in row else ""), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"triton": triton.__version__, "rows": rows}, indent=1))
    print(f"{len(rows)} variants: {sum(r['status'] == 'ok' for r in rows)} compiled, "
          f"{sum(r['status'] == 'refused' for r in rows)} refused by their launcher, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
