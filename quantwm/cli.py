"""Command line: `python -m quantwm {analyze,memory,plan,eval,trace,record,figures,frontier,synth-trace,query-stats,
methods,selfcheck,app} ...` (also installed as `quantwm`).

Long work shows a progress bar on stderr. Bad arguments or files print one line on stderr and exit 2.
`quantwm selfcheck` exits 1 when a kernel fails its check against its reference, naming it on stderr.
`quantwm app ...` starts the diagnostics app (the same as `python app.py ...`).
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from tqdm import tqdm

from .cli_parser import build_parser
from .cli_parser import fail as _fail
from .core.methods import known_methods, method_sources, parse_method_name


def _methods(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    if not names:
        raise ValueError("--methods is empty; known methods: " + ", ".join(known_methods()))
    for m in names:
        parse_method_name(m)
    return names


def _progress(desc: str):
    bar = None

    def update(done: int, total: int, what: str = ""):
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False, disable=None)
        bar.set_postfix_str(what)
        bar.update(done - bar.n)
        if done >= total:
            bar.close()
    return update


def _write_json(obj: dict, path: str | None) -> None:
    text = json.dumps(obj, indent=2, allow_nan=True)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _fmt(x: float, digits: int = 4) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _fmt_g(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3g}"


def _options(pairs: list[str]) -> tuple:
    """['lam=4', 'psac=false'] -> (('lam', 4.0), ('psac', False)) for CacheConfig.method_options."""
    out = []
    for pair in pairs or []:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects KEY=VALUE, got {pair!r}")
        low = raw.lower()
        value = {"true": True, "false": False, "none": None}.get(low, raw)
        if isinstance(value, str):
            try:
                value = int(raw)
            except ValueError:
                try:
                    value = float(raw)
                except ValueError:
                    pass
        out.append((key, value))
    return tuple(out)


def _budget(a) -> tuple:
    return (a.budget_k if a.budget_k is not None else a.budget, a.budget_v if a.budget_v is not None else a.budget)


def _report_budget(config: dict) -> None:
    """The methods a budget left out (one line each) and what the others chose."""
    for why in config.get("left_out", {}).values():
        print(f"left out: {why}")
    for m, chosen in config.get("configuration", {}).items():
        if chosen and any(b is not None for b in config.get("budget", {}).values()):
            print(f"{m}: " + "; ".join(f"{k}: {v}" for k, v in chosen.items()))


def cmd_analyze(a) -> int:
    from .evaluation.analyze import analyze_trace
    from .evaluation.trace import read_trace

    methods = _methods(a.methods)
    trace = read_trace(a.trace)
    report = analyze_trace(trace, methods, a.target, a.bits, a.chunk_frames, a.sink_chunks, a.recent_chunks,
                           progress=_progress("analyze"), method_options=_options(a.set), budget=_budget(a))
    _write_json(report, a.json)
    keys = ("shift_rate", "topk_overlap", "attn_kl", "logit_rmse", "k_rel_err", "v_rel_err", "out_rel_err",
            "bits_per_element")
    rows = [["method", *keys]] + [[m, *(_fmt(e["mean"][k]) for k in keys)] for m, e in report["methods"].items()]
    kind = f", kind {trace.meta['kind']}" if "kind" in trace.meta else ""
    print(f"trace {a.trace} ({trace.meta['model']}{kind}), target={a.target}, "
          + (f"budget K {_budget(a)[0]} / V {_budget(a)[1]} bits per element" if any(b is not None for b in _budget(a))
             else f"bits={a.bits}"))
    _report_budget(report["config"])
    print(_table(rows))
    if "k" in a.target:  # the rate-distortion meter (docs/results.md, "Bits above the bound")
        meter = ("k_bits_per_element", "k_bits_above_bound", "k_distortion", "k_bound_distortion")
        print("Keys against the Gaussian rate-distortion bound (query-weighted by the traced queries; distortions "
              "as fractions of the weighted variance):")
        print(_table([["method", *meter]] + [[m, *(_fmt(e["mean"][k]) if "bits" in k else _fmt_g(e["mean"][k]) for k in meter)]
                                              for m, e in report["methods"].items()]))
    return 0


def cmd_memory(a) -> int:
    from .evaluation.memory import get_preset, memory_report

    parse_method_name(a.method)
    p = get_preset(a.preset)
    frames = a.latent_frames if a.latent_frames is not None else p.length or 21
    r = memory_report(a.preset, frames, a.method, a.target, a.bits, a.sample_layers,
                      progress=_progress("memory"), span_chunks=a.span_chunks, queries=a.queries, budget=_budget(a),
                      recent_chunks=a.recent_chunks)
    _write_json(r, a.json)
    print(f"{a.method} on {p.name}, {frames} latent frames, spans of {a.span_chunks} chunk(s), "
          f"queries {a.queries} ({r['layers_quantized']} of {p.layers} layer(s) quantized, bytes scaled); grid: {r['grid']}")
    print(f"  shapes: {p.layers} layers x {p.heads} heads x {p.head_dim}, {p.tokens_per_frame} tokens per latent frame, "
          f"chunks of {p.chunk_frames}; {r['window']}; the cache holds {r['held_frames']} latent frame(s)")
    if p.source:
        print(f"  source: {p.source}")
    print(f"  quantized spans {r['bits_per_element']:.3f} bits/element ({r['compression']:.3f}x); whole cache "
          f"{r['total_bytes'] / 2**30:.3f} GiB vs {r['bf16_bytes'] / 2**30:.3f} GiB BF16 ({r['cache_compression']:.3f}x)")
    if any(b is not None for b in _budget(a)):
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
    _write_json(r, a.json)
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
                (_fmt(x["quality"][k]["quantwm"], 2 if k == "psnr" else 4) if x["quality"] else "none measured"
                 for k in ("psnr", "place_shift_rate")))] for x in r["rows"]]
    print(_table(rows))
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
                other = f"; best other {v['other_method']}: {_fmt(v['other'])}" if v["other_method"] else ""
                print(f"    {metric}: quantwm {_fmt(v['quantwm'])}{other}")
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


def _ints(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, got {text!r}") from None


def _floats(text: str, what: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated numbers, got {text!r}") from None
    bad = [v for v in values if not 0 < v <= 16]
    if bad or not values:
        raise ValueError(f"{what} takes bits per element in (0, 16], got {text!r}")
    return values


def _world_model(weights: str | None):
    from .world.generate import DEFAULT_WEIGHTS, load_world_model

    return load_world_model(weights or DEFAULT_WEIGHTS)


def _photo_note(a) -> str:
    if a.training_photos:
        which = "one training photograph per held-out scene" if a.training_photos == "matched" else \
            "the training photographs"
        return f" (the seeds' layouts cut from {which})"
    return " (training photographs)" if a.training_seeds and a.world == "photo" else ""


def cmd_eval(a) -> int:
    from .world.evaluate import evaluate

    methods = _methods(a.methods)
    if a.window is not None:
        if a.layer_sensitivity:
            raise ValueError("--layer-sensitivity runs the whole rollout, without --window")
        return _eval_long(a, methods)
    if a.stream:
        raise ValueError("--stream needs --window (the streamed long-rollout evaluation)")
    if a.figure and not a.layer_sensitivity:
        raise ValueError("--figure needs --window (the error over time) or --layer-sensitivity (its table)")
    model = _world_model(a.weights)
    report = evaluate(model, methods, a.target, _ints(a.seeds, "--seeds"), a.frames, a.bits,
                      a.trajectory, a.steps, progress=_progress("eval"), training_seeds=a.training_seeds,
                      world=a.world, method_options=_options(a.set), training_photos=a.training_photos,
                      budget=_budget(a))
    if a.layer_sensitivity:
        report["layer_sensitivity"] = _layer_sensitivity(a, model, [m for m in report["methods"] if m != "bf16"])
        if a.figure:
            from .evaluation.figures import layer_sensitivity_figure, save_figure

            fig = layer_sensitivity_figure(report["layer_sensitivity"], f"layer sensitivity, {a.frames} frames, "
                                           f"seeds {a.seeds}, " + (f"budget {a.budget:g}" if a.budget else f"{a.bits} bits"))
            print("wrote " + ", ".join(map(str, save_figure(fig, a.figure, ["png", "svg"]))))
    _write_json(report, a.json)
    keys = ("psnr", "ssim", "lpips", "tdiff", "warp_error", "shift_rate", "place_shift_rate", "k_rel_err",
            "v_rel_err", "bits_per_element", "compression", "cache_compression")
    print(f"eval: target={a.target}, bits={a.bits}, seeds={a.seeds}, {a.frames} frames, {a.trajectory}, "
          f"{a.world} world{_photo_note(a)}, "
          f"{report['config']['seconds']:.0f} s")
    if report["config"].get("lpips_note"):
        print(report["config"]["lpips_note"])
    _report_budget(report["config"])
    print(_table([["method", *keys]] + [[m, *(_fmt(e["mean"][k]) for k in keys)]
                                          for m, e in report["methods"].items()]))
    b = report["bf16"]
    print(f"bf16 vs ground truth on revisited views: {_fmt(b['revisit_psnr_vs_gt'], 2)} dB; same-place attention "
          f"mass per layer: {', '.join(_fmt(x, 3) for x in b['same_place_mass_per_layer'])}; top-1 probability "
          f"per layer: {', '.join(_fmt(x, 3) for x in b['top1_prob_per_layer'])}")
    for m, e in report["methods"].items():
        if m != "bf16":
            print(f"{m}: place shift rate per layer: {', '.join(_fmt(x, 3) for x in e['place_shift_rate_per_layer'])}")
    return 0


def _layer_sensitivity(a, model, methods: list[str]) -> dict:
    """`quantwm eval --layer-sensitivity`: per method, the per-layer table (quantwm.world.sensitivity), printed."""
    from .world.sensitivity import layer_sensitivity

    out = {}
    for m in methods:
        r = out[m] = layer_sensitivity(model, m, _ints(a.seeds, "--seeds"), a.frames, a.bits, a.trajectory, a.steps,
                                       a.target, _budget(a), _options(a.set), progress=_progress(f"sensitivity {m}"))
        heads = lambda w: "n/a" if w is None else " ".join(  # noqa: E731
            f"{mu:.2f}[{lo:.1f}-{hi:.1f}]" for mu, lo, hi in zip(w["mean"], w["min"], w["max"]))
        print(f"{m}: layer sensitivity ({r['seconds']:.0f} s); every layer quantized: PSNR vs BF16 "
              f"{_fmt(r['all']['psnr'], 2)} dB, place shift {_fmt(r['all']['place_shift_rate'])}; d_: against that")
        print(_table([["mode", "layer", "psnr", "d_psnr", "place_shift", "d_place_shift"]]
                     + [[x["mode"], str(x["layer"]), _fmt(x["psnr"], 2), _fmt(x["d_psnr"], 2),
                         _fmt(x["place_shift_rate"]), _fmt(x["d_place_shift_rate"])] for x in r["rows"]]))
        print(f"{m}: code bits per channel by head, mean [narrowest-widest channel, each averaged over spans], and each "
              "head's top-1 shift and place shift, every layer quantized")
        print(_table([["layer", "Keys", "Values", "shift by head", "place shift by head"]]
                     + [[str(x["layer"]), heads(x["k_bits"]), heads(x["v_bits"]),
                         " ".join(f"{v:.3f}" for v in x["shift_rate"]),
                         " ".join(f"{v:.3f}" for v in x["place_shift_rate"])] for x in r["allocation"]]))
    return out


def _eval_long(a, methods: list[str]) -> int:
    """`quantwm eval --window N`: the streamed long-rollout evaluation (quantwm.world.long_rollout)."""
    from .world.long_rollout import evaluate_long

    if a.training_seeds or a.training_photos:
        raise ValueError("--window runs held-out worlds only (no --training-seeds / --training-photos)")
    report = evaluate_long(_world_model(a.weights), methods, a.target, _ints(a.seeds, "--seeds"), a.frames, a.bits,
                           a.trajectory, a.steps, a.window, a.sink_chunks, a.stream, progress=_progress("eval"),
                           world=a.world, method_options=_options(a.set), budget=_budget(a), threshold_db=a.threshold_db)
    _write_json(report, a.json)
    if a.figure:
        from .evaluation.figures import error_over_time_figure, save_figure

        fig = error_over_time_figure(report["methods"], a.threshold_db, f"{a.frames} frames, window {a.window}, "
                                                                         f"seeds {a.seeds}")
        print("wrote " + ", ".join(map(str, save_figure(fig, a.figure, ["png", "svg"]))))
    c = report["config"]
    print(f"eval: target={a.target}, bits={a.bits}, seeds={a.seeds}, {a.frames} frames through a window of {a.window} "
          f"chunk(s) after {a.sink_chunks} sink chunk(s), {a.trajectory}, {a.world} world, {c['seconds']:.0f} s"
          + (f"; per-frame lines in {a.stream}" if a.stream else ""))
    _report_budget(c)
    keys = ("psnr", "ssim", "tdiff", "shift_rate", "place_shift_rate", "bits_per_element", "cache_compression")
    print(_table([["method", *keys]] + [[m, *(_fmt(e["mean"][k]) for k in keys)]
                                          for m, e in report["methods"].items()]))
    for m, e in report["methods"].items():
        first = e["first_frame_below_threshold"]
        d = e["drift"]
        mean = e["mean"]
        print(f"{m}: revisit consistency {_fmt(mean['revisit_psnr'], 2)} dB, BF16's own {_fmt(mean['bf16_revisit_psnr'], 2)}"
              f" dB ({mean['revisited_frames']} frame(s) show a place again after its view left the window)")
        print(f"{m}: first frame below {a.threshold_db:g} dB against BF16: {first if first is not None else 'none'}; "
              "per 100 frames: " + ", ".join(f"{k} {v['slope_per_100_frames']:+.2e} (first quarter {_fmt(v['first_quarter'])}"
                                             f", last {_fmt(v['last_quarter'])})" for k, v in d.items()))
        if len(e["per_seed"]) > 1:
            print(f"{m}: per seed " + "; ".join(
                f"{p['seed']}: PSNR {_fmt(p['mean']['psnr'], 2)} dB, place shift {_fmt(p['mean']['place_shift_rate'])}, "
                f"first below {a.threshold_db:g} dB {p['first_frame_below_threshold']}" for p in e["per_seed"]))
    return 0


def cmd_trace(a) -> int:
    from .core.cache import CacheConfig
    from .world.generate import generate, rollout_trace

    run = generate(_world_model(a.weights), a.seed, a.trajectory, a.frames, CacheConfig(), progress=_progress("trace"),
                   world=a.world)
    rollout_trace(run, a.out)
    print(f"wrote {a.out}")
    return 0


def cmd_record(a) -> int:
    import os

    from .drivers.views import make_run
    from .drivers.workbench import RunKey, Workbench
    from .evaluation.limits import Limits
    from .evaluation.runfile import write_run

    layers = _ints(a.logit_layers, "--logit-layers") if a.logit_layers else []
    heads = _ints(a.logit_heads, "--logit-heads") if a.logit_heads else []
    if a.pipeline is not None:
        return _record_pipeline(a, layers, heads)
    if a.tiny:
        raise ValueError("--tiny builds a tiny FastVideo model: give --pipeline fastvideo:NAME")
    a.frames = 32 if a.frames is None else a.frames
    if a.model != "builtin" and (a.window is not None or a.budget is not None):
        raise ValueError(f"--window and --budget record the built-in model (--model builtin), not {a.model}")
    if a.model == "sana-wm":
        from .adapters.sana_wm import record_sana_wm

        missing = [n for n, v in (("--base", a.base), ("--latents", a.latents), ("--prompt", a.prompt)) if not v]
        if missing:
            raise ValueError(f"--model sana-wm needs {', '.join(missing)}")
        run = record_sana_wm(a.base, a.latents, a.prompt, a.method, a.target, a.bits, a.seed, layers, heads, a.device,
                             kv_max_frames=a.kv_max_frames, progress=_progress("record"))
        write_run(a.out, run)
        print(f"wrote {a.out} ({os.path.getsize(a.out) / 2 ** 20:.1f} MB): SANA-WM refiner, {a.method} "
              f"{a.target} {a.bits}-bit against BF16; open it with python app.py --run {a.out}")
        return 0
    if a.model == "self-forcing":
        from .adapters.self_forcing import record_self_forcing

        missing = [n for n, v in (("--checkpoint", a.checkpoint), ("--base", a.base),
                                  ("--embeddings or --prompt", a.embeddings or a.prompt)) if not v]
        if missing:
            raise ValueError(f"--model self-forcing needs {', '.join(missing)}")
        if a.embeddings and a.prompt:
            raise ValueError("give --embeddings or --prompt, not both")
        if a.prompt:
            from .adapters.self_forcing import encode_prompt

            text = encode_prompt(a.base, a.prompt, device=a.device)
        else:
            text = a.embeddings
        run = record_self_forcing(a.checkpoint, a.base, text, a.method, a.target, a.bits, a.latent_frames,
                                  a.chunk_frames, a.height, a.width, a.seed, layers, heads, a.device,
                                  progress=_progress("record"))
        write_run(a.out, run)
        print(f"wrote {a.out} ({os.path.getsize(a.out) / 2 ** 20:.1f} MB): Self-Forcing, {a.method} "
              f"{a.target} {a.bits}-bit against BF16; open it with python app.py --run {a.out}")
        return 0
    if a.window is None and a.sensitivity_frames:
        raise ValueError("--sensitivity-frames needs --window (the streamed long run)")
    if a.window is not None:
        return _record_long(a, layers, heads)
    model = _world_model(a.weights)
    # a command-line run is bounded by the machine's memory only (no queue to hold)
    wb = Workbench(model=model, limits=Limits.from_machine(model.cfg, 1))
    key = RunKey(a.seed, a.trajectory, a.method, a.target, a.bits, a.frames, a.budget)
    wb.check_frames(key.frames)
    run = make_run(wb, key, layers, heads, {"command": "quantwm record --model builtin"}, progress=_progress("record"))
    write_run(a.out, run)
    print(f"wrote {a.out} ({os.path.getsize(a.out) / 2 ** 20:.1f} MB): {key.id} against BF16; open it with "
          f"python app.py --run {a.out}")
    return 0


def _record_pipeline(a, layers: list[int], heads: list[int]) -> int:
    """`quantwm record --pipeline fastvideo:NAME` (quantwm/adapters/fastvideo/record.py)."""
    import os

    from .evaluation.runfile import write_run

    engine, _, name = a.pipeline.partition(":")
    if engine != "fastvideo" or not name:
        raise ValueError(f"--pipeline must be fastvideo:NAME, got {a.pipeline!r}")
    if a.model != "builtin" or a.window is not None:
        raise ValueError("--pipeline records a FastVideo model: leave out --model and --window")
    from .adapters.fastvideo.record import record_fastvideo

    run = record_fastvideo(name, a.method, a.target, a.bits, a.budget, a.frames, a.seed, a.tiny, a.weights, a.device,
                           None if a.tiny else (a.height, a.width), layers, heads, progress=_progress("record"),
                           inputs=a.inputs)
    write_run(a.out, run)
    print(f"wrote {a.out} ({os.path.getsize(a.out) / 2 ** 20:.1f} MB): {run.facts.model}, {a.method} {a.target} "
          f"against BF16, {run.meta['bits_per_element']:.3f} bits per element; open it with python app.py --run {a.out}")
    return 0


def _record_long(a, layers: list[int], heads: list[int]) -> int:
    """`quantwm record --window N`: the run file written chunk by chunk (quantwm.drivers.long_record)."""
    import os

    from .drivers.long_record import record_long
    from .drivers.workbench import RunKey

    key = RunKey(a.seed, a.trajectory, a.method, a.target, a.bits, a.frames, a.budget)
    meta = record_long(_world_model(a.weights), key, a.out, a.window, a.sink_chunks, layers, heads,
                       {"command": "quantwm record --model builtin --window"}, progress=_progress("record"),
                       sensitivity_frames=a.sensitivity_frames)
    long = meta["long"]
    first = long["first_frame_below_threshold"]
    print(f"wrote {a.out} ({os.path.getsize(a.out) / 2 ** 20:.1f} MB, {meta['seconds']:.0f} s): {key.id} against "
          f"BF16 through a window of {a.window} chunk(s) after {a.sink_chunks} sink chunk(s); PSNR vs BF16 "
          f"{_fmt(meta['summary']['psnr'], 2)} dB, first frame under {long['threshold_db']:g} dB: "
          f"{first if first is not None else 'none'}, {meta['bits_per_element']:.3f} bits per element; open it with "
          f"python app.py --run {a.out}")
    return 0


def cmd_methods(a) -> int:
    print(_table([["method", "bits", "source"], *map(list, method_sources())]))
    print("every quantizing method also runs as <method>+jensen (docs/method.md §3)")
    return 0


def cmd_selfcheck(a) -> int:
    """The kernel report (quantwm/evaluation/kernel_report.py); exit 1 when a kernel failed its check against its
    reference, one stderr line per failed check."""
    from .core import selfcheck
    from .evaluation.kernel_report import report

    for name in ("heads", "head_dim", "chunk_tokens"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(a, name)}")
    out = report(a.model, a.heads, a.head_dim, a.chunk_tokens, _ints(a.lengths, "--lengths") if a.lengths else None,
                 a.method, a.budget)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    failed = selfcheck.fallbacks()
    for v in failed:
        print(f"quantwm: kernel self-check failed: {v.line()}", file=sys.stderr)
    return 1 if failed else 0


def cmd_app(argv: list[str]) -> int:
    try:
        from .app.main import main as app_main
    except ImportError as e:
        return _fail(f"the app cannot start: {e}")
    app_main(argv)
    return 0


def cmd_figures(a) -> int:
    from .drivers.registry import RunRegistry
    from .drivers.run_figures import run_figures
    from .drivers.workbench import RunKey, Workbench
    from .evaluation.figures import check_formats

    formats = [f.strip() for f in a.formats.split(",") if f.strip()]
    kinds = [k.strip() for k in a.kinds.split(",") if k.strip()]
    pixel = _ints(a.pixel, "--pixel") if a.pixel else None
    if pixel is not None and len(pixel) != 2:
        raise ValueError(f"--pixel must be x,y, got {a.pixel!r}")
    check_formats(formats)
    key = RunKey(a.seed, a.trajectory, a.method, a.target, a.bits, a.frames)
    methods = _methods(a.methods) if a.methods.strip() else []
    paths = run_figures(RunRegistry(Workbench(a.weights)), key, a.out_dir, kinds, formats, frame=a.frame, pixel=pixel,
                        layer=a.layer, head=a.head, methods=methods, progress=_progress("figures"))
    print("\n".join(f"wrote {p}" for p in paths))
    return 0


def cmd_frontier(a) -> int:
    from .drivers.frontier import (
        describe_leads,
        describe_meter,
        frontier_figure,
        leads,
        make_tasks,
        summarise,
        sweep,
        sweep_grid,
        within,
    )
    from .evaluation.figures import check_formats

    formats = [f.strip() for f in a.formats.split(",") if f.strip()]
    check_formats(formats)
    sources = [s.strip() for s in a.sources.split(",") if s.strip()]
    for s in sources:
        if s != "world" and not (s.startswith("trace:") and Path(s[6:]).is_file()):
            raise ValueError(f"a source is 'world' or 'trace:FILE' (an existing trace file), got {s!r}")
    full = sweep_grid()
    grid = sweep_grid(quick=True) if a.quick else full
    if a.methods:
        unknown = [m for m in _methods(a.methods) if m not in full]
        if unknown:
            raise ValueError(f"no sweep defined for {unknown[0]!r}; sweepable: {', '.join(full)}")
        grid = {m: grid.get(m, full[m]) for m in _methods(a.methods)}
    budgets = _floats(a.budget, "--budget") if a.budget else None
    tasks = make_tasks(sources, grid, _ints(a.bits, "--bits"), a.target, _ints(a.seeds, "--seeds"), a.frames, budgets)
    if a.max_bits is not None:
        tasks, dropped = within(tasks, a.max_bits)
        print(f"{dropped} sweep point(s) store more than {a.max_bits:g} bits per element on their source: not run")
    manifest = sweep(tasks, a.out_dir, a.workers, a.ray, progress=_progress("frontier"))
    summary = summarise({k: v for k, v in manifest.items() if v["task"] in tasks})
    _write_json(summary, str(Path(a.out_dir) / "frontier.json"))
    paths = frontier_figure(summary, Path(a.out_dir) / "frontier", formats)
    for source, s in summary.items():  # at each budget: quantwm's best against the best other method
        metrics = [s["shift_metric"]] + (["psnr"] if source == "world" else [])
        for metric in metrics:
            for line in describe_leads(leads(s["envelope"], metric), metric):
                print(f"{source}: {line}")
        for line in describe_meter(s["envelope"]):
            print(f"{source}: {line}")
    print(f"wrote {Path(a.out_dir) / 'frontier.json'}, {', '.join(map(str, paths))} ({len(tasks)} points)")
    return 0


COMMANDS = {"analyze": cmd_analyze, "memory": cmd_memory, "plan": cmd_plan, "synth-trace": cmd_synth, "eval": cmd_eval,
            "trace": cmd_trace, "record": cmd_record, "figures": cmd_figures, "frontier": cmd_frontier,
            "query-stats": cmd_query_stats, "methods": cmd_methods, "selfcheck": cmd_selfcheck}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["app"]:
        return cmd_app(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (ValueError, FileNotFoundError, PermissionError, IsADirectoryError) as e:
        return _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)


if __name__ == "__main__":
    sys.exit(main())
