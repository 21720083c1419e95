"""`quantwm eval`: BF16 against methods on the built-in world model (quantwm/world/evaluate.py); with `--window` the
streamed long rollout (quantwm/world/long_rollout.py), with `--layer-sensitivity` the per-layer table
(quantwm/world/sensitivity.py)."""
from __future__ import annotations

from .cli_output import fmt, progress_bar, report_budget, table, write_json
from .cli_values import budget_pair, int_list, method_list, set_options, world_model


def cmd_eval(a) -> int:
    from .world.evaluate import evaluate

    methods = method_list(a.methods)
    if a.window is not None:
        if a.layer_sensitivity:
            raise ValueError("--layer-sensitivity runs the whole rollout, without --window")
        return _eval_long(a, methods)
    if a.stream:
        raise ValueError("--stream needs --window (the streamed long-rollout evaluation)")
    if a.figure and not a.layer_sensitivity:
        raise ValueError("--figure needs --window (the error over time) or --layer-sensitivity (its table)")
    model = world_model(a.weights)
    report = evaluate(model, methods, a.target, int_list(a.seeds, "--seeds"), a.frames, a.bits,
                      a.trajectory, a.steps, progress=progress_bar("eval"), training_seeds=a.training_seeds,
                      world=a.world, method_options=set_options(a.set), training_photos=a.training_photos,
                      budget=budget_pair(a))
    if a.layer_sensitivity:
        report["layer_sensitivity"] = _layer_sensitivity(a, model, [m for m in report["methods"] if m != "bf16"])
        if a.figure:
            from .evaluation.figures import layer_sensitivity_figure, save_figure

            fig = layer_sensitivity_figure(report["layer_sensitivity"], f"layer sensitivity, {a.frames} frames, "
                                           f"seeds {a.seeds}, " + (f"budget {a.budget:g}" if a.budget else f"{a.bits} bits"))
            print("wrote " + ", ".join(map(str, save_figure(fig, a.figure, ["png", "svg"]))))
    write_json(report, a.json)
    keys = ("psnr", "ssim", "lpips", "tdiff", "warp_error", "shift_rate", "place_shift_rate", "k_rel_err",
            "v_rel_err", "bits_per_element", "compression", "cache_compression", "vbench_flicker")
    print(f"eval: target={a.target}, bits={a.bits}, seeds={a.seeds}, {a.frames} frames, {a.trajectory}, "
          f"{a.world} world{_photo_note(a)}, "
          f"{report['config']['seconds']:.0f} s")
    if report["config"].get("lpips_note"):
        print(report["config"]["lpips_note"])
    report_budget(report["config"])
    print(table([["method", *keys]] + [[m, *(fmt(e["mean"][k]) for k in keys)]
                                          for m, e in report["methods"].items()]))
    b = report["bf16"]
    print(f"bf16 vs ground truth on revisited views: {fmt(b['revisit_psnr_vs_gt'], 2)} dB; same-place attention "
          f"mass per layer: {', '.join(fmt(x, 3) for x in b['same_place_mass_per_layer'])}; top-1 probability "
          f"per layer: {', '.join(fmt(x, 3) for x in b['top1_prob_per_layer'])}; VBench temporal flickering "
          f"{fmt(b['vbench_flicker'])}")
    for m, e in report["methods"].items():
        if m != "bf16":
            print(f"{m}: place shift rate per layer: {', '.join(fmt(x, 3) for x in e['place_shift_rate_per_layer'])}")
    return 0


def _photo_note(a) -> str:
    if a.training_photos:
        which = "one training photograph per held-out scene" if a.training_photos == "matched" else \
            "the training photographs"
        return f" (the seeds' layouts cut from {which})"
    return " (training photographs)" if a.training_seeds and a.world == "photo" else ""


def _layer_sensitivity(a, model, methods: list[str]) -> dict:
    """`quantwm eval --layer-sensitivity`: per method, the per-layer table (quantwm.world.sensitivity), printed."""
    from .world.sensitivity import layer_sensitivity

    out = {}
    for m in methods:
        r = out[m] = layer_sensitivity(model, m, int_list(a.seeds, "--seeds"), a.frames, a.bits, a.trajectory, a.steps,
                                       a.target, budget_pair(a), set_options(a.set), progress=progress_bar(f"sensitivity {m}"))
        heads = lambda w: "n/a" if w is None else " ".join(  # noqa: E731
            f"{mu:.2f}[{lo:.1f}-{hi:.1f}]" for mu, lo, hi in zip(w["mean"], w["min"], w["max"]))
        print(f"{m}: layer sensitivity ({r['seconds']:.0f} s); every layer quantized: PSNR vs BF16 "
              f"{fmt(r['all']['psnr'], 2)} dB, place shift {fmt(r['all']['place_shift_rate'])}; d_: against that")
        print(table([["mode", "layer", "psnr", "d_psnr", "place_shift", "d_place_shift"]]
                     + [[x["mode"], str(x["layer"]), fmt(x["psnr"], 2), fmt(x["d_psnr"], 2),
                         fmt(x["place_shift_rate"]), fmt(x["d_place_shift_rate"])] for x in r["rows"]]))
        print(f"{m}: code bits per channel by head, mean [narrowest-widest channel, each averaged over spans], and each "
              "head's top-1 shift and place shift, every layer quantized")
        print(table([["layer", "Keys", "Values", "shift by head", "place shift by head"]]
                     + [[str(x["layer"]), heads(x["k_bits"]), heads(x["v_bits"]),
                         " ".join(f"{v:.3f}" for v in x["shift_rate"]),
                         " ".join(f"{v:.3f}" for v in x["place_shift_rate"])] for x in r["allocation"]]))
    return out


def _eval_long(a, methods: list[str]) -> int:
    """`quantwm eval --window N`: the streamed long-rollout evaluation (quantwm.world.long_rollout)."""
    from .world.long_rollout import evaluate_long

    if a.training_seeds or a.training_photos:
        raise ValueError("--window runs held-out worlds only (no --training-seeds / --training-photos)")
    report = evaluate_long(world_model(a.weights), methods, a.target, int_list(a.seeds, "--seeds"), a.frames, a.bits,
                           a.trajectory, a.steps, a.window, a.sink_chunks, a.stream, progress=progress_bar("eval"),
                           world=a.world, method_options=set_options(a.set), budget=budget_pair(a), threshold_db=a.threshold_db)
    write_json(report, a.json)
    if a.figure:
        from .evaluation.figures import error_over_time_figure, save_figure

        fig = error_over_time_figure(report["methods"], a.threshold_db, f"{a.frames} frames, window {a.window}, "
                                                                         f"seeds {a.seeds}")
        print("wrote " + ", ".join(map(str, save_figure(fig, a.figure, ["png", "svg"]))))
    c = report["config"]
    print(f"eval: target={a.target}, bits={a.bits}, seeds={a.seeds}, {a.frames} frames through a window of {a.window} "
          f"chunk(s) after {a.sink_chunks} sink chunk(s), {a.trajectory}, {a.world} world, {c['seconds']:.0f} s"
          + (f"; per-frame lines in {a.stream}" if a.stream else ""))
    report_budget(c)
    keys = ("psnr", "ssim", "tdiff", "shift_rate", "place_shift_rate", "bits_per_element", "cache_compression")
    print(table([["method", *keys]] + [[m, *(fmt(e["mean"][k]) for k in keys)]
                                          for m, e in report["methods"].items()]))
    for m, e in report["methods"].items():
        first = e["first_frame_below_threshold"]
        d = e["drift"]
        mean = e["mean"]
        print(f"{m}: revisit consistency {fmt(mean['revisit_psnr'], 2)} dB, BF16's own {fmt(mean['bf16_revisit_psnr'], 2)}"
              f" dB ({mean['revisited_frames']} frame(s) show a place again after its view left the window)")
        print(f"{m}: first frame below {a.threshold_db:g} dB against BF16: {first if first is not None else 'none'}; "
              "per 100 frames: " + ", ".join(f"{k} {v['slope_per_100_frames']:+.2e} (first quarter {fmt(v['first_quarter'])}"
                                             f", last {fmt(v['last_quarter'])})" for k, v in d.items()))
        if len(e["per_seed"]) > 1:
            print(f"{m}: per seed " + "; ".join(
                f"{p['seed']}: PSNR {fmt(p['mean']['psnr'], 2)} dB, place shift {fmt(p['mean']['place_shift_rate'])}, "
                f"first below {a.threshold_db:g} dB {p['first_frame_below_threshold']}" for p in e["per_seed"]))
    return 0

