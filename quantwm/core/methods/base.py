"""The one interface every quantization method implements, and the registry keyed by name.

A method only says how a span is encoded and decoded. Bookkeeping (chunks, sink, recent window,
commit, eviction, statistics) lives once, in `quantwm.core.cache`.

    enc = method.encode(x, kind="k", ctx=SpanContext(stats=S, state=state))   # x: (S, N, D) -> a Layout
    x_hat = enc.decode()                                                       # (S, N, D) float32
    enc.nbytes()                                                               # every stored tensor

What a method returns is a typed span layout (quantwm.core.layouts): it decodes itself, counts its bytes and
gives the fused kernel its view, so a stored span is read without asking the method that wrote it.

A stream is one (batch, head) of one layer; S streams are encoded together. `kind` is "k" or "v":
methods such as KIVI and QuantWM treat Keys and Values differently.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..layouts import Layout
from ..quant import check_finite


@dataclass
class SpanContext:
    """What a method may use when encoding a span.

    stats:   (S, D, D) history-Query second moment in the stored keys' space (identity when no history).
    state:   per-(layer, kind) mutable dict that persists across spans (k-means warm start).
    seed:    seed for anything random (k-means initialisation).
    history: how many history queries `stats` holds (0: none yet, stats is the identity).
    span:    scratch shared by this span's Keys' and Values' encodes, which the cache runs in that order with one
             context (oscar's key weights for its Value covariance); it ends with the span.
    window:  with a rolling window, how many quantized spans it holds at least (None: no window, nothing is
             evicted): a span reusing stored state that an evicted span paid for pays 1/window of it.
    aim:     aim(n) -> S (S, D, D) re-aimed at the frames of the n chunks that read this span next (3-D RoPE turns a
             query's temporal pairs with its frame), or None where the cache cannot (no `frame_shift`).
    """

    stats: torch.Tensor | None = None
    state: dict = field(default_factory=dict)
    seed: int = 0
    history: int = 0
    span: dict = field(default_factory=dict)
    window: int | None = None
    aim: Callable[[int], torch.Tensor | None] | None = None

    def stats_or_identity(self, S: int, D: int, device: torch.device) -> torch.Tensor:
        if self.stats is None:
            return torch.eye(D, device=device).expand(S, D, D)
        if self.stats.shape != (S, D, D):
            raise ValueError(f"query statistics have shape {tuple(self.stats.shape)}, expected {(S, D, D)}")
        return self.stats.float()


class Method:
    """Base class: subclasses set `name` and implement `encode`, which returns the span's layout."""

    name = "method"
    quantized = True
    uses_queries = False  # True: encoding reads the history-query statistics S (QSAC / PSAC)
    pre_rope = False  # True: the method is defined on keys stored before RoPE (the cache must run rope="pre")
    takes_bits = True  # False: the format fixes its own bits (bf16, nvfp4, int8k-fp8v); k_bits/v_bits do not apply
    at_budget: str | None = None  # the registry name of this family's method that takes `budget=B` (its allocator)
    source = ""  # where the method comes from: its paper's arXiv id and released code, or "this project"
    layer_constants = False  # True: its layouts' shared tensors are one per layer, computed once and kept by every
    # later span (oscar's rotation): the cache counts those once per layer; its budget rule says how it counts them
    sweep: tuple[dict, ...] = ()  # the frontier's presets (drivers/frontier.py): options it sweeps at every --bits
    # (a preset naming its budget, or a format fixing its bits, runs once); () : not swept. Read from the class
    # itself, never a parent's (a preset sweeps what its own class says), as `source`
    quick_sweep: tuple[dict, ...] = ()  # `frontier --quick`'s presets; () : the full `sweep`

    @classmethod
    def budget_candidates(cls, head_dim: int, kind: str) -> list[dict]:
        """The budget rule (quantwm.core.budget.configure): constructor options, richest first, in the order the
        method's source turns its knobs; the first whose measured bits fit the budget is chosen. A format that fixes
        its own bits has its one configuration; a method that takes bits declares its rule (NotImplementedError)."""
        if not cls.takes_bits:
            return [{}]
        raise NotImplementedError(f"{cls.__name__} declares no budget rule")

    def encode(self, x: torch.Tensor, kind: str, ctx: SpanContext) -> Layout:
        raise NotImplementedError

    def validate(self, x: torch.Tensor, kind: str) -> None:
        """Every encode starts here: a finite, non-empty (S, N, D) span and kind 'k' or 'v'."""
        if kind not in ("k", "v"):
            raise ValueError(f"kind must be 'k' or 'v', got {kind!r}")
        if x.dim() != 3 or 0 in x.shape:
            raise ValueError(f"a span must be a non-empty (S, N, D) tensor, got shape {tuple(x.shape)}")
        check_finite(x, "span to encode")

    def decode(self, enc: Layout) -> torch.Tensor:
        """The span rebuilt (S, N, D) float32: the layout decodes itself."""
        return enc.decode()

    def grid(self) -> str:
        """One line naming the quantization grid, for reports."""
        return "bf16"


REGISTRY: dict[str, type] = {}
BUDGETS = (2.25, 2.5, 2.75, 3.0, 3.5, 4.0)  # bits per element the frontier's envelope is read at (an allocator's sweep)
JENSEN_SUFFIX = "+jensen"


def register(name: str):
    def deco(cls):
        REGISTRY[name] = cls
        return cls
    return deco


def known_methods() -> list[str]:
    return sorted(REGISTRY) + [n + JENSEN_SUFFIX for n in sorted(REGISTRY) if n != "bf16"]


def method_sources() -> list[tuple[str, str, str]]:
    """(name, bits, source) of every registered method, by name: bits "bits" where `bits` applies, else "fixed"
    (`quantwm methods` prints them). A preset's source is its own class's `source`, never its parent's (a preset
    built on another's code is not that one's paper); "-" where none is given."""
    return [(n, "bits" if c.takes_bits else "fixed", vars(c).get("source") or "-") for n, c in sorted(REGISTRY.items())]


def method_sweeps(quick: bool = False) -> dict[str, list[dict]]:
    """{name: its frontier presets} of every registered method that declares a `sweep` on its own class, by name;
    `quick`: its `quick_sweep` where it declares one, and only those methods (`frontier --quick`)."""
    attr = "quick_sweep" if quick else "sweep"
    return {n: list(vars(c)[attr]) for n, c in sorted(REGISTRY.items()) if vars(c).get(attr)}


def parse_method_name(name: str) -> tuple[str, bool]:
    """'qvg+jensen' -> ('qvg', True). Unknown names raise ValueError listing the known ones."""
    base, jensen = (name[: -len(JENSEN_SUFFIX)], True) if name.endswith(JENSEN_SUFFIX) else (name, False)
    if base not in REGISTRY or (jensen and base == "bf16"):
        raise ValueError(f"unknown method {name!r}; known methods: {', '.join(known_methods())}")
    return base, jensen


def get_method(name: str, **overrides) -> Method:
    """Build a method by registry name (a '+jensen' suffix is accepted and ignored here)."""
    base, _ = parse_method_name(name)
    cls = REGISTRY[base]
    if "budget" in overrides and cls.at_budget:  # `--set budget=B`: the family's allocator, which takes the options
        cls = REGISTRY[cls.at_budget]               # it has (budget, qsac, its centroids); the fixed configuration's
        own = {f.name for f in dataclasses.fields(cls)}  # (lam, psac, ...) do not apply to it
        overrides = {k: v for k, v in overrides.items() if k in own}
    try:
        return cls(**overrides)
    except TypeError as e:
        raise ValueError(f"bad option for method {base!r}: {e}") from None


def make_method(name: str, bits: int, options: dict | None = None) -> Method:
    """The method a cache runs: `name` at `bits` with extra options; a format that fixes its own bits (bf16,
    nvfp4, int8k-fp8v) takes no `bits` (its bits per element are counted from its stored bytes as always)."""
    base, _ = parse_method_name(name)
    if not REGISTRY[base].takes_bits:
        return get_method(base, **({} if base == "bf16" else options or {}))
    return get_method(base, bits=bits, **(options or {}))
