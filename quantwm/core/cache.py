"""The chunked, quantized KV cache that a causal video model's attention talks to.

Contract (Self-Forcing family: Matrix-Game-2, Causal-Forcing, LingBot-World): each chunk is denoised in a
few passes, every pass overwriting the current chunk's K/V, then a clean pass writes it once more and
commits it. So, per layer:

    out = cache.attend(layer, q, k, v, chunk=i)               # a denoising pass: write chunk i, attend
    out = cache.attend(layer, q, k, v, chunk=i, commit=True)  # the clean pass: same, then commit chunk i

* `write` at the current chunk's position replaces it; committed chunks are never rewritten.
* `commit` appends the chunk to history. A committed chunk is quantized exactly once, when it leaves the
  full-precision set: the first `sink_chunks` chunks and the `recent_chunks` most recent committed chunks
  stay unquantized (in the dtype they were written in; "BF16" in the paper).
* `span_chunks` > 1 quantizes that many committed chunks together, as one span, once all of them have left
  the full-precision set (QVG amortises its codebooks so: Self-Forcing quantizes 8 chunks at once); they stay
  full precision until then.
* Sliding-window eviction (`max_chunks`) drops whole chunks (a multi-chunk span as a whole), oldest non-sink
  first.
* A method with `causal_stats` (quantwm-paper) lets a chunk's queries into S only once the chunks before it
  are quantized: the span of chunk c is quantized with the queries of chunks < c.
* Layouts (B, H, L, D) ("BHLD") or (B, L, H, D) ("BLHD"); outputs come back in the caller's layout.
* Keys stored post-RoPE (default) or pre-RoPE, with `rope(x, positions, inverse=False)` applied at read.
* The queries that attend to the cache feed the running S = E[q qᵀ] per (layer, head) that QSAC, PSAC and the
  allocator use, kept in the post-RoPE space (only where a quantizing method reads it or
  `CacheConfig(track_queries=True)` asks, for diagnostics such as query energy spectra); a pre-RoPE span is
  quantized with mean_p R_pᵀ S R_p over its key positions p (the space its stored keys meet queries in).
  `KVCache(config, n_layers, frame_shift=FrameShift(D, tokens_per_frame, theta))` names the model's 3-D RoPE:
  the cache then also keeps S with each chunk's queries moved back to frame 0, and offers the allocator S
  re-aimed at the frames of the chunks that read a span next (`SpanContext.aim`; docs/method.md §2.9).
* A method may hold a span's few loud tokens apart in BF16 (the allocator's `TokenSplit`): the cache splits the
  span's Values at the same tokens, and attention reads the loud tokens as a BF16 span of their own.
* `attend` on CUDA (or with QUANTWM_KERNELS=triton, see quantwm.core.backend) runs the fused path of
  quantwm.core.attention: one online softmax over the stored spans, nothing decompressed. The reference path
  (CPU, QUANTWM_KERNELS=ref, pre-RoPE keys, formats without a kernel) dequantizes everything, then runs
  scaled_dot_product_attention (`memo_decoded=True` keeps each quantized chunk's decoded copy as working
  memory, outside nbytes). With `+jensen` methods the logit of every quantized key j gets
  -(τ²/24) Σ_i q_i² Δ_{j,i}².

The public surface a model author (and every adapter and diagnostic in this package) uses; nothing outside
this module and its halves mixed into `KVCache` (quantwm/core/accounting.py: what it stores; query_history.py: the
running S; cache_reads.py: what attention reads) touches the cache's private fields:

    cache.n_layers; cache.config; cache.rope     # layers, configuration, the RoPE applied at read (or None)
    cache.frame_shift                    # the model's 3-D RoPE as a frame shift (or None), for re-aiming S
    cache.quantize_k; cache.quantize_v; cache.uses_queries   # which halves are quantized; whether S is read
    cache.tracks_queries                 # whether the cache keeps S (uses_queries, or track_queries=True)
    cache.attend(layer, q, k, v, chunk, commit=False)    # write + attend (+ commit), the usual call
    cache.write(layer, k, v, chunk); cache.commit(layer, chunk)   # the same in steps
    cache.evict_span(layer, index)       # drop a committed span (a host that runs its own window)
    cache.observe(layer, q)              # feed queries into S without attending (e.g. from a hook)
    cache.load_query_stats(layer, second, count)         # or load S from a calibration file
    cache.seq_len(layer)                 # tokens the layer holds (committed spans and the current chunk)
    cache.inspect(layer)                 # those spans, oldest first, as frozen `SpanView`s
    cache.positions(layer)               # absolute token position of every held token, in cache order
    cache.keys(layer) / values(layer)    # what attention reads (exact=True: the unquantized copy)
    cache.query_stats(layer); cache.key_steps(layer)
    cache.next_chunk(layer); cache.next_token(layer)    # where the next chunk goes (chunk index, token position)
    cache.reset()                        # empty every layer for a new video
    cache.quantizes_layer(layer)         # whether the layer's spans are quantized (CacheConfig.layers)
    cache.head_bits(layer, which)        # (H, D) bits of each head's channels in quantized spans (the allocator)
    cache.channel_bits(which)            # {bits: channels} over every quantized span (the allocator's widths)
    cache.memory()                       # `CacheMemory`: stored and BF16 bytes, bits per element, compression
    cache.nbytes(); bytes_by_component(); quantized_bytes(); runtime_bytes(); bits_per_element()

`CacheConfig(method="qvg", jensen=True)` and `CacheConfig(method="qvg+jensen")` are the same configuration.
`CacheConfig(method="kivi", budget=2.5)` lets the method choose its configuration from the budget (bits per
element from stored bytes; `budget_k`/`budget_v` apart) at the first quantized span, by its rule in
quantwm.core.budget; `cache.configuration` says what it chose (`cache.budget_choice`: the options alone), and a
method that cannot fit raises `BudgetError` (a ValueError).
Inputs are checked at the boundary: shapes and dtypes always, NaN/Inf once per call: read at once on the CPU; on
an accelerator kept as a device flag and read at the layer's next commit, with the span's own checks (one host
read a commit), so a pass over a warm cache never waits on the device. `CacheConfig(check_inputs=False)` drops the
input check (CUDA graphs, torch.compile: no flag is kept). Quantizing a span at commit still validates what it
encodes (quantwm.core.quant.DeferredChecks).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import selfcheck
from .accounting import MemoryAccounting
from .attention import fused_attention, jensen_bias
from .backend import use_kernels
from .cache_reads import CacheReads
from .cache_types import LAYOUTS, ROPE_MODES, TARGETS, CacheConfig, CacheMemory, Chunk, LayerState, SpanView
from .layouts import TokenSplit, split_tokens
from .methods import make_method
from .quant import DeferredChecks, check_finite, deferred_checks, defers_checks, remembering
from .query_history import QueryHistory
from .rope import FrameShift

__all__ = ["CacheConfig", "CacheMemory", "Chunk", "KVCache", "LAYOUTS", "PUBLIC", "ROPE_MODES", "SpanView", "TARGETS",
           "jensen_bias"]
# The contract: every name code outside quantwm/core may use on a KVCache (tests/test_cache.py checks the uses).
PUBLIC = ("n_layers", "config", "rope", "quantize_k", "quantize_v", "uses_queries", "tracks_queries", "configuration",
          "budget_choice", "frame_shift",
          "attend", "write",
          "commit", "evict_span", "observe", "load_query_stats", "seq_len", "inspect", "positions", "keys", "values",
          "query_stats", "key_steps", "logit_bias", "next_chunk", "next_token", "reset", "memory", "nbytes",
          "bytes_by_component", "runtime_bytes", "bits_per_element", "cache_bits_per_element", "quantized_bytes",
          "quantizes_layer", "head_bits", "channel_bits")

RopeFn = Callable[..., torch.Tensor]


class KVCache(MemoryAccounting, QueryHistory, CacheReads):
    """Chunk-granular KV cache for `n_layers` layers; see the module docstring for the contract."""

    def __init__(self, config: CacheConfig, n_layers: int, rope: RopeFn | None = None,
                 frame_shift: FrameShift | None = None):
        if config.rope == "pre" and rope is None:
            raise ValueError("rope='pre' stores keys before RoPE: pass the rope function to apply at read")
        if frame_shift is not None and not isinstance(frame_shift, FrameShift):
            raise ValueError(f"frame_shift must be a quantwm.core.rope.FrameShift, got {type(frame_shift).__name__}")
        self.config, self.rope, self.frame_shift = config, rope, frame_shift
        self._make_methods()
        self.quantize_k = self.k_method.quantized and config.target in ("k", "kv")
        self.quantize_v = self.v_method.quantized and config.target in ("v", "kv")
        self.causal_stats = bool(getattr(self.k_method, "causal_stats", False))
        self.tracks_queries = config.track_queries if config.track_queries is not None else self.uses_queries
        if self.uses_queries and not self.tracks_queries:
            raise ValueError(f"{config.method} reads the history queries' statistics: track_queries=False cannot apply")
        if self.k_method.pre_rope and self.quantize_k and config.rope != "pre":
            raise ValueError(f"{config.method} quantizes keys before RoPE: it needs CacheConfig(rope='pre') and the "
                             "model's rope function (the built-in world model stores post-RoPE keys only)")
        if config.layers is not None and any(x >= n_layers for x in config.layers):
            raise ValueError(f"layers {config.layers} out of range: the cache has {n_layers} layers (0..{n_layers - 1})")
        self.layers = [LayerState() for _ in range(n_layers)]

    def _make_methods(self) -> None:
        """The Keys' and Values' methods from the config (a cache budget replaces them at the first span). Without
        one, an allocator run at its own budget (`--set budget=B` or its default) that moves bits to the Keys
        (`key_extra_bits`) splits it as a cache budget would (quantwm.core.budget.kind_budgets)."""
        c = self.config
        opts = dict(c.method_options)
        self.k_method = make_method(c.method, c.k_bits, opts)
        self.v_method = make_method(c.method, c.v_bits, opts)
        own_budget = c.budget_k is None and c.budget_v is None
        if own_budget and getattr(self.k_method, "key_extra_bits", 0) and c.target == "kv":
            from .budget import kind_budgets

            b = self.k_method.budget
            k, v = kind_budgets(c.method, b, b, "kv", opts)
            self.k_method = dataclasses.replace(self.k_method, budget=k)
            self.v_method = dataclasses.replace(self.v_method, budget=v)
        self._chosen: dict[str, str] = {}  # kind -> the configuration a budget chose (at the first span)
        self._chosen_options: dict[str, str] = {}  # kind -> the same choice's options alone

    @property
    def configuration(self) -> dict[str, str]:
        """{"k": ..., "v": ...}: each half's method and configuration as run (a budget's choice once the first
        span is quantized; docs/method.md §3.1)."""
        out = {}
        for kind, method, on in (("k", self.k_method, self.quantize_k), ("v", self.v_method, self.quantize_v)):
            out[kind] = self._chosen.get(kind) or (f"{self.config.method}: {method.grid()}" if on else "bf16 (not quantized)")
        return out

    @property
    def budget_choice(self) -> dict[str, str]:
        """{kind: options} of each half a budget configured ("bits=2, group_size=64"; empty before the first
        quantized span): what `configuration` says, without its prose."""
        return dict(self._chosen_options)

    def _budgeted(self, kind: str, span: torch.Tensor) -> None:
        """Configure `kind`'s method from its budget at the first span (S, N, D): its shape, and its data, which
        the chosen configuration must fit too (quantwm.core.budget.configure)."""
        c = self.config
        if kind in self._chosen or (c.budget_k if kind == "k" else c.budget_v) is None:
            return
        from .budget import configure, describe, kind_budgets

        budget = dict(zip("kv", kind_budgets(c.base_method, c.budget_k, c.budget_v, c.target,
                                             dict(c.method_options))))[kind]
        S, N, D = span.shape
        window = c.max_chunks - c.sink_chunks - c.recent_chunks if c.max_chunks is not None else None
        held = c.held_chunks or (window if window and window >= c.span_chunks else None)
        layer_elements = S * D * N * held // c.span_chunks if held else span.numel()  # chunks of N / span_chunks tokens
        opts, bits = configure(c.base_method, budget, D, N, kind, span, dict(c.method_options), layer_elements)
        rest = {k: v for k, v in opts.items() if k != "bits"}
        method = make_method(self.config.method, opts.get("bits", 2), {**dict(self.config.method_options), **rest})
        if kind == "k":
            self.k_method = method
        else:
            self.v_method = method
        self._chosen_options[kind] = describe(opts)
        self._chosen[kind] = (f"{self.config.method} at {budget:g} bits: {describe(opts)} "
                              f"({bits:.3f} bits per element on a span of {N} tokens x {D})")

    # ---- layout ---------------------------------------------------------------------------------
    def _in(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """The internal (B, H, L, D) view of a caller's tensor; shapes and dtypes are checked (no host sync)."""
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D in layout {self.config.layout}, got shape {tuple(x.shape)}")
        if not torch.is_floating_point(x):
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
        return x.transpose(1, 2) if self.config.layout == "BLHD" else x

    def _check(self, layer: int, chunk: int, **tensors: torch.Tensor) -> None:
        """The boundary's NaN/Inf check of a call's tensors (none with check_inputs=False). On the CPU it is read
        at once; on an accelerator it is a flag kept on the device and read with the layer's next commit (one host
        read there for every call since), so an attend never waits on the device."""
        if not self.config.check_inputs:
            return
        ok = torch.stack([torch.isfinite(t).all() for t in tensors.values()]).all()
        if defers_checks(ok):
            self._layer(layer).unchecked.append((chunk, tuple(tensors), ok))
        elif not bool(ok):
            for name, t in tensors.items():
                check_finite(t, name)  # names the first bad tensor and counts its bad values

    def _read_checks(self, layer: int, st: LayerState, checks: DeferredChecks | None = None) -> bool:
        """Read the layer's deferred input checks and `checks` (a span's) in one host read: True when all hold;
        raises for the first call whose inputs held NaN/Inf."""
        unchecked, st.unchecked = st.unchecked, []
        flags = DeferredChecks()
        flags.flags = [ok for _, _, ok in unchecked] + (checks.flags if checks is not None else [])
        if flags.passed():
            return True
        if unchecked and not bool(torch.stack([ok for _, _, ok in unchecked]).all()):  # the failure path
            for chunk, names, ok in unchecked:  # which call's inputs: read each flag
                if bool(ok):
                    continue
                raise ValueError(f"layer {layer}: the {'/'.join(names)} written for chunk {chunk} contain NaN/Inf "
                                 "(checked on the device, read at this commit)")
        return False

    def _out(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2) if self.config.layout == "BLHD" else x

    def _layer(self, layer: int) -> LayerState:
        if not 0 <= layer < len(self.layers):
            raise ValueError(f"layer {layer} out of range: the cache has {len(self.layers)} layers")
        return self.layers[layer]

    # ---- writing --------------------------------------------------------------------------------
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, chunk: int) -> None:
        """Write (overwrite) the current chunk's K/V (layout of the config) at chunk position `chunk`."""
        self._write(layer, k, v, chunk, check=True)

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor, chunk: int, check: bool) -> None:
        st = self._layer(layer)
        k, v = self._in(k, "k"), self._in(v, "v")
        if check:
            self._check(layer, chunk, k=k, v=v)
        if k.shape != v.shape or k.shape[2] == 0:
            raise ValueError(f"k and v must have the same non-empty shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        if chunk < st.next_chunk:
            raise ValueError(f"chunk {chunk} of layer {layer} is already committed; committed chunks are never rewritten")
        if chunk > st.next_chunk:
            raise ValueError(f"chunk {chunk} skips ahead: layer {layer} expects chunk {st.next_chunk} next")
        B, H, N, D = k.shape
        if st.chunks and (B, H, D) != st.chunks[-1].bhd:
            raise ValueError(f"chunk (B, H, D) = {(B, H, D)} does not match the cached chunks' {st.chunks[-1].bhd}")
        copy = lambda x: x.detach().clone(memory_format=torch.contiguous_format)  # noqa: E731 (no aliasing)
        st.current = Chunk(chunk, st.next_token, N, (B, H, D), copy(k), copy(v))

    def commit(self, layer: int, chunk: int) -> None:
        """Commit the current chunk: it joins history; chunks leaving the full-precision set are quantized."""
        st = self._layer(layer)
        if st.current is None or st.current.index != chunk:
            raise ValueError(f"layer {layer} has no chunk {chunk} written to commit")
        c, st.current = st.current, None
        st.chunks.append(c)
        st.next_chunk, st.next_token = chunk + 1, c.start + c.n_tokens
        recent = st.chunks[-self.config.recent_chunks:] if self.config.recent_chunks else []
        keep = {x.index for x in recent}
        quantized = (self.quantize_k or self.quantize_v) and self.quantizes_layer(layer)
        ready = [old for old in st.chunks if old.index >= self.config.sink_chunks and old.index not in keep
                 and not old.quantized] if quantized else []
        n = self.config.span_chunks
        while len(ready) >= n:  # spans of `span_chunks` chunks, quantized together once all have left the window
            run, ready = ready[:n], ready[n:]
            with selfcheck.enabled(self.config.selfcheck):
                self._quantize(layer, st, run[0] if n == 1 else self._merge(st, run))
        if st.unchecked:  # no span read them with its own checks
            self._read_checks(layer, st)
        limit = self.config.max_chunks
        while limit is not None and sum(x.n_chunks for x in st.chunks) > limit:
            victim = next(i for i, x in enumerate(st.chunks) if x.index >= self.config.sink_chunks)
            st.chunks.pop(victim)  # a multi-chunk span leaves as a whole

    def evict_span(self, layer: int, index: int) -> None:
        """Drop the committed span that starts at chunk `index` (a host with its own window, such as SGLang's
        rolling cache, decides when; `max_chunks` is this cache's own rule)."""
        st = self._layer(layer)
        at = next((i for i, c in enumerate(st.chunks) if c.index == index), None)
        if at is None:
            held = ", ".join(str(c.index) for c in st.chunks) or "none"
            raise ValueError(f"layer {layer} holds no committed span starting at chunk {index} (held: {held})")
        st.chunks.pop(at)

    @staticmethod
    def _merge(st: LayerState, run: list[Chunk]) -> Chunk:
        """Consecutive full-precision chunks -> one span (it replaces them in the layer's list)."""
        cat = lambda xs: None if xs[0] is None else torch.cat(xs, 2)  # noqa: E731
        span = Chunk(run[0].index, run[0].start, sum(c.n_tokens for c in run), run[0].bhd,
                     cat([c.k for c in run]), cat([c.v for c in run]), n_chunks=sum(c.n_chunks for c in run))
        at = st.chunks.index(run[0])
        st.chunks[at:at + len(run)] = [span]
        return span

    def _quantize(self, layer: int, st: LayerState, c: Chunk) -> None:
        """Quantize span `c` (its Keys, then its Values, with one context) with the value checks deferred: one host
        read for them and the layer's deferred input checks; where a check fails the span is quantized again with
        every check immediate (the clear error, or a wider storage dtype, comes from there)."""
        B, H, N, D = c.k.shape
        ctx = self._span_context(layer, st, c)
        for kind, on in (("k", self.quantize_k), ("v", self.quantize_v)):
            if on:  # the first span: the budget's configuration (its own host reads), chosen once and kept
                self._budgeted(kind, (c.k if kind == "k" else c.v).reshape(B * H, N, D))
        state = dict(ctx.state)
        with deferred_checks(st.widened) as checks:
            k_enc, v_enc = self._encode(c, ctx)
        if not self._read_checks(layer, st, checks):  # again, checks immediate: an error, or a dtype to widen to
            ctx.state.clear()
            ctx.state.update(state)
            ctx.span.clear()
            with remembering(st.widened):
                k_enc, v_enc = self._encode(c, ctx)
        fused = self.config.rope == "post" and (self.config.lowp is not None or use_kernels(c.k))  # read by kernels
        if k_enc is not None:
            c.exact_k = c.k if self.config.keep_exact else None  # diagnostics only, not counted in nbytes
            c.k_enc, c.k = k_enc, None
            if fused:
                c.k_enc.prepare(self.config.lowp)  # the kernel's view, built once (layouts/base.py)
        if v_enc is not None:
            c.exact_v = c.v if self.config.keep_exact else None
            c.v_enc, c.v = v_enc, None
            if fused:
                c.v_enc.prepare()

    def _encode(self, c: Chunk, ctx) -> tuple:
        """(Keys' layout or None, Values' layout or None) of span `c`; nothing in `c` changes."""
        B, H, N, D = c.k.shape
        k_enc = self.k_method.encode(c.k.reshape(B * H, N, D), "k", ctx) if self.quantize_k else None
        held = ctx.span.get("held") if self.quantize_k else None  # the Keys' method kept these tokens in BF16
        v_enc = None
        if self.quantize_v:
            v = c.v.reshape(B * H, N, D)
            if held is None:
                v_enc = self.v_method.encode(v, "v", ctx)
            else:  # the same tokens' Values in BF16 too: attention reads the loud tokens as one BF16 span
                rest, loud = split_tokens(v, held)
                v_enc = TokenSplit(self.v_method.encode(rest, "v", ctx), held, loud)
        return k_enc, v_enc

    # ---- reading --------------------------------------------------------------------------------
    def _chunks(self, st: LayerState) -> list[Chunk]:
        return st.chunks + ([st.current] if st.current is not None else [])

    def reset(self) -> None:
        """Empty every layer (chunks, running S, method state) for a new video; the config stays, and a budget
        chooses again at the next first span (its shapes may differ)."""
        self.layers = [LayerState() for _ in self.layers]
        self._make_methods()

    def next_chunk(self, layer: int) -> int:
        """The chunk index the layer expects to be written next (its committed chunks are 0..next-1)."""
        return self._layer(layer).next_chunk

    def next_token(self, layer: int) -> int:
        """The absolute position of the next chunk's first token (tokens committed so far, evicted ones included)."""
        return self._layer(layer).next_token

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def inspect(self, layer: int) -> tuple[SpanView, ...]:
        """The spans `layer` holds, oldest first: committed spans (a quantized span may cover `n_chunks`
        chunks), then the current chunk if one is written, as frozen `SpanView`s."""
        def size(c: Chunk) -> int:
            full = sum(t.numel() * t.element_size() for t in (c.k, c.v) if t is not None)
            return full + sum(e.nbytes() for e in (c.k_enc, c.v_enc) if e is not None)
        return tuple(SpanView(c.index, c.start, c.n_tokens, c.n_chunks, c.bhd, c.quantized, size(c), c.k_enc, c.v_enc)
                     for c in self._chunks(self._layer(layer)))

    def spans(self, layer: int) -> list[Chunk]:
        """The live `Chunk`s `layer` holds, for the read path inside quantwm/core (attention.py); everything
        else uses `inspect`."""
        return list(self._chunks(self._layer(layer)))

    def quantizes_layer(self, layer: int) -> bool:
        """Whether `layer`'s spans are quantized (`CacheConfig.layers`; every layer by default)."""
        return self.config.layers is None or layer in self.config.layers

    @property
    def uses_queries(self) -> bool:
        """Whether a quantizing half's method reads the history-Query statistics S (QSAC, PSAC, the allocator)."""
        return (self.quantize_k and self.k_method.uses_queries) or (self.quantize_v and self.v_method.uses_queries)

    def seq_len(self, layer: int) -> int:
        """Tokens `layer` holds (what its attention reads): committed spans and the current chunk."""
        return sum(c.n_tokens for c in self._chunks(self._layer(layer)))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int,
               commit: bool = False, scale: float | None = None, observe: bool = True) -> torch.Tensor:
        """Write chunk `chunk`'s K/V, attend its queries q to the whole cache, optionally commit.

        q, k, v in the config's layout; q is post-RoPE, k post- or pre-RoPE per the config. Returns the
        attention output in q's layout and dtype.
        """
        qb, kb = self._in(q, "q"), self._in(k, "k")
        if qb.shape[:2] != kb.shape[:2] or qb.shape[3] != kb.shape[3]:
            raise ValueError(f"q shape {tuple(q.shape)} does not match k {tuple(k.shape)} on (B, H, D)")
        self._check(layer, chunk, q=q, k=k, v=v)  # once per call, at the boundary (read at commit on a GPU)
        self._write(layer, k, v, chunk, check=False)
        D = qb.shape[-1]
        scale = D ** -0.5 if scale is None else float(scale)
        if observe and self.tracks_queries:
            self._observe(layer, qb)
        out = None
        if self.config.rope == "post" and (use_kernels(qb) or self.config.lowp):
            # None when a span's format has no fused kernel; lowp off the kernels: its emulation
            with selfcheck.enabled(self.config.selfcheck):
                out = fused_attention(self, layer, qb, scale, use_kernel=use_kernels(qb), lowp=self.config.lowp)
        if out is None:
            K = self._read_keys(layer, False)  # (B, H, L, D), internal layout
            V = self._gather(layer, "v", False)
            bias = self.logit_bias(layer, qb, scale)
            out = F.scaled_dot_product_attention(qb.float(), K, V, attn_mask=bias, scale=scale)
        if commit:
            self.commit(layer, chunk)
        return self._out(out.to(q.dtype))
