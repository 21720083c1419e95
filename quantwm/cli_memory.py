"""`quantwm memory` and `quantwm plan`: the cache's stored bytes at a real model's shapes, and the bits per element a
memory limit needs (quantwm/evaluation/memory.py, quantwm/evaluation/plan.py)."""
from __future__ import annotations

import math
from pathlib import Path

from .cli_output import fmt, progress_bar, table, write_json
from .cli_values import budget_pair
from .core.methods import parse_method_name


def cmd_memory(a) -> int:
    from .evaluation.memory import get_preset, memory_report

    parse_method_name(a.method)
    p = get_preset(a.preset)
    frames = a.latent_frames if a.latent_frames is not None else p.length or 21
    r = memory_report(a.preset, frames, a.method, a.target, a.bits, a.sample_layers,
                      progress=progress_bar("memory"), span_chunks=a.span_chunks, queries=a.queries, budget=budget_pair(a),
                      recent_chunks=a.recent_chunks)
    write_json(r, a.json)
    print(f"{a.method} on {p.name}, {frames} latent frames, spans of {a.span_chunks} chunk(s), "
          f"queries {a.queries} ({r['layers_quantized']} of {p.layers} layer(s) quantized, bytes scaled); grid: {r['grid']}")
    print(f"  shapes: {p.layers} layers x {p.heads} heads x {p.head_dim}, {p.tokens_per_frame} tokens per latent frame, "
          f"chunks of {p.chunk_frames}; {r['window']}; the cache holds {r['held_frames']} latent frame(s)")
    if p.source:
        print(f"  source: {p.source}")
    print(f"  quantized spans {r['bits_per_element']:.3f} bits/element ({r['compression']:.3f}x); whole cache "
          f"{r['total_bytes'] / 2**30:.3f} GiB vs {r['bf16_bytes'] / 2**30:.3f} GiB BF16 ({r['cache_compression']:.3f}x)")
    if any(b is not None for b in budget_pair(a)):
        print("  configuration: " + "; ".join(f"{k}: {v}" for k, v in r["configuration"].items()))
    rt = r["runtime_bytes"]
    print(f"  runtime state (not in the cache figures): running S {rt['query_stats'] / 2**20:.1f} MiB, warm-start "
          f"centroids {rt['method_state'] / 2**20:.1f} MiB, kernel views {rt['kernel_views'] / 2**20:.1f} MiB")
    return 0


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 / 10 else f"{n / 2**20:.1f} MiB"


def _count(frames: float) -> str:
    """Latent frames (and their video frames) or 'any length'."""
    from .evaluation.plan import video_frames

    return "any length" if math.isinf(frames) else f"{int(frames)} ({video_frames(int(frames))} video)"


def cmd_plan(a) -> int:
    from .evaluation.plan import FRONTIER, latent_frames, plan, preset_with

    p = preset_with(a.model, layers=a.layers, heads=a.heads, head_dim=a.head_dim, tokens_per_frame=a.tokens_per_frame,
                    chunk_frames=a.chunk_frames)
    frames = latent_frames(a.frames) if a.frames is not None else a.latent_frames
    r = plan(p, frames, a.memory_gb, a.window, a.sink_chunks, a.recent_chunks, Path(a.frontier) if a.frontier else FRONTIER)
    write_json(r, a.json)
    h = r["held"]
    window = f"a window of {a.window} chunk(s) after {a.sink_chunks} sink chunk(s)" if a.window else "no window"
    print(f"{p.name}: {p.layers} layers x {p.heads} heads x {p.head_dim}, {p.tokens_per_frame} tokens per latent frame, "
          f"chunks of {p.chunk_frames}; {frames} latent frames ({r['video_frames']} video), {window}; "
          f"limit {a.memory_gb:g} GiB")
    print(f"  at its peak the cache holds {h['full_chunks']} BF16 chunk(s) + the current chunk ({h['current_frames']} "
          f"frame(s)) = {_gib(r['full_precision_bytes'])}, and {h['quantized_chunks']} chunk(s) to quantize; "
          f"all BF16: {_gib(r['bf16_bytes'])}")
    need = r["bits_needed"]
    if need is None:
        print("  bits per element needed: none fits (the full-precision chunks alone exceed the limit)")
    elif need >= 16:
        print("  bits per element needed: 16 (BF16 fits; no quantization needed)")
    else:
        print(f"  bits per element needed: {need:.3f}; budget: "
              + (f"{r['budget']:g} (the largest measured budget at or below it)" if r["budget"] else "none of the rows"))
    rows = [["bits/element", "bytes per latent frame", "cache at peak", "fits", "latent frames that fit",
             "quantwm PSNR vs BF16 (frontier)", "quantwm place shift (frontier)"]]
    rows += [["16 (BF16)" if x["bits"] >= 16 else f"{x['bits']:g}", _gib(x["bytes_per_frame"]), _gib(x["peak_bytes"]),
              "yes" if x["fits"] else "no", _count(x["frames_that_fit"]),
              *(("reference", "0") if x["bits"] >= 16 else
                (fmt(x["quality"][k]["quantwm"], 2 if k == "psnr" else 4) if x["quality"] else "none measured"
                 for k in ("psnr", "place_shift_rate")))] for x in r["rows"]]
    print(table(rows))
    source = next((x["quality"]["source"].split(" (")[0] for x in r["rows"] if x["quality"]), None)
    print(f"  frontier columns: quantwm's best point within each budget in {source}'s envelope (the built-in model "
          f"on held-out photographs, 16 frames; not {p.name}'s own quality)" if source else
          f"  frontier columns: none measured (no frontier envelope at {r['frontier']})")
    q = r["quality"]
    if r["budget"] is not None and r["budget"] < 16:
        if q is None:
            print(f"  quality at {r['budget']:g} bits: none measured (no frontier envelope at {r['frontier']})")
        else:
            print(f"  quality at {q['budget']:g} bits, from {q['source']} (the built-in model, not {p.name}):")
            for metric, v in ((m, q[m]) for m in ("psnr", "place_shift_rate")):
                other = f"; best other {v['other_method']}: {fmt(v['other'])}" if v["other_method"] else ""
                print(f"    {metric}: quantwm {fmt(v['quantwm'])}{other}")
    return 0

