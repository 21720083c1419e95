"""Methods at a budget: each method's configuration chosen from a bits-per-element budget and the span's shape
by the method's own rule, never by the evaluated quality (docs/method.md §3.1).

    options, bits = configure("kivi", budget=2.5, head_dim=128, span_tokens=4680, kind="k")

A rule is an ordered list of candidate configurations, richest first, in the order the method's source turns
its knobs; the first whose stored bits per element fit the budget is chosen. Each method declares its rule on its
class (`Method.budget_candidates`, in its own file under quantwm/core/methods/, which says what it turns); a
method with an allocator (`at_budget`: quantwm, quantwm-channels) runs it at the budget itself first; a format
that fixes its own bits (nvfp4 at 4.5, int8k-fp8v at about 8, bf16 at 16) has its one configuration.

Bits per element are measured, not estimated: each candidate encodes one seeded Gaussian span of the given
shape, and its stored bytes (codes and every piece of metadata, a PSAC basis counted in full) are counted. A
per-layer constant (`Method.layer_constants`: oscar's D x D fp16 rotation, fitted once and kept by every later span)
is counted over `layer_elements`, the elements the layer's quantized spans will hold when the run ends, where the
caller knows them (`CacheConfig.held_chunks`: `quantwm eval` passes its rollout's; a window's quantized chunks);
else over the first span, all a cache can be sure of. The cache's measured bits count that constant once over
everything the layer holds, so this share is what it adds at the run's end: amortised over less, a method fits
at a cheaper configuration than it needed; over more, the run would store more than its budget.
A baseline's `values="channels"` (span-rtn's Value format) is a fixed option: its candidates are measured with it,
and for Values they are the rule's widths alone (its other knobs do not apply to span-rtn's format).
A method none of whose candidates fits raises `BudgetError` (a ValueError) naming its cheapest configuration.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from .methods import REGISTRY, SpanContext, get_method, parse_method_name
from .quant import BudgetError, check_budget


def candidates(method: str, head_dim: int, kind: str = "k") -> list[dict]:
    """The rule's configurations for `method` (its class's `budget_candidates`), richest first (options for
    `get_method`)."""
    try:
        return REGISTRY[parse_method_name(method)[0]].budget_candidates(head_dim, kind)
    except NotImplementedError:
        raise ValueError(f"no budget rule for method {method!r}") from None


@functools.lru_cache(maxsize=4096)
def measured_bits(method: str, options: tuple, head_dim: int, span_tokens: int, kind: str) -> float:
    """Stored bits per element of one span of (span_tokens, head_dim) under `method` with `options`: its own bytes
    (a per-layer constant, `layer_bits`, apart)."""
    return 8 * _measured_bytes(method, options, head_dim, span_tokens, kind)[0] / (span_tokens * head_dim)


def layer_bits(method: str, options: tuple, head_dim: int, span_tokens: int, kind: str, layer_elements: int) -> float:
    """Bits per element of `method`'s per-layer constants (oscar's rotation) counted over `layer_elements`."""
    return 8 * _measured_bytes(method, options, head_dim, span_tokens, kind)[1] / layer_elements


@functools.lru_cache(maxsize=4096)
def _measured_bytes(method: str, options: tuple, head_dim: int, span_tokens: int, kind: str) -> tuple[int, int]:
    """(a span's own stored bytes, its per-layer constants' bytes) of a dry encode of one Gaussian span."""
    base = parse_method_name(method)[0]
    m = get_method(base, **dict(options))
    if any(f.name == "iters" for f in dataclasses.fields(m)):  # bytes do not depend on the k-means iterations
        m = dataclasses.replace(m, iters=1)
    g = torch.Generator().manual_seed(0)  # measured on the host: a count of bytes, the same on every device
    x = torch.randn(1, span_tokens, head_dim, generator=g, device="cpu")
    stats = torch.eye(head_dim, device="cpu")[None] + 0.1 * torch.ones(1, head_dim, head_dim, device="cpu")  # PSAC's basis
    enc = m.encode(x, kind, SpanContext(stats=stats, history=1))
    if not m.layer_constants:
        return enc.nbytes(), 0
    own = sum(t.numel() * t.element_size() for t in enc.components().values())
    return own, sum(t.numel() * t.element_size() for t in enc.shared().values())


def on_span(method: str, options: dict, span: torch.Tensor, kind: str) -> float:
    """Stored bits per element of the real span (S, N, D) under `method` with `options` (its scales and codebooks
    may need a wider dtype than a Gaussian span's, which the stored bytes count)."""
    m = get_method(parse_method_name(method)[0], **options)
    return 8 * m.encode(span, kind, SpanContext()).nbytes() / span.numel()


def configure(method: str, budget: float, head_dim: int, span_tokens: int, kind: str,
              span: torch.Tensor | None = None, options: dict | None = None,
              layer_elements: int | None = None) -> tuple[dict, float]:
    """(options, measured bits per element) of the richest configuration of `method` within `budget`. With the
    real `span` (S, N, D) (the cache passes its first quantized span), a configuration must also fit on it: one
    whose scales or codebook the data widens past the budget is passed over for the next. `options` (the
    cache's method_options, `--set`) are fixed: every candidate is measured with them, and they win over a
    candidate's own value of the same option. `layer_elements`: what a per-layer constant is counted over (the
    module's docstring; None: the first span, `span` or one stream of span_tokens)."""
    if not budget > 0:
        raise ValueError(f"a budget is a positive number of bits per element, got {budget}")
    if head_dim < 1 or span_tokens < 1:
        raise ValueError(f"a span needs a positive head dim and token count, got {head_dim} and {span_tokens}")
    fixed = dict(options or {})
    get_method(parse_method_name(method)[0], **fixed)  # options the method does not take: a clear error, not a miss
    cheapest, tried = None, []
    allocator = [{"budget": budget}] if REGISTRY[parse_method_name(method)[0]].at_budget else []  # quantwm-alloc
    rule = candidates(method, head_dim, kind)
    over = layer_elements or (span.numel() if span is not None else span_tokens * head_dim)
    if kind == "v" and fixed.get("values") == "channels":  # span-rtn's Value format: only the widths apply
        rule = [{"bits": b} for b in dict.fromkeys(c["bits"] for c in rule if "bits" in c)]
    for opts in allocator + rule:
        opts = {**opts, **fixed}
        if opts in tried:  # the fixed options made two candidates one
            continue
        tried.append(opts)
        try:
            key = (method, tuple(sorted(opts.items())), head_dim, span_tokens, kind)
            layer = layer_bits(*key, over)
            bits = measured_bits(*key) + layer
        except ValueError:  # a configuration this shape cannot take (a group larger than the span, ...)
            continue
        if bits <= budget + 1e-9 and span is not None and "budget" not in opts:
            bits = on_span(method, opts, span, kind) + layer
        if bits <= budget + 1e-9:
            return opts, bits
        cheapest = min(cheapest or (bits, opts), (bits, opts), key=lambda t: t[0])
    where = f"at head dim {head_dim} and spans of {span_tokens} tokens ({'Keys' if kind == 'k' else 'Values'})"
    least = (f"its cheapest configuration stores {cheapest[0]:.3f} ({describe(cheapest[1])})" if cheapest
             else "no configuration fits the shape")
    raise BudgetError(f"{method} cannot fit {budget:g} bits per element {where}: {least}")


def describe(options: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(options.items())) or "its fixed format"


def kind_budgets(method: str, budget_k: float | None, budget_v: float | None, target: str = "kv",
                 options: dict | None = None) -> tuple[float | None, float | None]:
    """(Keys' budget, Values' budget) at which `method`'s halves are configured: as given, except where Keys and
    Values are both quantized at the same budget B and the method's allocator moves x bits per element of it from the
    Values to the Keys (its `key_extra_bits`, `quantwm-trellis-v`): B + x and B − x. A Key span and its Value span
    hold as many elements, so the two together store B bits per element. The cache splits so both its own budget
    and an allocator's (`--set budget=B`, or the allocator's default)."""
    if budget_k is None or budget_k != budget_v or target != "kv":
        return budget_k, budget_v
    base = parse_method_name(method)[0]
    if not REGISTRY[base].at_budget:
        return budget_k, budget_v
    extra = getattr(get_method(base, **{**(options or {}), "budget": budget_k}), "key_extra_bits", 0.0)
    if extra and extra >= budget_v:
        raise BudgetError(f"{method} moves {extra:g} bit per element of its budget from the Values to the Keys: a "
                          f"budget of {budget_v:g} leaves its Values none")
    return budget_k + extra, budget_v - extra


def fit_methods(methods: list[str], budget_k: float | None, budget_v: float | None, head_dim: int, span_tokens: int,
                target: str = "kv", options: dict | None = None,
                layer_elements: int | None = None) -> tuple[list[str], dict[str, str]]:
    """(the methods that fit their budgets, {left-out method: the one-line reason}) for spans of this shape;
    only the halves `target` quantizes are held to a budget, each with the fixed `options` and `layer_elements`
    (`configure`), at the budgets `kind_budgets` gives its method."""
    for budget in (budget_k, budget_v):
        if budget is not None:  # a bad budget is the request's error, not every method's reason to be left out
            check_budget(budget)
    kept, left_out = [], {}
    for m in methods:
        if parse_method_name(m)[0] == "bf16":
            kept.append(m)
            continue
        if any(b is not None for b in (budget_k, budget_v)):
            get_method(parse_method_name(m)[0], **(options or {}))  # a bad option is an error, not a left-out method
        try:
            halves = kind_budgets(m, budget_k, budget_v, target, options)
            for kind, budget in zip("kv", halves):
                if budget is not None and kind in target:
                    configure(m, budget, head_dim, span_tokens, kind, options=options, layer_elements=layer_elements)
            kept.append(m)
        except ValueError as e:
            left_out[m] = str(e)
    return kept, left_out
