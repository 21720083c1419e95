"""Methods at a budget: each method's configuration chosen from a bits-per-element budget and the span's shape
by the method's own rule, never by the evaluated quality (docs/method.md §3.1).

    options, bits = configure("kivi", budget=2.5, head_dim=128, span_tokens=4680, kind="k")

A rule is an ordered list of candidate configurations, richest first, in the order the method's source turns
its knobs; the first whose stored bits per element fit the budget is chosen:

* `rtn`: bits 8, 4, 3, 2, each with groups of 32, 64, 128 channels (more bits before finer groups).
* `kivi`, `kivi-pre`: KIVI's 4 and 2 bits, each with groups of 32, 64, 128 (KIVI's group-size knob).
* `qvg`, `qvg-asym`: residual bits 4, 3, 2 (the grid), each with 256, 64, 16, 6, 2 centroids per span.
* `qvg-pro`: bits 4, 2, each with 256, 64, 16 centroids (4 stages, groups of 16, as QVG-Pro).
* `qvg-budget`: bits 4, 3, 2.
* `quantwm`: its allocator at the budget itself (the `quantwm-alloc` method, QuantWM's `at_budget`;
  core/allocate.py: per channel 0-8 bits by the predicted logit error, for Keys and Values); where its tables
  cannot fit (tiny spans at tiny budgets), its fixed configurations in a stated order: residual bits 4, 3, 2;
  within each, PSAC rank 16, 8, 4, 2 with 8- then 4-bit coefficients, then PSAC off (QSAC alone); groups of
  64, then 128 channels where the head allows.
* `quantwm-paper`: bits 4, 3, 2, each with 256, 16, 4 centroids.
* `span-rtn`: bits 8, 4, 3, 2 (every channel alike).
* `turboquant`: TurboQuant's widths, richest first: 4 bits, its "3.5-bit" split (a quarter of the channels, 32
  of 128, at 4 bits, the rest at 3), 3 bits, its "2.5-bit" split (3 and 2), 2 bits, 1 bit. A split stores a
  second norm per token and its channel list, which the measured bits count (2.5 + 256 / (N·D) at D = 128).
* `oscar`: bits 4, 3, 2 (the release's INT2 last), one group of the head dim. Its rotation is one per layer, fitted
  once and kept by every later span (`Method.layer_constants`): the rule counts a span's own bytes (codes, scales,
  zeros; 2.25 bits per element at 2 bits), and the cache's measured bits count the rotation's D² fp16 values once
  per layer on top (0.15 bits per element over two spans of 4 heads × 1728 tokens at D = 128), so a budget within
  that margin of a width's own bits can be exceeded by the rotation's share.
* `nvfp4` (4.5 bits), `int8k-fp8v` (about 8), `bf16` (16): their one configuration, when it fits.

Bits per element are measured, not estimated: each candidate encodes one seeded Gaussian span of the given
shape, and its stored bytes (codes and every piece of metadata, a PSAC basis counted in full; oscar's per-layer
rotation left out, above) are counted. A baseline's `values="channels"` (span-rtn's Value format) is a fixed option:
its candidates are measured with it, and for Values they are the rule's widths alone (its other knobs do not
apply to span-rtn's format).
A method none of whose candidates fits raises `BudgetError` (a ValueError) naming its cheapest configuration.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from .methods import REGISTRY, SpanContext, get_method, parse_method_name
from .quant import BudgetError

GROUPS = (32, 64, 128)
PSAC_STEPS = ((16, 8), (16, 4), (8, 8), (8, 4), (4, 8), (4, 4), (2, 4))


def candidates(method: str, head_dim: int, kind: str = "k") -> list[dict]:
    """The rule's configurations for `method`, richest first (options for `get_method`); quantwm's Values have
    no PSAC, so their candidates turn the residual's knobs only."""
    base = parse_method_name(method)[0]
    groups = [g for g in GROUPS if head_dim % g == 0]
    if base == "rtn":
        return [{"bits": b, "group_size": g} for b in (8, 4, 3, 2) for g in groups]
    if base in ("kivi", "kivi-pre"):
        return [{"bits": b, "group_size": g} for b in (4, 2) for g in GROUPS]
    if base in ("qvg", "qvg-asym"):
        return [{"bits": b, "n_centroids": k} for b in (4, 3, 2) for k in (256, 64, 16, 6, 2)]
    if base == "qvg-pro":
        return [{"bits": b, "n_centroids": k} for b in (4, 2) for k in (256, 64, 16)]
    if base == "qvg-budget":
        return [{"bits": b} for b in (4, 3, 2)]
    if base == "quantwm-paper":
        return [{"bits": b, "n_centroids": k} for b in (4, 3, 2) for k in (256, 16, 4)]
    if base == "span-rtn":
        return [{"bits": b} for b in (8, 4, 3, 2)]
    if base == "oscar":
        return [{"bits": b} for b in (4, 3, 2)]
    if base == "turboquant":
        k = head_dim // 4  # the paper's 32 outlier channels of 128

        def split(b):
            return [{"bits": b, "outlier_channels": k, "outlier_bits": b + 1}] if k else []
        return [{"bits": 4}, *split(3), {"bits": 3}, *split(2), {"bits": 2}, {"bits": 1}]
    if base in REGISTRY and REGISTRY[base].at_budget == base:  # an allocator (quantwm-alloc, quantwm-channels): the
        # budget itself is its one configuration (`configure` tries it first)
        return []
    if base in ("quantwm", "quantwm-qsac", "quantwm-psac"):
        wide = [g for g in (64, 128) if head_dim % g == 0]
        if kind == "v":
            return [{"bits": b, "group_size": g} for b in (4, 3, 2) for g in wide]
        psac = [{"psac_rank": r, "psac_bits": pb} for r, pb in PSAC_STEPS if r <= head_dim] if base != "quantwm-qsac" else []
        off = [{"psac": False}] if base == "quantwm" else [] if base == "quantwm-psac" else [{}]
        return [{"bits": b, "group_size": g, **p} for b in (4, 3, 2) for g in wide for p in psac + off]
    if base in REGISTRY and not REGISTRY[base].takes_bits:
        return [{}]
    raise ValueError(f"no budget rule for method {method!r}")


@functools.lru_cache(maxsize=4096)
def measured_bits(method: str, options: tuple, head_dim: int, span_tokens: int, kind: str) -> float:
    """Stored bits per element of one span of (span_tokens, head_dim) under `method` with `options`."""
    base = parse_method_name(method)[0]
    m = get_method(base, **dict(options))
    if any(f.name == "iters" for f in dataclasses.fields(m)):  # bytes do not depend on the k-means iterations
        m = dataclasses.replace(m, iters=1)
    g = torch.Generator().manual_seed(0)  # measured on the host: a count of bytes, the same on every device
    x = torch.randn(1, span_tokens, head_dim, generator=g, device="cpu")
    stats = torch.eye(head_dim, device="cpu")[None] + 0.1 * torch.ones(1, head_dim, head_dim, device="cpu")  # PSAC's basis
    enc = m.encode(x, kind, SpanContext(stats=stats, history=1))
    stored = sum(t.numel() * t.element_size() for t in enc.components().values()) if m.layer_constants else enc.nbytes()
    return 8 * stored / x.numel()


def on_span(method: str, options: dict, span: torch.Tensor, kind: str) -> float:
    """Stored bits per element of the real span (S, N, D) under `method` with `options` (its scales and codebooks
    may need a wider dtype than a Gaussian span's, which the stored bytes count)."""
    m = get_method(parse_method_name(method)[0], **options)
    return 8 * m.encode(span, kind, SpanContext()).nbytes() / span.numel()


def configure(method: str, budget: float, head_dim: int, span_tokens: int, kind: str,
              span: torch.Tensor | None = None, options: dict | None = None) -> tuple[dict, float]:
    """(options, measured bits per element) of the richest configuration of `method` within `budget`. With the
    real `span` (S, N, D) (the cache passes its first quantized span), a configuration must also fit on it: one
    whose scales or codebook the data widens past the budget is passed over for the next. `options` (the
    cache's method_options, `--set`) are fixed: every candidate is measured with them, and they win over a
    candidate's own value of the same option."""
    if not budget > 0:
        raise ValueError(f"a budget is a positive number of bits per element, got {budget}")
    if head_dim < 1 or span_tokens < 1:
        raise ValueError(f"a span needs a positive head dim and token count, got {head_dim} and {span_tokens}")
    fixed = dict(options or {})
    get_method(parse_method_name(method)[0], **fixed)  # options the method does not take: a clear error, not a miss
    cheapest, tried = None, []
    allocator = [{"budget": budget}] if REGISTRY[parse_method_name(method)[0]].at_budget else []  # quantwm-alloc
    rule = candidates(method, head_dim, kind)
    if kind == "v" and fixed.get("values") == "channels":  # span-rtn's Value format: only the widths apply
        rule = [{"bits": b} for b in dict.fromkeys(c["bits"] for c in rule if "bits" in c)]
    for opts in allocator + rule:
        opts = {**opts, **fixed}
        if opts in tried:  # the fixed options made two candidates one
            continue
        tried.append(opts)
        try:
            bits = measured_bits(method, tuple(sorted(opts.items())), head_dim, span_tokens, kind)
        except ValueError:  # a configuration this shape cannot take (a group larger than the span, ...)
            continue
        if bits <= budget + 1e-9 and span is not None and "budget" not in opts:
            bits = on_span(method, opts, span, kind)
        if bits <= budget + 1e-9:
            return opts, bits
        cheapest = min(cheapest or (bits, opts), (bits, opts), key=lambda t: t[0])
    where = f"at head dim {head_dim} and spans of {span_tokens} tokens ({'Keys' if kind == 'k' else 'Values'})"
    least = (f"its cheapest configuration stores {cheapest[0]:.3f} ({describe(cheapest[1])})" if cheapest
             else "no configuration fits the shape")
    raise BudgetError(f"{method} cannot fit {budget:g} bits per element {where}: {least}")


def describe(options: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(options.items())) or "its fixed format"


def fit_methods(methods: list[str], budget_k: float | None, budget_v: float | None, head_dim: int, span_tokens: int,
                target: str = "kv", options: dict | None = None) -> tuple[list[str], dict[str, str]]:
    """(the methods that fit their budgets, {left-out method: the one-line reason}) for spans of this shape;
    only the halves `target` quantizes are held to a budget, each with the fixed `options` (`configure`)."""
    kept, left_out = [], {}
    for m in methods:
        if parse_method_name(m)[0] == "bf16":
            kept.append(m)
            continue
        if any(b is not None for b in (budget_k, budget_v)):
            get_method(parse_method_name(m)[0], **(options or {}))  # a bad option is an error, not a left-out method
        try:
            for kind, budget in (("k", budget_k), ("v", budget_v)):
                if budget is not None and kind in target:
                    configure(m, budget, head_dim, span_tokens, kind, options=options)
            kept.append(m)
        except ValueError as e:
            left_out[m] = str(e)
    return kept, left_out
