"""`quantwm analyze`, `synth-trace`, `query-stats` and `trace`: the commands that read or write trace files
(quantwm/evaluation/trace.py)."""
from __future__ import annotations

from .cli_output import fmt, fmt_g, progress_bar, report_budget, table, write_json
from .cli_values import budget_pair, method_list, set_options, world_model


def cmd_analyze(a) -> int:
    from .evaluation.analyze import analyze_trace
    from .evaluation.trace import read_trace

    methods = method_list(a.methods)
    trace = read_trace(a.trace)
    report = analyze_trace(trace, methods, a.target, a.bits, a.chunk_frames, a.sink_chunks, a.recent_chunks,
                           progress=progress_bar("analyze"), method_options=set_options(a.set), budget=budget_pair(a))
    write_json(report, a.json)
    keys = ("shift_rate", "topk_overlap", "attn_kl", "logit_rmse", "k_rel_err", "v_rel_err", "out_rel_err",
            "bits_per_element")
    rows = [["method", *keys]] + [[m, *(fmt(e["mean"][k]) for k in keys)] for m, e in report["methods"].items()]
    kind = f", kind {trace.meta['kind']}" if "kind" in trace.meta else ""
    print(f"trace {a.trace} ({trace.meta['model']}{kind}), target={a.target}, "
          + (f"budget K {budget_pair(a)[0]} / V {budget_pair(a)[1]} bits per element" if any(b is not None for b in budget_pair(a))
             else f"bits={a.bits}"))
    report_budget(report["config"])
    print(table(rows))
    if "k" in a.target:  # the rate-distortion meter (docs/results.md, "Bits above the bound")
        meter = ("k_bits_per_element", "k_bits_above_bound", "k_distortion", "k_bound_distortion")
        print("Keys against the Gaussian rate-distortion bound (query-weighted by the traced queries; distortions "
              "as fractions of the weighted variance):")
        print(table([["method", *meter]] + [[m, *(fmt(e["mean"][k]) if "bits" in k else fmt_g(e["mean"][k]) for k in meter)]
                                              for m, e in report["methods"].items()]))
    return 0


def cmd_synth(a) -> int:
    from .evaluation.synthetic import make_synthetic_trace

    try:
        h, w = (int(v) for v in a.grid.lower().split("x"))
    except ValueError:
        raise ValueError(f"--grid takes ROWSxCOLS tokens per frame (e.g. 24x24), got {a.grid!r}") from None
    make_synthetic_trace(a.seed, n_layers=a.layers, n_heads=a.heads, head_dim=a.head_dim, grid=(h, w),
                         cached_frames=a.cached_frames, chunk_frames=a.chunk_frames, content_dim=a.query_dims,
                         kind=a.kind).save(a.out)
    print(f"wrote {a.out}")
    return 0


def cmd_query_stats(a) -> int:
    from .adapters.sglang_plugin import save_query_stats

    shapes = save_query_stats(a.trace, a.out)
    print(f"wrote {a.out}: S for {len(shapes)} layers, {next(iter(shapes.values()))} each "
          f"(QUANTWM_KV_QUERY_STATS={a.out})")
    return 0


def cmd_trace(a) -> int:
    from .core.cache import CacheConfig
    from .world.generate import generate, rollout_trace

    run = generate(world_model(a.weights), a.seed, a.trajectory, a.frames, CacheConfig(), progress=progress_bar("trace"),
                   world=a.world)
    rollout_trace(run, a.out)
    print(f"wrote {a.out}")
    return 0

