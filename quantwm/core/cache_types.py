"""The cache's data types: its configuration (`CacheConfig`), its memory report (`CacheMemory`) and the chunk
and per-layer records `KVCache` keeps (quantwm.core.cache has the contract)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .layouts import Layout
from .methods import parse_method_name
from .quant import check_bits
from .stats import QueryStats

LAYOUTS = ("BHLD", "BLHD")
TARGETS = ("k", "v", "kv")
ROPE_MODES = ("post", "pre")
LOWP_FORMATS = (None, "int8", "e4m3")  # CacheConfig.lowp: the fused path's 8-bit products (core/fp8.py)


@dataclass(frozen=True)
class CacheConfig:
    """How a `KVCache` stores and reads its chunks (docs/method.md). Validated here; a bad value raises ValueError
    naming the allowed values.

    method:        registry name (`quantwm methods`); "name+jensen" is the same as jensen=True
    target:        which halves are quantized: "k", "v" or "kv"
    k_bits/v_bits: bits of the Keys' and the Values' codes (2, 3, 4 or 8), for methods that take bits
    sink_chunks:   the first chunks, kept full precision
    recent_chunks: the most recent committed chunks, kept full precision (KIVI's recent window)
    max_chunks:    sliding window: at most this many chunks held, the oldest non-sink span evicted whole
    layout:        the caller's tensor layout, "BHLD" (B, H, L, D) or "BLHD" (B, L, H, D)
    rope:          "post" (keys stored after RoPE) or "pre" (stored before it, rotated at read)
    stats_decay:   None: S is the cumulative mean of the history queries; a number in (0, 1): an EMA
    keep_exact:    also keep the unquantized copy of quantized chunks (diagnostics; not counted in bytes)
    check_inputs:  one NaN/Inf check of q, k, v per call (on a GPU a device flag read at commit); False: none
    memo_decoded:  keep each quantized chunk's decoded copy on the reference path (working memory, not counted)
    seed:          seed of anything random (k-means initialisation), offset per layer and chunk
    method_options: extra options of the method, as ((name, value), ...) (the CLI's --set)
    span_chunks:   committed chunks quantized together as one span (QVG amortises codebooks so)
    jensen:        the +jensen read-path correction of quantized keys' logits (docs/method.md §3)
    budget:        bits per element for Keys and Values: the method configures itself (core/budget.py)
    budget_k/budget_v: the Keys' and the Values' budgets apart (each defaults to `budget`); where the two are equal
                   and a method's allocator moves bits to the Keys (`key_extra_bits`), they are split so
                   (core/budget.py `kind_budgets`)
    lowp:          the fused path's 8-bit products: None, "int8" (QKᵀ INT8, PV e4m3) or "e4m3" (core/fp8.py)
    track_queries: keep the running S of the history queries: None (default) where a quantizing method reads it,
                   True also for diagnostics that ask (`KVCache.query_stats`), False never
    selfcheck:     check each kernel against its reference on first use (core/selfcheck.py); False: trust them
    layers:        the layers whose spans are quantized (None: all); the others keep every chunk full precision and
                   are counted so in memory (layer sensitivity, world/sensitivity.py); `KVCache` checks the range
    held_chunks:   quantized chunks a layer will hold at the end of the run, where the caller knows (a rollout of
                   known length): a budget counts a per-layer constant (oscar's rotation) over them; None: over a
                   window's quantized chunks where there is one, else over the first span (core/budget.py)
    """

    method: str = "bf16"
    target: str = "kv"
    k_bits: int = 2
    v_bits: int = 2
    sink_chunks: int = 1
    recent_chunks: int = 1
    max_chunks: int | None = None
    layout: str = "BHLD"
    rope: str = "post"
    stats_decay: float | None = None
    keep_exact: bool = False
    check_inputs: bool = True  # NaN/Inf check of q, k, v per call (a GPU reads it at commit); False: none
    memo_decoded: bool = False
    seed: int = 0
    method_options: tuple = ()
    span_chunks: int = 1
    jensen: bool = False  # the +jensen read-path correction (docs/method.md §3); "qvg+jensen" is the same config
    budget: float | None = None  # bits per element for Keys and Values: the method configures itself (core/budget.py)
    budget_k: float | None = None  # the Keys' and the Values' budgets apart (each defaults to `budget`)
    budget_v: float | None = None
    lowp: str | None = None  # the fused path's 8-bit products: None, "int8" (QKᵀ INT8, PV e4m3) or "e4m3" (core/fp8.py)
    track_queries: bool | None = None  # keep S: None where a method reads it, True also for diagnostics
    selfcheck: bool = True  # the kernels' first-use self-check against their references (core/selfcheck.py)
    layers: tuple[int, ...] | None = None  # the layers quantized (None: all; the others stay full precision)
    held_chunks: int | None = None  # quantized chunks a layer holds at the run's end, where known (budgets)

    def __post_init__(self):
        base, suffix = parse_method_name(self.method)
        if base == "bf16" and self.jensen:
            raise ValueError("jensen=True corrects quantized keys' logits; bf16 stores keys exactly, so it does not apply")
        # one config however it is spelled: CacheConfig("qvg+jensen") == CacheConfig("qvg", jensen=True)
        object.__setattr__(self, "jensen", bool(self.jensen or suffix))
        object.__setattr__(self, "method", base + ("+jensen" if self.jensen else ""))
        if any(b is not None for b in (self.budget, self.budget_k, self.budget_v)) and any(
                isinstance(o, tuple | list) and len(o) == 2 and o[0] == "budget" for o in self.method_options):
            raise ValueError("the budget is given twice: as the cache's budget and as a method option (--set "
                             "budget=...); give one")
        for name in ("budget_k", "budget_v"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, self.budget)
        for name in ("budget", "budget_k", "budget_v"):
            b = getattr(self, name)
            if b is not None and not (isinstance(b, int | float) and 0 < b < float("inf")):
                raise ValueError(f"{name} must be a positive number of bits per element, got {b!r}")
        if base == "bf16" and any(b is not None and b < 16 for b in (self.budget_k, self.budget_v)):
            raise ValueError("bf16 stores 16 bits per element: it cannot fit a budget below 16")
        check_bits(self.k_bits), check_bits(self.v_bits)
        for name, value, allowed in (("target", self.target, TARGETS), ("layout", self.layout, LAYOUTS),
                                     ("rope", self.rope, ROPE_MODES)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
        if self.lowp not in LOWP_FORMATS:
            raise ValueError(f"lowp must be one of {', '.join(map(repr, LOWP_FORMATS))}, got {self.lowp!r}")
        if self.lowp is not None and self.rope != "post":
            raise ValueError("lowp runs in the fused path, which reads post-RoPE keys: set rope='post'")
        if self.sink_chunks < 0 or self.recent_chunks < 0:
            raise ValueError("sink_chunks and recent_chunks must be >= 0")
        if self.max_chunks is not None and self.max_chunks <= self.sink_chunks:
            raise ValueError(f"max_chunks ({self.max_chunks}) must exceed sink_chunks ({self.sink_chunks})")
        if self.track_queries not in (None, True, False):
            raise ValueError(f"track_queries must be None, True or False, got {self.track_queries!r}")
        if self.span_chunks < 1:
            raise ValueError(f"span_chunks must be >= 1, got {self.span_chunks}")
        if self.held_chunks is not None and (isinstance(self.held_chunks, bool) or not isinstance(self.held_chunks, int)
                                             or self.held_chunks < 1):
            raise ValueError(f"held_chunks must be None or an integer >= 1, got {self.held_chunks!r}")
        if self.layers is not None:
            if isinstance(self.layers, str | int) or not all(isinstance(x, int) and x >= 0 for x in self.layers):
                raise ValueError(f"layers must be None (all) or layer indices >= 0, got {self.layers!r}")
            object.__setattr__(self, "layers", tuple(sorted(set(self.layers))))

    @property
    def base_method(self) -> str:
        """The registry name without the +jensen modifier."""
        return parse_method_name(self.method)[0]


def frame_window(window_frames: int | None, sink_frames: int, chunk_frames: int) -> tuple[int, int | None, bool]:
    """(sink_chunks, max_chunks, rounded) for a model whose rolling cache holds `window_frames` latent frames (the
    chunk being generated included; None: every frame) with `sink_frames` kept at its start: the sink as whole sink
    chunks, the window as at most ceil(W / chunk) - 1 committed chunks beside the current one (at least one past the
    sink). `rounded`: the window or the sink was not whole chunks and was rounded up (the cache evicts whole chunks).
    """
    sink_chunks = math.ceil(sink_frames / chunk_frames)
    if window_frames is None:
        return sink_chunks, None, bool(sink_frames % chunk_frames)
    max_chunks = max(math.ceil(window_frames / chunk_frames) - 1, sink_chunks + 1)
    return sink_chunks, max_chunks, bool(sink_frames % chunk_frames or window_frames % chunk_frames)


@dataclass
class Chunk:
    """One chunk of one layer. `k`/`v` hold full-precision tensors (B, H, N, D) until quantized."""

    index: int
    start: int
    n_tokens: int
    bhd: tuple[int, int, int]
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    k_enc: Layout | None = None
    v_enc: Layout | None = None
    exact_k: torch.Tensor | None = None
    exact_v: torch.Tensor | None = None
    n_chunks: int = 1  # > 1 for a span of several committed chunks quantized together (span_chunks)
    decoded: dict = field(default_factory=dict)

    @property
    def quantized(self) -> bool:
        return self.k_enc is not None or self.v_enc is not None


@dataclass
class LayerState:
    chunks: list[Chunk] = field(default_factory=list)
    current: Chunk | None = None
    next_chunk: int = 0
    next_token: int = 0
    stats: QueryStats | None = None
    method_state: dict = field(default_factory=dict)
    pending: dict[int, QueryStats] = field(default_factory=dict)  # causal_stats: queries not yet in S, by fold point
    unchecked: list = field(default_factory=list)  # (chunk, names, device flag): input checks read at the next commit
    widened: dict = field(default_factory=dict)  # storage dtypes earlier spans widened to (quant.deferred_checks)


@dataclass(frozen=True)
class CacheMemory:
    """What a cache holds, counted from its stored tensors (`KVCache.memory()`; docs/method.md §3.1). It names
    two different figures, and every caller prints them from here (`summary()`):

    * the quantized spans alone: `span_bits_per_element` (codes plus all their metadata) and `span_compression`
      (16 / that): 2.5 bits per element is 6.4x;
    * the whole cache, its full-precision chunks (sink, recent, current) included: `cache_mb` against `bf16_mb`
      and their ratio `cache_compression` (smaller: 2.16 MB vs 12.00 MB is 5.56x).

    stored_bytes:   every stored tensor, full-precision chunks in their own dtype (float32 counts 4 bytes)
    bf16_bytes:     the same tokens' K and V at 2 bytes per element
    by_component:   stored bytes by component ("k.full", "k.codes", "v.scales", ...)
    bits_per_element: of the quantized spans alone (nan when nothing is quantized yet); `span_bits_per_element`
    cache_bits_per_element: of the whole cache as stored (8 stored_bytes / elements)
    runtime_bytes:  state kept beside the cache, in none of the above: "query_stats" (running S), "method_state"
                    (warm-start centroids), "kernel_views" (the read path's tables built at commit)
    cache_bytes:    the whole cache as a BF16 deployment holds it: the quantized spans' bytes plus the
                    full-precision chunks at 2 bytes per element (what `cache_mb` and `cache_compression` count)
    kernel_fallbacks: the kernels of this process that failed their first-use self-check and run their PyTorch
                    reference instead, one line each (core/selfcheck.py); empty when every kernel checked out
    """

    stored_bytes: int
    bf16_bytes: int
    by_component: dict
    bits_per_element: float
    cache_bits_per_element: float
    runtime_bytes: dict
    cache_bytes: int
    kernel_fallbacks: tuple = ()

    FIGURES = ("span_bits_per_element", "span_compression", "cache_mb", "bf16_mb", "cache_compression")
    BYTES = ("stored_bytes", "bf16_bytes", "cache_bytes", "bits_per_element", "cache_bits_per_element")

    @property
    def span_bits_per_element(self) -> float:
        """Bits per element of the quantized spans (nan when nothing is quantized)."""
        return self.bits_per_element

    @property
    def span_compression(self) -> float:
        """16 / span_bits_per_element: how much smaller the quantized spans are than BF16 (1.0 when none)."""
        bpe = self.bits_per_element
        return 16 / bpe if bpe == bpe and bpe > 0 else 1.0

    @property
    def compression(self) -> float:
        """The spans' compression (`span_compression`), by its older name."""
        return self.span_compression

    @property
    def cache_compression(self) -> float:
        """bf16_mb / cache_mb: how much smaller the whole cache is than BF16 (1.0 when empty)."""
        return self.bf16_bytes / self.cache_bytes if self.cache_bytes else 1.0

    @property
    def stored_mb(self) -> float:
        return self.stored_bytes / 2 ** 20

    @property
    def bf16_mb(self) -> float:
        return self.bf16_bytes / 2 ** 20

    @property
    def cache_mb(self) -> float:
        return self.cache_bytes / 2 ** 20

    def figures(self) -> dict:
        """The named figures as plain numbers ({name: value} for `FIGURES`): tables and status lines."""
        return {name: getattr(self, name) for name in self.FIGURES}

    def summary(self) -> str:
        """Both figures with their names: "quantized spans 2.50 bits/element (6.40x); whole cache 2.16 MB vs
        12.00 MB BF16 (5.56x)"."""
        bpe = self.span_bits_per_element
        spans = (f"quantized spans {bpe:.2f} bits/element ({self.span_compression:.2f}x)" if bpe == bpe
                 else "no quantized spans")
        fell = (f"; KERNEL SELF-CHECK FAILED for {len(self.kernel_fallbacks)} kernel(s), their PyTorch references "
                f"ran instead: {' | '.join(self.kernel_fallbacks)}" if self.kernel_fallbacks else "")
        return (f"{spans}; whole cache {self.cache_mb:.2f} MB vs {self.bf16_mb:.2f} MB BF16 "
                f"({self.cache_compression:.2f}x){fell}")

    def to_dict(self) -> dict:
        """What a record keeps (run files' `memory`): the counts it is rebuilt from (`from_dict`) and, for readers
        of the JSON, the named figures."""
        return {**{name: getattr(self, name) for name in self.BYTES}, **self.figures(),
                "kernel_fallbacks": list(self.kernel_fallbacks)}

    @classmethod
    def from_dict(cls, d: dict) -> CacheMemory:
        """A report rebuilt from `to_dict()` (by component and runtime state are not kept)."""
        return cls(int(d["stored_bytes"]), int(d["bf16_bytes"]), {}, float(d["bits_per_element"]),
                   float(d["cache_bits_per_element"]), {}, int(d["cache_bytes"]), tuple(d.get("kernel_fallbacks", ())))


@dataclass(frozen=True)
class SpanView:
    """A frozen look at one span a layer holds (`KVCache.inspect`): chunk index and first token position, its
    size, whether it is quantized and the bytes it stores (Keys and Values, every tensor counted), and the stored
    forms of its Keys and Values where quantized (`k_enc`, `v_enc`: frozen layouts, for diagnostics that read a
    span's basis or widths; None where the half is kept full precision)."""

    index: int
    start: int
    n_tokens: int
    n_chunks: int
    bhd: tuple[int, int, int]
    quantized: bool
    nbytes: int
    k_enc: Layout | None = None
    v_enc: Layout | None = None

