"""Handlers of the study tabs over the built-in model, Key vs Value and Methods: plain values in, a dict of plain
values out (no torch, no gradio), bad input an "**Error:** ..." status, as in app/world_handlers.py, whose shared
helpers (the run key, the memory flag, the budget, the app's files) they use. `methods_view` is the one source of
the Methods table, its chart and its exported figure; `vbench_finding` is the Methods status's sentence on VBench's
flicker score against tdiff.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from itertools import combinations

from . import plots
from .values import integer
from .world_handlers import DEFAULT_BUDGET, app_files, budget_value, error, exported, memory_flag, rounded, run_key

KV_COLUMNS = ("method", "target", "seed", "k_rel_err", "v_rel_err", "attn_out_rel_err", "place_shift_rate",
              "shift_rate", "psnr", "ssim", "lpips", "tdiff")
# the damage the Key-vs-Value sentence weighs: (column, its name in the sentence, +1 if higher is better)
KV_DAMAGE = (("psnr", "PSNR", 1), ("ssim", "SSIM", 1), ("tdiff", "flicker (tdiff)", -1), ("lpips", "LPIPS", -1),
             ("place_shift_rate", "place shift", -1), ("attn_out_rel_err", "output error", -1))
KV_SEEDS = 4  # held-out worlds the Key-vs-Value study runs on by default
FIX = "quantwm"  # shown beside the baseline: the problem and the fix in one click


def keys_hurt_more(k: dict, v: dict, column: str, sign: int) -> bool:
    """Whether the Keys-only run `k` is strictly worse than the Values-only run `v` in `column`."""
    return sign * (k[column] - v[column]) < 0


def _kv_finding(method: str, ks: list[dict], vs: list[dict]) -> str:
    """What a method's Keys-only rows (ks) and Values-only rows (vs), one pair per seed, show, judged on the values
    the table shows (`rounded`): per damage metric, whether Keys only is worse on every seed, Values only on every
    seed, the two equal on every seed, or the seeds disagree (how many each way); then whether the paper's finding
    (a smaller Key error, yet more damage) holds on every seed, and on which metrics. The mean errors it quotes are
    the table's means (of the unrounded values, `_mean`). Computed, never canned."""
    n = len(ks)
    key_error, value_error = _mean([k["k_rel_err"] for k in ks]), _mean([v["v_rel_err"] for v in vs])
    ks, vs = ([{c: rounded(x) if isinstance(x, float) else x for c, x in r.items()} for r in rows] for rows in (ks, vs))
    smaller = sum(k["k_rel_err"] <= v["v_rel_err"] for k, v in zip(ks, vs))
    count = {name: (sum(keys_hurt_more(k, v, col, sign) for k, v in zip(ks, vs)),
                    sum(keys_hurt_more(v, k, col, sign) for k, v in zip(ks, vs))) for col, name, sign in KV_DAMAGE}
    keys = [name for name, (kw, _) in count.items() if kw == n]
    values = [name for name, (_, vw) in count.items() if vw == n]
    equal = [name for name, (kw, vw) in count.items() if kw == vw == 0]
    mixed = [f"{name} (Keys only worse on {kw}, Values only on {vw})" for name, (kw, vw) in count.items()
             if name not in keys + values + equal]
    out = [f"{method}, {n} seed(s): Key error {key_error:.4g} (Keys only) vs Value error {value_error:.4g} (Values "
           f"only); the Key error is the smaller on {smaller} of {n} seed(s)."]
    if keys:
        out.append(f"Keys only does more damage on every seed in {', '.join(keys)}.")
    if values:
        out.append(f"Values only does more damage on every seed in {', '.join(values)}.")
    if equal:
        out.append(f"The two are equal on every seed in {', '.join(equal)}.")
    if mixed:
        out.append(f"Seeds disagree on {', '.join(mixed)}.")
    if smaller == n and keys:
        out.append(f"So the finding (a smaller Key error, yet more damage) holds on every seed in {', '.join(keys)}"
                   + (f", not in {', '.join(n_ for n_ in count if n_ not in keys)}." if len(keys) < len(count) else "."))
    elif smaller == n:
        out.append("So the finding (a smaller Key error, yet more damage) holds on every seed in none of these metrics.")
    else:
        out.append("The Key error is not the smaller on every seed, so the finding's premise does not hold here.")
    return " ".join(out)


def _mean(values: list[float]) -> float:
    """The mean the table's "mean ± sd" row and the sentence show, of the unrounded per-seed values."""
    return sum(values) / len(values)


def _mean_sd(values: list[float]) -> str:
    m = _mean(values)
    sd = (sum((x - m) ** 2 for x in values) / max(1, len(values) - 1)) ** 0.5
    return f"{m:.4g} ± {sd:.2g}"


def key_value_handler(runs, seed, trajectory, baseline, budget=DEFAULT_BUDGET, frames=32, seeds=KV_SEEDS,
                      progress: Callable | None = None) -> dict:
    """Keys only vs Values only, each within the same budget by its method's rule, for `baseline` and for quantwm
    beside it, on `seeds` held-out worlds from `seed` on: per seed the reconstruction errors beside the damage
    each causes (PSNR, SSIM, tdiff, LPIPS, place shift, output error), their mean ± sd, a chart of them all, and the
    sentence of what holds on every seed and what does not (`_kv_finding`)."""
    from dataclasses import replace

    from quantwm.drivers import studies

    wb = runs.wb
    try:
        first, n = integer(seed, "world seed"), integer(seeds, "seeds")
        if not 1 <= n <= 16:
            raise ValueError(f"seeds must lie in 1..16, got {n}")
        b = budget_value(budget)
        key = replace(run_key(first, trajectory, baseline, "kv", 2, frames), budget=b)
        if key.method == "bf16":
            raise ValueError("bf16 quantizes nothing: pick a quantization method")
        wb.check_frames(key.frames)
        world_seeds = [replace(key, seed=s).seed for s in range(first, first + n)]  # each checked as a world seed
        names = list(dict.fromkeys([key.method, FIX]))
        jobs = [(m, s) for m in names for s in world_seeds]
        chunks = [0]  # progress: the rollouts' chunks (every run generated side by side first), then one per job

        def rollouts(done, total):
            chunks[0] = total
            if progress:
                progress(done, total + len(jobs))
        failed = wb.prefetch([replace(key, method=m, seed=s, target=t) for m, s in jobs for t in "kv"], rollouts)
        if failed:
            raise next(iter(failed.values()))
        rows = []
        with ThreadPoolExecutor(wb.workers) as pool:  # each job's metrics (attention output, LPIPS), side by side too
            parts = pool.map(lambda job: studies.key_vs_value(wb, replace(key, method=job[0], seed=job[1])), jobs)
            for i, ((m, s), part) in enumerate(zip(jobs, parts)):
                rows += [{"method": m, "seed": s, **r} for r in part]
                if progress:
                    progress(chunks[0] + i + 1, chunks[0] + len(jobs))
    except ValueError as e:
        return error(str(e))
    by = {(m, t): [r for r in rows if r["method"] == m and r["target"] == t] for m in names for t in "kv"}
    finding = " ".join(_kv_finding(m, by[(m, "k")], by[(m, "v")]) for m in names)
    table = []
    for (m, t), rs in by.items():
        table += [[m, t, r["seed"], *[rounded(r[c]) for c in KV_COLUMNS[3:]]] for r in rs]
        if len(rs) > 1:
            table.append([m, t, "mean ± sd", *[_mean_sd([r[c] for r in rs]) for c in KV_COLUMNS[3:]]])
    seeds_text = f"seed {first}" if n == 1 else f"seeds {first}-{first + n - 1}"
    return {"status": f"**Within {b:g} bits per element, {seeds_text}, {trajectory}, {frames} frames.** " + finding,
            "header": list(KV_COLUMNS), "rows": table, "per_seed": rows,
            "figure": plots.key_value_figure(by, [("k_rel_err", "Key error (Keys only)"),
                                                  ("v_rel_err", "Value error (Values only)"),
                                                  *[(c, name) for c, name, _ in KV_DAMAGE], ("shift_rate", "top-1 shift")],
                                             f"Keys only (k) vs Values only (v) within {b:g} bits, mean ± sd over "
                                             f"{n} seed(s)")}


# the memory figures by their `CacheMemory` names: the quantized spans' bits and compression, the whole cache's;
# vbench_flicker: VBench's temporal-flickering score of the run's own frames, beside tdiff
METHOD_COLUMNS = ("method", "span_bits_per_element", "fits", "configuration", "span_compression", "cache_compression",
                  "bf16_mb", "cache_mb", "shift_rate", "psnr", "ssim", "lpips", "tdiff", "vbench_flicker", "warp_error")
TEXT_COLUMNS = ("method", "fits", "configuration")  # always shown; every other column only where rows differ
FIGURE_METRICS = ("span_bits_per_element", "shift_rate", "psnr", "ssim", "lpips", "tdiff", "vbench_flicker",
                  "warp_error")
# The Methods tab's default choice: the strongest published baselines, the textbook transform coder in our format
# and ours, those of them the model runs (kvquant quantizes Keys before RoPE, which the built-in model's
# world-coordinate RoPE does not allow). Not oscar: the app's runs do not tell the cache how many chunks it will
# hold (`RunKey.cache_config`, unlike `quantwm eval`), so oscar's rotation counts on every span and it cannot fit
# a budget under 10.25 bits per element. Every method stays selectable.
COMPARED = ("kivi", "kvquant", "turboquant", "qvg", "textbook", "quantwm")


def default_methods(methods: list[str]) -> list[str]:
    """The Methods tab's default choice (`COMPARED`) among `methods`, the ones the model runs."""
    return [m for m in COMPARED if m in methods]


def methods_view(runs, seed, trajectory, target, frames, methods, budget=DEFAULT_BUDGET,
                 progress: Callable | None = None) -> dict:
    """The Methods comparison as shown, the one source of the tab's table, its figure and the exported figure:
    every chosen method on one world at one budget, each configured within it by its own rule (the configuration
    column), in order of the spans' measured bits per element, flagged by `memory_flag` (`fits`). Columns whose
    value is the same in every row are left out of the table and named with their value in `constant`; the
    figure draws the shown metric columns (`FIGURE_METRICS`). A method that cannot fit is named in `left_out`;
    one that ran as another chosen method is shown once (`_one_row_per_run`), each row under its `name`.
    `bf16_vbench`: BF16's VBench flicker score on the world (None without rows). Raises ValueError for bad input."""
    from dataclasses import replace

    from quantwm.drivers import studies

    b = budget_value(budget)
    key = replace(run_key(seed, trajectory, "bf16", target, 2, frames), budget=b)
    left_out: dict = {}
    rows = studies.methods_table(runs.wb, key, list(methods or []), progress, left_out)
    rows = _one_row_per_run(sorted(rows, key=lambda r: r["span_bits_per_element"]))  # in order of measured bits
    for r in rows:  # measured from stored bytes; the rule keeps every method within the budget
        r["fits"] = "OVER" if memory_flag(r, b) else "yes"
        r["label"] = r["name"] + (" (OVER)" if r["fits"] == "OVER" else "")
    varies = [c for c in METHOD_COLUMNS if c in TEXT_COLUMNS or len(rows) < 2 or len({rounded(r[c]) for r in rows}) > 1]
    constant = {c: rounded(rows[0][c]) for c in METHOD_COLUMNS if c not in varies} if rows else {}
    table = [[r["name"] if c == "method" else r[c] if c in TEXT_COLUMNS else rounded(r[c]) for c in varies]
             for r in rows]
    return {"key": key, "budget": b, "rows": rows, "left_out": left_out, "header": varies, "table": table,
            "constant": constant, "metrics": [m for m in FIGURE_METRICS if m in varies],
            "bf16_vbench": studies.reference_vbench(runs.wb, key) if rows else None}


def _offset(gap: float) -> str:
    """A score's distance from BF16's (gap = BF16's minus the method's) in words."""
    return "level with BF16" if gap == 0 else f"{abs(gap):.4f} {'below' if gap > 0 else 'above'} BF16"


def vbench_finding(bf16: float, rows: list[dict]) -> str:
    """One sentence on the rows (`name`, `vbench_flicker`, `tdiff`) as the table shows them (`rounded`): how far each
    one's VBench temporal-flickering score (of its own frames) lies from BF16's, beside its tdiff, then
    `_vbench_verdict`. The two share a unit, the share of the pixel range a frame changes (VBench's score is 1 minus
    the mean change; tdiff is the change beyond BF16's), so VBench's distance from BF16 is at most tdiff, up to
    8-bit rounding. Computed, never canned."""
    b = rounded(bf16)
    rs = sorted(((r["name"], round(b - rounded(r["vbench_flicker"]), 4), rounded(r["tdiff"])) for r in rows),
                key=lambda r: (r[2], r[1]))  # in order of tdiff
    (near, g_near, _), (far, g_far, _) = min(rs, key=lambda r: r[1]), max(rs, key=lambda r: r[1])
    scores = (f"{_offset(g_near)} for {near}" if len(rs) == 1 else
              f"from {_offset(g_near)} ({near}) to {_offset(g_far)} ({far}) for the methods")
    tdiffs = f"{rs[0][2]:.4f} ({rs[0][0]})" + (f" to {rs[-1][2]:.4f} ({rs[-1][0]})" if len(rs) > 1 else "")
    return (f"VBench's temporal-flickering score of each run's own frames is {b:.4f} for BF16 and {scores}, while "
            f"tdiff, in the same unit (the share of the pixel range a frame changes beyond BF16's change), measures "
            f"{tdiffs}: {_vbench_verdict(rs)}")


def _names(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _vbench_verdict(rs: list[tuple]) -> str:
    """Whether VBench's score tells the methods apart as tdiff does, from (name, BF16's score minus the method's,
    tdiff) in order of tdiff: the methods VBench scores as steady as BF16 or steadier although tdiff measures
    flicker; the pairs tdiff tells apart that VBench orders the other way or ties; where neither, that VBench orders
    them as tdiff does, and the share of tdiff's flicker it registers (its distance from BF16 over tdiff)."""
    blind = [n for n, g, t in rs if g <= 0 < t]
    told = [(x, y) for x, y in combinations(rs, 2) if x[2] < y[2]]  # the pairs tdiff tells apart: x flickers less
    against = sum(x[1] >= y[1] for x, y in told)  # VBench puts x as far below BF16 as y, or farther
    worst = rs[-1]
    rank = 1 + sum(g < worst[1] for _, g, _ in rs)  # its place on VBench, 1 the steadiest
    place = "is VBench's steadiest" if rank == 1 else f"ranks {rank} of {len(rs)} on VBench, 1 the steadiest"
    verdict = [f"VBench scores {_names(blind)} as steady as BF16 or steadier although tdiff measures flicker in "
               + ("it" if len(blind) == 1 else "each")] if blind else []
    if against:
        verdict.append(f"{'it' if blind else 'VBench'} orders {against} of the {len(told)} pair(s) of methods tdiff "
                       "tells apart the other way or ties them"
                       + (f" ({worst[0]}, the most flicker by tdiff, {place})" if rank < len(rs) else ""))
        return "; ".join(verdict) + ", so VBench cannot tell these methods apart as tdiff does."
    if blind:
        return verdict[0] + ", so VBench misses that flicker" + (
            ", though it orders the methods as tdiff does." if len(rs) > 1 else ".")
    shares = [g / t for _, g, t in rs if t > 0]
    if not shares:
        return "tdiff measures no flicker, and VBench none either."
    share = f"{min(shares):.0%}" + (f" to {max(shares):.0%}" if len(shares) > 1 else "")
    if len(rs) == 1:
        return f"VBench puts it below BF16 as tdiff does, registering {share} of the flicker tdiff measures."
    return (f"VBench orders the methods as tdiff does, so on these numbers it does tell them apart, though it registers "
            f"only {share} of the flicker tdiff measures.")


def _one_row_per_run(rows: list[dict]) -> list[dict]:
    """The rows, each named (`name`): a method that runs as another chosen method within a budget
    (`studies.at_budget_name`: quantwm runs as quantwm-alloc) and measured the same in every column is one run,
    shown once, in the row of the method that names the other: "quantwm (= quantwm-alloc at a budget)". Where the
    two differ (the allocator could not fit and the method took another configuration), both rows stay."""
    from quantwm.drivers.studies import at_budget_name

    by_method = {r["method"]: r for r in rows}
    same = [c for c in METHOD_COLUMNS if c not in ("method", "fits")]
    merged = set()
    for r in rows:
        r["name"] = r["method"]
    for r in rows:
        alias = at_budget_name(r["method"])
        other = by_method.get(alias)
        if alias != r["method"] and other is not None and all(
                (r[c] == other[c]) if c in TEXT_COLUMNS else rounded(r[c]) == rounded(other[c]) for c in same):
            r["name"] = f"{r['method']} (= {alias} at a budget)"
            merged.add(alias)
    return [r for r in rows if r["method"] not in merged]


def _methods_title(v: dict) -> str:
    """Counts only the rows within the budget, and names those over it apart."""
    k = v["key"]
    over = [r["name"] for r in v["rows"] if r["fits"] == "OVER"]
    n = len(v["rows"]) - len(over)
    return (f"{n} method{'' if n == 1 else 's'} within {v['budget']:g} bits per element"
            + (f", {len(over)} over: {', '.join(over)}" if over else "")
            + f": seed {k.seed}, {k.trajectory}, target {k.target}")


def methods_handler(runs, seed, trajectory, target, frames, methods, budget=DEFAULT_BUDGET,
                    progress: Callable | None = None) -> dict:
    """The Methods tab (`methods_view`): status (with `vbench_finding`), the table (header, rows) and the figure of
    its metric columns."""
    try:
        v = methods_view(runs, seed, trajectory, target, frames, methods, budget, progress)
    except ValueError as e:
        return error(str(e))
    out = "".join(f" Left out: {m} ({why})." for m, why in v["left_out"].items())
    same = ", ".join(f"{c} {val}" for c, val in v["constant"].items())
    over = [r["name"] for r in v["rows"] if r["fits"] == "OVER"]
    vbench = vbench_finding(v["bf16_vbench"], v["rows"]) + " " if v["rows"] else ""
    return {"status": f"**At most {v['budget']:g} bits per element** (Keys and Values each, counted from stored "
                      f"bytes), seed {seed}, {trajectory}, target {target}, {frames} frames. {vbench}Two "
                      "compressions: the quantized spans' and the whole cache's (bf16_mb / cache_mb; cache memory "
                      "counts every quantized byte and the full-precision chunks as BF16)."
                      + (f" **OVER** (over the budget or BF16's bytes): {', '.join(over)}." if over else "")
                      + (f" The same in every row (not shown as columns): {same}." if same else "") + out,
            "header": v["header"], "rows": v["table"], "metrics": v["metrics"],
            "bf16_vbench": v["bf16_vbench"], "figure": _methods_chart(v) if v["rows"] else None}


def _methods_chart(v: dict):
    """The table's metric columns as bars (`plots.bars_figure`), BF16's VBench flicker score a dashed line on that
    metric's panel."""
    fig = plots.bars_figure(v["rows"], "label", v["metrics"], _methods_title(v))
    if "vbench_flicker" in v["metrics"]:
        fig.add_vline(x=v["bf16_vbench"], line_dash="dash", line_width=1, row=1,
                      col=v["metrics"].index("vbench_flicker") + 1,  # labelled at its foot, clear of the panel title
                      label=dict(text="BF16", textposition="start", textangle=0, xanchor="right", font=dict(size=10)))
    return fig


def export_methods_handler(runs, seed, trajectory, target, frames, methods, budget=DEFAULT_BUDGET, formats=("pdf",),
                           progress: Callable | None = None) -> dict:
    """The Methods table as a print figure (`methods_view`: the same methods, metric columns and OVER flags as
    the table with these settings), named after the comparison; "shown" says what it drew."""
    from quantwm.evaluation import figures as FG

    try:
        if not methods:
            raise ValueError("choose at least one method")
        FG.check_formats(list(formats or []))
        runs.wb.limits.check_methods(len(methods), integer(frames, "frames"))
        v = methods_view(runs, seed, trajectory, target, frames, methods, budget, progress)
        if not v["rows"]:
            raise ValueError("no chosen method fits the budget: " + "; ".join(v["left_out"].values()))
        k = v["key"]
        fig = FG.bars_figure(v["rows"], "label", v["metrics"], _methods_title(v),
                             {"vbench_flicker": ("BF16", v["bf16_vbench"])})
        stem = (f"methods-{'-'.join(r['method'] for r in v['rows'])}-seed{k.seed}-{k.trajectory}-{k.target}-"
                f"budget{v['budget']:g}")
        paths = FG.save_figure(fig, os.path.join(app_files().export_dir("methods"), stem), list(formats or []))
    except ValueError as e:
        return error(str(e))
    return {**exported(paths), "shown": {"methods": [r["name"] for r in v["rows"]], "metrics": v["metrics"],
                                          "fits": [r["fits"] for r in v["rows"]]}}
