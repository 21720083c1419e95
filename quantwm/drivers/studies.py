"""Studies over the built-in model's runs, each generated (or reused) through the Workbench `wb`: one method
against BF16 (`compare`, the Generate tab), Keys only against Values only (`key_vs_value`) and every method at one
budget (`methods_table`). Rows carry the clip metrics against BF16 and the cache's memory figures by name
(`CacheMemory.FIGURES`: the quantized spans' bits per element and compression, the whole cache's MB and ratio);
the Methods rows also VBench's temporal-flickering score of each run's own frames (`vbench_flicker`), whose BF16
value `reference_vbench` gives.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from ..core.quant import BudgetError
from ..evaluation import diagnostics as D
from ..evaluation import metrics as M
from ..evaluation import vbench as V
from .runs import Record, RunKey, denormals_flushed
from .views import RunView


def compare(wb, key: RunKey, progress: Callable | None = None) -> dict:
    """BF16 and the method from the same seeds (generated now or from the results cache): per-frame series, the
    summary numbers, both videos' frames and the memory figures (`RunView.compare`)."""
    ref, rec = wb.pair(key, progress)
    return {**RunView.of_records(wb.cfg, ref, rec).compare(), "seconds": ref.seconds + rec.seconds}


def attention_error(wb, rec: Record) -> float:
    """Relative error of the attention output over the cache, stored vs exact K/V, every probed chunk (computed once
    per record, kept in its `metrics`)."""
    if "attn_out_rel_err" not in rec.metrics:
        with denormals_flushed():  # 0.35 s a 32-frame record instead of 2.5 s
            rec.metrics["attn_out_rel_err"] = D.probed_attention_error(
                rec.probes, rec.k_exact, rec.k_stored, rec.v_exact, rec.v_stored,
                wb.cfg.chunk_frames * wb.cfg.tokens_per_frame)
    return rec.metrics["attn_out_rel_err"]


def vbench_flicker(wb, rec: Record) -> float:
    """VBench's temporal-flickering score of the record's own frames from the last context frame on (the pairs
    tdiff covers, as `quantwm eval` takes it), computed once per record, kept in its `metrics`."""
    if "vbench_flicker" not in rec.metrics:
        rec.metrics["vbench_flicker"] = V.temporal_flickering(rec.frames[wb.cfg.context_frames - 1:])
    return rec.metrics["vbench_flicker"]


def reference_vbench(wb, key: RunKey) -> float:
    """`vbench_flicker` of key's BF16 run (generated now unless cached: the Methods rows' reference)."""
    return vbench_flicker(wb, wb.run(key.reference()))


def clip_metrics(wb, ref: Record, rec: Record) -> dict:
    """The study rows' clip metrics of `rec` against its BF16 record `ref` (`RunView.summary` with LPIPS), computed
    once per record: a cached record never changes, so a table shown again, its export and a study re-run reuse
    them (the record keeps them in `metrics`)."""
    if "summary" not in rec.metrics:
        rec.metrics["summary"] = RunView.of_records(wb.cfg, ref, rec).summary(lpips=True)
    return dict(rec.metrics["summary"])


def key_vs_value(wb, key: RunKey, progress: Callable | None = None) -> list[dict]:
    """The method with Keys only and Values only quantized: errors of K and V beside what they cause."""
    rows, keys = [], [replace(key, target="k"), replace(key, target="v")]
    failed = wb.prefetch(keys, progress)  # both runs and BF16 side by side
    if failed:
        raise next(iter(failed.values()))
    for k in keys:
        ref, rec = wb.pair(k)
        ke = sum(M.rel_err(s, e) for s, e in zip(rec.k_stored, rec.k_exact)) / len(rec.k_exact)
        ve = sum(M.rel_err(s, e) for s, e in zip(rec.v_stored, rec.v_exact)) / len(rec.v_exact)
        rows.append({"target": k.target, "k_rel_err": ke, "v_rel_err": ve, "attn_out_rel_err": attention_error(wb, rec),
                     "place_shift_rate": rec.place_shift_rate, **clip_metrics(wb, ref, rec)})
    return rows


def methods_table(wb, key: RunKey, methods: list[str], progress: Callable | None = None,
                  left_out: dict | None = None) -> list[dict]:
    """Every method in `methods` on key's world, trajectory, target and bits, or, when the key carries a
    budget, each method configured within it (its "configuration" column says how; a method that cannot
    fit is skipped and its one-line reason put in `left_out`). Rows come in order of bits per element. Each row
    carries the clip metrics against BF16 (`clip_metrics`) and VBench's flicker score of its own frames
    (`vbench_flicker`; BF16's: `reference_vbench`)."""
    if not methods:
        raise ValueError("choose at least one method")
    left_out = left_out if left_out is not None else {}
    keys = [replace(key, method=m) for m in methods]  # validates every name before any work
    wb.check_frames(key.frames)
    if key.budget is not None:
        from ..core.budget import fit_methods

        span = wb.cfg.chunk_frames * wb.cfg.tokens_per_frame
        fitting, out = fit_methods(list(methods), key.budget, key.budget, wb.cfg.head_dim, span, key.target)
        left_out.update(out)
        keys = [k for k in keys if k.method in fitting]
    wb.limits.check_methods(len(keys), key.frames)
    failed = wb.prefetch(keys, progress)  # every method and BF16, side by side
    rows = []
    for k in keys:
        if isinstance(failed.get(k), BudgetError):  # fits a Gaussian span of the shape, not this world's data
            left_out[k.method] = str(failed[k]).splitlines()[0]
            continue
        if k in failed or k.reference() in failed:
            raise failed.get(k) or failed[k.reference()]
        ref, rec = wb.pair(k)
        rows.append({"method": k.method, **clip_metrics(wb, ref, rec), "vbench_flicker": vbench_flicker(wb, rec),
                     "configuration": configuration(wb, k)})
    return sorted(rows, key=lambda r: r["span_bits_per_element"]) if key.budget is not None else rows


def at_budget_name(method: str) -> str:
    """The method `method` runs as within a budget: its family's allocator where the family names one
    (`Method.at_budget`: quantwm runs as quantwm-alloc, a "+jensen" suffix kept), else itself."""
    from ..core.methods import REGISTRY, parse_method_name
    from ..core.methods.base import JENSEN_SUFFIX

    base, jensen = parse_method_name(method)
    return (REGISTRY[base].at_budget or base) + (JENSEN_SUFFIX if jensen else "")


def configuration(wb, key: RunKey) -> str:
    """What the key's generated run ran as: its grid at `bits`, or what its cache chose within the budget for
    each quantized half (read from the run's record: the choice the cache made on its first span); where the
    channels took widths of their own (quantwm's allocator), their histogram over every stored span."""
    if key.method == "bf16":
        return "bf16"
    if key.budget is None:
        return f"{key.bits}-bit"
    rec = wb.record(key.id)
    chosen, widths = rec.budget_choice or {}, rec.channel_bits or {}
    return "; ".join(f"{kind}: {'allocator, ' + bits_histogram(widths[kind]) if widths.get(kind) else chosen.get(kind, '?')}"
                     for kind in "kv" if kind in key.target)


def bits_histogram(counts: dict) -> str:
    """{bits: channels} as one short line: "bits per channel 0:4% 1:11% 2:52% 3:28% 4:5%" (shares of every
    (stream, channel) of every stored span; "<1%" for a width some but under 0.5% of them took)."""
    total = sum(counts.values())
    share = {b: n / total for b, n in sorted(counts.items()) if n}
    return "bits per channel " + " ".join(f"{b}:{'<1%' if s < 0.005 else f'{s:.0%}'}" for b, s in share.items())
