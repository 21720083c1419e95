"""`quantwm figures` and `quantwm frontier`: print figures of a built-in-model run (quantwm/drivers/run_figures.py),
and the quality-against-bits sweep with its envelope figure (quantwm/drivers/frontier.py)."""
from __future__ import annotations

from pathlib import Path

from .cli_output import progress_bar, write_json
from .cli_values import bits_list, int_list, method_list


def cmd_figures(a) -> int:
    from .drivers.registry import RunRegistry
    from .drivers.run_figures import run_figures
    from .drivers.workbench import RunKey, Workbench
    from .evaluation.figures import check_formats

    formats = [f.strip() for f in a.formats.split(",") if f.strip()]
    kinds = [k.strip() for k in a.kinds.split(",") if k.strip()]
    pixel = int_list(a.pixel, "--pixel") if a.pixel else None
    if pixel is not None and len(pixel) != 2:
        raise ValueError(f"--pixel must be x,y, got {a.pixel!r}")
    check_formats(formats)
    key = RunKey(a.seed, a.trajectory, a.method, a.target, a.bits, a.frames)
    methods = method_list(a.methods) if a.methods.strip() else []
    paths = run_figures(RunRegistry(Workbench(a.weights)), key, a.out_dir, kinds, formats, frame=a.frame, pixel=pixel,
                        layer=a.layer, head=a.head, methods=methods, progress=progress_bar("figures"))
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
        unknown = [m for m in method_list(a.methods) if m not in full]
        if unknown:
            raise ValueError(f"no sweep defined for {unknown[0]!r}; sweepable: {', '.join(full)}")
        grid = {m: grid.get(m, full[m]) for m in method_list(a.methods)}
    budgets = bits_list(a.budget, "--budget") if a.budget else None
    tasks = make_tasks(sources, grid, int_list(a.bits, "--bits"), a.target, int_list(a.seeds, "--seeds"), a.frames, budgets)
    if a.max_bits is not None:
        tasks, dropped = within(tasks, a.max_bits)
        print(f"{dropped} sweep point(s) store more than {a.max_bits:g} bits per element on their source: not run")
    manifest = sweep(tasks, a.out_dir, a.workers, a.ray, progress=progress_bar("frontier"))
    summary = summarise({k: v for k, v in manifest.items() if v["task"] in tasks})
    write_json(summary, str(Path(a.out_dir) / "frontier.json"))
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

