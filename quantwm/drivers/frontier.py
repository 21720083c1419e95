"""`quantwm frontier`: quality against bits per element for every method, sweeping its budget knobs.

Each sweep point is one configuration (method, target, bits, method options) measured on one source: the
built-in world model on held-out seeds ("world": bits per element from stored bytes, token and place shift,
PSNR/SSIM/LPIPS/tdiff against BF16) or a synthetic trace ("trace:<path>": bits, token shift, attention-output
error). Points are independent tasks; the manifest (`manifest.json` in the output folder) is keyed by the
configuration, so an interrupted sweep resumes where it stopped. They run in a local process pool by default,
or on a Ray cluster (`ray_address`, the optional `ray` extra) when a sweep outgrows one machine.

`summarise` compares methods at equal budgets (docs/method.md §3.1): its `envelope` holds, for each budget B
in `BUDGETS` and each metric, every method's best measured point with bits per element ≤ B (a method with no
point within B is absent: it cannot fit that budget). `leads` reads one metric off it: quantwm's best against
the best of every other method at each budget. On a trace source each point also carries the Keys'
rate-distortion meter (`k_bits_above_bound`, quantwm.evaluation.rate_distortion), an envelope metric like the
others (lower is better); `describe_meter` prints it per budget. The figure draws every point, each method's
Pareto front and the budget lines.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from ..core.methods import method_sweeps
from ..core.methods.base import BUDGETS  # bits per element (stored bytes) the envelope is read at


def sweep_grid(quick: bool = False) -> dict[str, list[dict]]:
    """{method: its presets}: the budget knobs each registered method sweeps on top of bits 2/3/4, declared on its
    class (`Method.sweep`; paper presets keep their configuration except the knob that sets the budget, the
    allocators name each budget of `BUDGETS`, a format that fixes its bits has one point). Every point is labelled
    with its options. `quick`: the methods that declare a `quick_sweep`, with it (`frontier --quick`)."""
    return method_sweeps(quick)


SHIFT = {"world": "place_shift_rate", "trace": "shift_rate"}
HIGHER_IS_BETTER = ("psnr", "ssim")  # every other metric is an error: lower is better
METRICS = ("shift_rate", "place_shift_rate", "psnr", "ssim", "lpips", "tdiff", "warp_error", "attn_out_rel_err",
           "k_bits_above_bound")
METER = "k_bits_above_bound"  # trace sources: the Keys' bits above the Gaussian bound (evaluation.rate_distortion)


def task_key(task: dict) -> str:
    return json.dumps(task, sort_keys=True)


def make_tasks(sources: list[str], grid: dict[str, list[dict]], bits: list[int], target: str = "kv",
               seeds: list[int] = (0, 1), frames: int = 16, budgets: list[float] | None = None) -> list[dict]:
    """Every (source, method, options, bits) point; world points carry the held-out seeds and frames. A format
    that fixes its own bits (nvfp4, int8k-fp8v) or a point that names its own budget gets one point, labelled
    with the first of `bits`. With `budgets`, each method of `grid` gets one point per budget instead, its
    configuration chosen by its budget rule (quantwm.core.budget) for the source's shapes."""
    from ..core.methods import REGISTRY, parse_method_name

    tasks = []
    for source in sources:
        for method, options in grid.items():
            own_bits = not REGISTRY[parse_method_name(method)[0]].takes_bits
            points = ([({}, bits[0], {"budget": float(B)}) for B in budgets] if budgets else
                      [(o, b, {}) for o in options for b in (bits[:1] if own_bits or "budget" in o else bits)])
            for opts, b, extra in points:
                t = {"source": source, "method": method, "options": opts, "bits": b, "target": target, **extra}
                if source == "world":
                    t.update(seeds=list(seeds), frames=frames)
                tasks.append(t)
    return tasks


def source_shape(source: str) -> tuple[int, int]:
    """(head dim, span tokens) of a source's quantized spans: the built-in model's or the trace's."""
    if source == "world":
        from ..world.generate import load_world_model

        c = load_world_model().cfg
        return c.head_dim, c.chunk_frames * c.tokens_per_frame
    from ..evaluation.trace import read_trace

    trace = read_trace(source.removeprefix("trace:"))
    k = next(iter(trace.layers.values()))["k"]
    return k.shape[-1], int(trace.meta.get("chunk_frames", 1)) * trace.tokens_per_frame


def within(tasks: list[dict], max_bits: float) -> tuple[list[dict], int]:
    """(the tasks whose configuration can store at most `max_bits` per element on their source's spans, how many
    were dropped). Bits are measured by a dry encode of one span of the source's shape (quantwm.core.budget), so
    a point that could never enter an envelope up to `max_bits` is not run; a configuration the shape cannot take
    is kept (its task reports why), and so is a deployed format that fixes its own bits (one point each, on
    every frontier)."""
    from ..core.budget import measured_bits
    from ..core.methods import REGISTRY, parse_method_name

    shapes: dict[str, tuple[int, int]] = {}
    kept = []
    for t in tasks:
        base = parse_method_name(t["method"])[0]
        if "budget" in t or "budget" in t["options"] or not REGISTRY[base].takes_bits:  # one point each: kept
            kept.append(t)
            continue
        D, N = shapes.setdefault(t["source"], source_shape(t["source"]))
        opts = {**t["options"], **({"bits": t["bits"]} if REGISTRY[base].takes_bits else {})}
        try:
            bits = [measured_bits(t["method"], tuple(sorted(opts.items())), D, N, kind) for kind in "kv" if kind in t["target"]]
        except ValueError:
            kept.append(t)
            continue
        if min(bits) <= max_bits + 1e-9:
            kept.append(t)
    return kept, len(tasks) - len(kept)


def run_task(task: dict) -> dict:
    """Measure one point (runs in a worker: imports here, one torch thread). A configuration the source
    cannot take (e.g. a group size that does not divide its head dim) gives {"error": message}."""
    try:
        return _measure(task)
    except ValueError as e:
        return {"error": str(e).splitlines()[0]}


def _measure(task: dict) -> dict:
    import torch

    torch.set_num_threads(1)
    opts = tuple(sorted(task["options"].items()))
    budget = (task["budget"],) * 2 if "budget" in task else (None, None)
    if task["source"] == "world":
        from ..world.evaluate import evaluate
        from ..world.generate import load_world_model

        r = evaluate(load_world_model(), [task["method"]], task["target"], task["seeds"], task["frames"],
                     task["bits"], method_options=opts, budget=budget)
        m = _result(r, task)
        if "error" in m:
            return m
        keys = ("bits_per_element", "shift_rate", "place_shift_rate", "psnr", "ssim", "lpips", "tdiff", "warp_error",
                "attn_out_rel_err")
        return {k: m[k] for k in keys + ("configuration",) if k in m}
    from ..evaluation.analyze import analyze_trace
    from ..evaluation.trace import read_trace

    path = task["source"].removeprefix("trace:")
    r = analyze_trace(read_trace(path), [task["method"]], task["target"], task["bits"], method_options=opts,
                      budget=budget)
    m = _result(r, task)
    if "error" in m:
        return m
    keys = ("bits_per_element", "shift_rate", "topk_overlap", "out_rel_err", "k_rel_err", "k_bits_per_element",
            METER, "k_distortion", "k_bound_distortion", "configuration")
    return {k: m[k] for k in keys if k in m}


def _result(report: dict, task: dict) -> dict:
    """The task's method's mean metrics, or {"error"} when a budget left it out, plus the configuration chosen."""
    config = report.get("config", {})
    if task["method"] in config.get("left_out", {}):
        return {"error": config["left_out"][task["method"]]}
    m = dict(report["methods"][task["method"]]["mean"])
    chosen = config.get("configuration", {}).get(task["method"])
    if chosen:
        m["configuration"] = chosen
    return m


def _run_ray(todo: list[dict], address: str, done: Callable, workers: int, temp_dir: Path) -> None:
    """Run the points as Ray tasks. address "local" starts a Ray of `workers` CPUs whose temporary files stay
    in `temp_dir`, and stops it afterwards; any other address joins that cluster."""
    try:
        import ray
    except ImportError as e:
        raise ValueError("--ray needs Ray: pip install 'quantwm[ray]'") from e
    local = address == "local"
    if local:
        temp_dir = temp_dir.resolve()
        if len(str(temp_dir)) > 40:  # Ray puts unix sockets ~65 characters below it; the OS allows 107
            raise ValueError(f"Ray's scratch folder {temp_dir} is too long a path for its sockets; give a shorter "
                             "--out-dir (40 characters or fewer)")
        temp_dir.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a throwaway local cluster: no token under ~/.ray
        ray.init(num_cpus=max(1, workers), include_dashboard=False, log_to_driver=False,
                 _temp_dir=str(temp_dir))
    else:
        ray.init(address=address, log_to_driver=False)
    try:
        remote = ray.remote(num_cpus=1)(run_task)
        pending = {remote.remote(t): t for t in todo}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                done(pending.pop(ref), ray.get(ref))
    finally:
        ray.shutdown()


def sweep(tasks: list[dict], out_dir: str | Path, workers: int = 1, ray_address: str | None = None,
          progress: Callable | None = None) -> dict[str, dict]:
    """Run every task not yet in the manifest; returns the manifest {task key: {"task", "result"}}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "manifest.json"
    manifest: dict = json.loads(path.read_text()) if path.is_file() else {}
    todo = [t for t in tasks if task_key(t) not in manifest]
    total, count = len(tasks), len(tasks) - len(todo)

    def done(task: dict, result: dict) -> None:
        nonlocal count
        manifest[task_key(task)] = {"task": task, "result": result}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(manifest, indent=1, allow_nan=True))
        tmp.replace(path)  # the manifest is complete after every point: nothing is lost on interruption
        count += 1
        if progress:
            progress(count, total, f"{task['method']} {task['bits']}-bit")

    if ray_address:
        _run_ray(todo, ray_address, done, workers, out / "ray")
    elif workers <= 1:
        for t in todo:
            done(t, run_task(t))
    else:
        with ProcessPoolExecutor(workers) as pool:
            for t, r in zip(todo, pool.map(run_task, todo)):
                done(t, r)
    return manifest


def _label(task: dict) -> str:
    opts = ",".join(f"{k}={v}" for k, v in sorted({**task["options"], **({"budget": task["budget"]}
                                                                         if "budget" in task else {})}.items()))
    return f"{task['method']}({opts})" if opts else task["method"]


def summarise(manifest: dict, budgets: tuple[float, ...] = BUDGETS) -> dict:
    """Per source: the shift metric, every point (configurations the source cannot take are left out), and
    the equal-budget `envelope` of those points."""
    by_source: dict[str, list[dict]] = {}
    for e in manifest.values():
        t, r = e["task"], e["result"]
        if "error" in r:  # a configuration this source cannot take: listed in the manifest, not plotted
            continue
        by_source.setdefault(t["source"], []).append({**r, "label": _label(t), "method": t["method"],
                                                      "bits": t["bits"], "options": t["options"]})
    return {source: {"shift_metric": SHIFT["world" if source == "world" else "trace"], "points": points,
                     "envelope": envelope(points, budgets)}
            for source, points in by_source.items()}


def envelope(points: list[dict], budgets: tuple[float, ...] = BUDGETS) -> dict:
    """{"B": {metric: {method: {"point", "bits", "value"}}}}: for each budget B and each metric the points
    carry, every method's best point with bits per element ≤ B. A method with no point within B is absent."""
    out = {}
    for b in budgets:
        fits = [p for p in points if p["bits_per_element"] <= b + 1e-9]
        table = {}
        for metric in (m for m in METRICS if any(m in p for p in points)):
            best = {}
            for p in fits:
                v = p.get(metric)
                if v is None or not math.isfinite(v):
                    continue
                now = best.get(p["method"])
                if now is None or (v > now["value"] if metric in HIGHER_IS_BETTER else v < now["value"]):
                    best[p["method"]] = {"point": p["label"], "bits": p["bits_per_element"], "value": v}
            table[metric] = best
        out[f"{b:g}"] = table
    return out


def leads(env: dict, metric: str, method: str = "quantwm") -> list[dict]:
    """Per budget of an `envelope`: `method`'s best value against the best of every other method within the
    same budget ({"budget", "ours", "other", "ratio" (error metrics), "difference" (higher-is-better ones)});
    "ours" or "other" is None where no point fits."""
    rows = []
    for b, table in env.items():
        best = table.get(metric, {})
        ours = best.get(method)
        others = [dict(v, method=m) for m, v in best.items() if m != method]
        pick = max if metric in HIGHER_IS_BETTER else min
        other = pick(others, key=lambda v: v["value"]) if others else None
        row = {"budget": float(b), "ours": ours, "other": other}
        if ours and other:
            if metric in HIGHER_IS_BETTER:
                row["difference"] = ours["value"] - other["value"]
            else:
                row["ratio"] = ours["value"] / other["value"] if other["value"] else math.inf
        rows.append(row)
    return rows


def describe_leads(rows: list[dict], metric: str, method: str = "quantwm") -> list[str]:
    """One printable line per budget of `leads`."""
    lines = []
    for r in rows:
        head = f"<= {r['budget']:g} bits, {metric}: "
        if r["ours"] is None:
            lines.append(head + f"no {method} point within the budget"
                         + (f" (best other: {r['other']['method']} {r['other']['value']:.4f})" if r["other"] else ""))
        elif r["other"] is None:
            lines.append(head + f"{method} {r['ours']['value']:.4f} ({r['ours']['point']}), no other method fits")
        else:
            cmp = (f"{r['difference']:+.2f}" if "difference" in r else f"ratio {r['ratio']:.2f}")
            lines.append(head + f"{method} {r['ours']['value']:.4f} at {r['ours']['bits']:.2f} bits ({r['ours']['point']}) "
                         f"vs {r['other']['value']:.4f} for {r['other']['point']} at {r['other']['bits']:.2f} bits: {cmp}")
    return lines


def describe_meter(env: dict) -> list[str]:
    """One printable line per budget of an `envelope`: every method's fewest Keys' bits above the Gaussian
    bound among its points within the budget (trace sources; none for a source that does not measure it)."""
    lines = []
    for b, table in env.items():
        best = table.get(METER)
        if best:
            lines.append(f"<= {b} bits, Keys' bits above the Gaussian bound: " + ", ".join(
                f"{m} {v['value']:.2f} ({v['point']} at {v['bits']:.2f} bits)" for m, v in sorted(best.items())))
    return lines


def frontier_figure(summary: dict, path_stem: str | Path, formats: list[str]) -> list[Path]:
    """One panel per source: shift rate against bits per element, every point, each method's Pareto front."""
    from matplotlib.ticker import NullLocator

    from ..evaluation.figures import _figure, save_figure

    sources = list(summary)
    fig = _figure(4.2 * len(sources), 3.6)
    axes = fig.subplots(1, len(sources), squeeze=False)[0]
    for ax, source in zip(axes, sources):
        s = summary[source]
        shift = s["shift_metric"]
        for m in sorted({p["method"] for p in s["points"]}):
            pts = sorted((p["bits_per_element"], p[shift]) for p in s["points"] if p["method"] == m
                         and math.isfinite(p["bits_per_element"]))
            front, low = [], math.inf
            for b, y in pts:
                if y < low:
                    front.append((b, y))
                    low = y
            line, = ax.plot([b for b, _ in front], [y for _, y in front], "-", lw=1.4, label=m)
            ax.plot([b for b, _ in pts], [y for _, y in pts], "o", ms=3, alpha=0.5, color=line.get_color())
        for b in BUDGETS:
            ax.axvline(b, color="0.6", lw=0.6, ls=":", zorder=0)
        ax.set_xscale("log", base=2)
        lo, hi = ax.get_xlim()
        ticks = [b for b in (2, 2.5, 3, 4, 5, 6, 8, 12, 16) if lo <= b <= hi]
        ax.set_xticks(ticks, [f"{b:g}" for b in ticks], fontsize=7)
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("bits per element (stored bytes)", fontsize=8)
        ax.set_ylabel(shift.replace("_", " "), fontsize=8)
        ax.set_title(source if source == "world" else Path(source.removeprefix("trace:")).stem, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6, frameon=False)
    return save_figure(fig, path_stem, formats)
