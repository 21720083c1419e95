"""The Memory control of a request (equal memory within a budget, or a fixed grid of bits) and the flag of a run
over its budget or over BF16's bytes: the Generate, Methods and Trace analysis tabs share both (plain values, no
gradio, no torch)."""
from __future__ import annotations

DEFAULT_BUDGET = 2.5  # bits per element the Generate and Methods tabs open on: every method at equal memory
SIZINGS = ("budget", "bits")  # the Memory control: equal memory (a budget) or a fixed grid of bits


def sized_budget(budget, sizing=None) -> float | None:
    """The budget a request runs within, or None for a fixed grid: `sizing` "budget" checks `budget` (bits per
    element in (0, 16]: 0, empty or 20 is an error naming the explicit other mode); "bits" is None; None (a
    handler called without it) reads as "budget" when a budget is given, else "bits"."""
    if sizing is None:
        sizing = "bits" if budget is None else "budget"
    if sizing not in SIZINGS:
        raise ValueError(f"sizing must be one of {', '.join(SIZINGS)}, got {sizing!r:.60}")
    if sizing == "bits":
        return None
    try:
        return budget_value(budget)
    except ValueError as e:
        raise ValueError(f'{e}; for a fixed grid of bits, choose Memory: "Fixed bits" (sizing="bits")') from None


def memory_flag(summary: dict, budget: float | None) -> str | None:
    """Why a run's memory is out of bounds, or None: its quantized spans over `budget` bits per element, or its
    spans or whole cache bigger than BF16's (the Generate tab's flag, the Methods and trace tables' `fits`).
    `summary`: span_bits_per_element, and cache_mb and bf16_mb where the whole cache is known."""
    bpe, over = summary["span_bits_per_element"], []
    cache, bf16 = summary.get("cache_mb"), summary.get("bf16_mb")  # a trace analysis has the spans' bits alone
    if budget is not None and bpe > budget + 1e-9:
        over.append(f"its quantized spans store {bpe:.2f} bits/element, over the budget of {budget:g}")
    if bpe > 16 + 1e-9 or (cache is not None and bf16 is not None and cache > bf16):
        whole = "" if cache is None or bf16 is None else f"; whole cache {cache:.2f} MB vs {bf16:.2f} MB"
        over.append(f"it stores more than BF16 (spans {bpe:.2f} bits/element vs 16{whole})")
    return "; ".join(over) or None


def budget_value(value) -> float:
    """A budget from the page or the API: a number of bits per element in (0, 16]."""
    from quantwm.core.quant import check_budget

    try:
        b = float(value)
    except (TypeError, ValueError):
        b = None
    return check_budget(b, shown=value)
