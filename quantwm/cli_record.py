"""`quantwm record`: a run file for the app, BF16 and a method from the same noise, of the built-in model (whole or
through a window), a FastVideo pipeline, Self-Forcing or SANA-WM's refiner (quantwm/evaluation/runfile.py)."""
from __future__ import annotations

from .cli_output import fmt, progress_bar
from .cli_values import int_list, world_model

PIPELINE_BUDGET = 2.5  # `record --pipeline` with neither --bits nor --budget: bits per element


def cmd_record(a) -> int:
    import os

    from .drivers.views import make_run
    from .drivers.workbench import RunKey, Workbench
    from .evaluation.limits import Limits
    from .evaluation.runfile import write_run

    layers = int_list(a.logit_layers, "--logit-layers") if a.logit_layers else []
    heads = int_list(a.logit_heads, "--logit-heads") if a.logit_heads else []
    if a.pipeline is not None:
        if a.bits is None and a.budget is None:
            a.budget = PIPELINE_BUDGET  # the paper's models at its operating point, whatever their head dim
        return _record_pipeline(a, layers, heads)
    a.bits = 2 if a.bits is None else a.bits
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
                             kv_max_frames=a.kv_max_frames, progress=progress_bar("record"))
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
                                  progress=progress_bar("record"))
        write_run(a.out, run)
        print(f"wrote {a.out} ({os.path.getsize(a.out) / 2 ** 20:.1f} MB): Self-Forcing, {a.method} "
              f"{a.target} {a.bits}-bit against BF16; open it with python app.py --run {a.out}")
        return 0
    if a.window is None and a.sensitivity_frames:
        raise ValueError("--sensitivity-frames needs --window (the streamed long run)")
    if a.window is not None:
        return _record_long(a, layers, heads)
    model = world_model(a.weights)
    # a command-line run is bounded by the machine's memory only (no queue to hold)
    wb = Workbench(model=model, limits=Limits.from_machine(model.cfg, 1))
    key = RunKey(a.seed, a.trajectory, a.method, a.target, a.bits, a.frames, a.budget)
    wb.check_frames(key.frames)
    run = make_run(wb, key, layers, heads, {"command": "quantwm record --model builtin"}, progress=progress_bar("record"))
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

    run = record_fastvideo(name, a.method, a.target, 2 if a.bits is None else a.bits, a.budget, a.frames, a.seed,
                           a.tiny, a.weights, a.device,
                           None if a.tiny else (a.height, a.width), layers, heads, progress=progress_bar("record"),
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
    meta = record_long(world_model(a.weights), key, a.out, a.window, a.sink_chunks, layers, heads,
                       {"command": "quantwm record --model builtin --window"}, progress=progress_bar("record"),
                       sensitivity_frames=a.sensitivity_frames)
    long = meta["long"]
    first = long["first_frame_below_threshold"]
    print(f"wrote {a.out} ({os.path.getsize(a.out) / 2 ** 20:.1f} MB, {meta['seconds']:.0f} s): {key.id} against "
          f"BF16 through a window of {a.window} chunk(s) after {a.sink_chunks} sink chunk(s); PSNR vs BF16 "
          f"{fmt(meta['summary']['psnr'], 2)} dB, first frame under {long['threshold_db']:g} dB: "
          f"{first if first is not None else 'none'}, {meta['bits_per_element']:.3f} bits per element; open it with "
          f"python app.py --run {a.out}")
    return 0

