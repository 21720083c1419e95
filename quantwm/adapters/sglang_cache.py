"""QuantWM's KV cache behind SGLang's causal KV contract (`CausalSelfAttentionKVCache`, sglang 0.5.23).

SGLang's causal denoising stages (LingBot-World, causal Wan / Self-Forcing, LongLive2) give every transformer
block one cache object, and the block's attention calls, on every pass,

    view = cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=s,
                                             cache_head_start=h, recent_window_tokens=w)
    out = attn(q, view.k, view.v)          # k, v, view.k, view.v: (B, N, H, D), keys after RoPE

`QuantWMCausalKVCache` answers that call with QuantWM's storage:

* The window (sink, rolling eviction, pinned sinks, growth, recent-token windows that may cut inside a
  chunk) is SGLang's own code: an instance of SGLang's dense cache class runs beside the store, holding
  token *positions* (B = H = D = 1, int64) instead of K/V. So which tokens a view holds, and in which order,
  is SGLang's by construction; the store only has to hand back those tokens.
* The store is a one-layer `quantwm.core.cache.KVCache` (post-RoPE keys, BLHD). A write at the current
  chunk's start overwrites it (a denoising pass); a write at the end of what is cached commits the current
  chunk and starts the next (generation advanced). Any other start is refused with a message.
* A committed span leaves the store when SGLang's window holds none of its tokens. A window that cuts inside
  a span hides the cut tokens at once; the span's bytes are freed when its last token leaves.
* Head slices. Under Ulysses a rank's cache holds its H/n heads (`head_offset`: the first model head, for
  queries that still carry every head and for calibration files). Under tensor parallelism the cache is
  made for every head and a rank writes its slice (`cache_head_start`): the store then holds that slice only,
  so bytes and bits are counted for what the rank keeps.
* Queries: the contract passes none. The plugin's attention hook calls `stash_queries` with the rotated
  queries before the write; they enter S (QSAC/PSAC's statistics) with the write. `query_stats` (a
  calibration file's S, `quantwm query-stats`) seeds it instead or as well.
* Attention: where the plugin's hook asked for it (`request_fused`: a single-device pass whose attention
  call it can intercept), the kernels are on (CUDA, or QUANTWM_KERNELS=triton) and the view is all the
  store holds, the queries attend to the stored spans with the fused kernels (`fused_output`), nothing
  decompressed; the view's K/V are then NaN placeholders that only the intercepted call may receive.
  Otherwise the view is decoded for the call, one layer at a time (as QVG's packed cache does), and
  SGLang's attention backend runs on it.

Known limits: writes must be chunk-sequential (what every SGLang causal stage does), and one cache object
keeps one head slice (what every rank writes).
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import replace
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from ..core.attention import fused_attention
from ..core.backend import use_kernels
from ..core.cache import CacheConfig, KVCache

CONTRACT_MODULE = "sglang.multimodal_gen.runtime.layers.kvcache.causal_attention_cache"


def load_sglang_module(name: str) -> ModuleType:
    """An SGLang module, imported normally inside SGLang.

    Where SGLang is installed without its dependencies (`pip install --no-deps sglang==0.5.23`, as the tests
    do so it cannot replace torch), `import sglang` fails on them: a module that needs only torch and the
    standard library (the KV contract, the hook registry) is then loaded from the installed file on its own."""
    try:
        importlib.import_module("sglang")
        return importlib.import_module(name)
    except ImportError as e:
        if name in sys.modules or "sglang" in sys.modules:
            raise  # sglang itself imports: the error is real
        reason = e
    spec = importlib.util.find_spec("sglang")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the SGLang plugin needs sglang==0.5.23 installed "
                                  "(pip install --no-deps sglang==0.5.23 for the contract alone)") from reason
    path = Path(spec.submodule_search_locations[0], *name.split(".")[1:]).with_suffix(".py")
    if not path.is_file():
        raise ModuleNotFoundError(f"this sglang has no {name} ({path}); the plugin is written against sglang "
                                  "0.5.23") from reason
    alias = f"quantwm._isolated.{name}"
    if alias not in sys.modules:
        module_spec = importlib.util.spec_from_file_location(alias, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[alias] = module  # dataclasses resolve their module by name
        module_spec.loader.exec_module(module)
    return sys.modules[alias]


@cache
def load_contract() -> ModuleType:
    """SGLang's contract module (`CausalSelfAttentionKVCache`, `CausalAttentionKVView`)."""
    return load_sglang_module(CONTRACT_MODULE)


class QuantWMCausalKVCache:
    """One transformer block's cache, speaking SGLang's `CausalSelfAttentionKVCache` contract.

    config: the QuantWM method and its settings (layout and RoPE mode are set here: BLHD, post-RoPE);
    layer: the block index (seeds the method's randomness); query_stats: calibration S (H, D, D), H the cache's
    heads or every model head; head_offset: the model head of cache head 0 (Ulysses: rank x heads per rank).
    The other arguments are those SGLang's stages pass to their dense cache."""

    def __init__(self, *, config: CacheConfig, batch_size: int, cache_size: int, num_heads: int, head_dim: int,
                 dtype: torch.dtype, device, use_int_indices: bool = False, sink_tokens: int = 0,
                 global_sink_tokens: int = 0, attention_window_size: int | None = None,
                 allow_growth: bool = False, layer: int = 0, query_stats: torch.Tensor | None = None,
                 head_offset: int = 0):
        for name, value in (("batch_size", batch_size), ("cache_size", cache_size), ("num_heads", num_heads),
                            ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.config = replace(config, layout="BLHD", rope="post", seed=config.seed + 7919 * layer)
        self.batch_size, self.num_heads, self.head_dim = batch_size, num_heads, head_dim
        self.head_offset = int(head_offset)  # the model head of cache head 0 (Ulysses: rank * num_heads)
        self._heads: slice | None = None     # the cache heads the store holds (a tensor-parallel rank's slice)
        self.dtype, self.device = dtype, torch.device(device)
        self._contract = load_contract()
        positions = torch.zeros(1, cache_size, 1, 1, dtype=torch.long)  # the window holds positions, not K/V
        self._window = self._contract.CausalSelfAttentionKVCache(
            k=positions, v=positions.clone(),
            global_end_index=torch.zeros(1, dtype=torch.long), local_end_index=torch.zeros(1, dtype=torch.long),
            global_end_index_int=0 if use_int_indices else None, local_end_index_int=0 if use_int_indices else None,
            cache_size=cache_size, sink_tokens=sink_tokens, global_sink_tokens=global_sink_tokens,
            attention_window_size=attention_window_size or cache_size, allow_growth=allow_growth)
        if query_stats is not None and (query_stats.dim() != 3 or tuple(query_stats.shape[1:]) != (head_dim, head_dim)
                                        or query_stats.shape[0] < num_heads):
            raise ValueError(f"query statistics must be (H >= {num_heads}, {head_dim}, {head_dim}), got "
                             f"{tuple(query_stats.shape)}")
        self._calibration = query_stats
        self._stash: torch.Tensor | None = None
        self._fused_scale: float | None = None  # set by the hook for one call: try the fused kernels
        self._fused: tuple | None = None        # (placeholder K, output) of the last fused call
        self.fused_calls = 0
        self._start_store()

    def _start_store(self) -> None:
        self.store = KVCache(self.config, n_layers=1)
        self._calibrate = self._calibration is not None  # loaded at the first write, which names the head slice
        self._chunk = -1            # index of the current (written, uncommitted) chunk
        self._cur_start = None      # its first token position
        self._cur_tokens = 0
        self._end = 0               # one past the last token position written

    # ---- the fields SGLang's stages read ----------------------------------------------------------------
    @property
    def num_cache_heads(self) -> int:
        return self.num_heads

    @property
    def cache_size(self) -> int:
        return self._window.cache_size

    @property
    def sink_tokens(self) -> int:
        return self._window.sink_tokens

    @property
    def global_sink_tokens(self) -> int:
        return self._window.global_sink_tokens

    @property
    def attention_window_size(self) -> int:
        return self._window.attention_window_size

    @property
    def allow_growth(self) -> bool:
        return self._window.allow_growth

    @property
    def global_end_index(self) -> torch.Tensor:
        return self._window.global_end_index

    @property
    def local_end_index(self) -> torch.Tensor:
        return self._window.local_end_index

    def can_direct_current_attention(self, num_new_tokens: int) -> bool:
        return self._window.can_direct_current_attention(num_new_tokens)

    def reset_indices(self) -> None:
        """A new video: empty window and store (S restarts, from the calibration file if one was given)."""
        self._window.reset_indices()
        self._start_store()

    def reset_pinned_sink(self) -> None:
        self._window.reset_pinned_sink()

    def pin_current_chunk(self, current_num_tokens: int) -> None:
        self._window.pin_current_chunk(current_num_tokens)

    # ---- queries ----------------------------------------------------------------------------------------
    @property
    def uses_queries(self) -> bool:
        """Whether the method reads history-query statistics (QSAC / PSAC)."""
        return self.store.uses_queries

    def stash_queries(self, q: torch.Tensor) -> None:
        """The rotated queries (B, Nq, Hq, D) of the attention call about to write; they enter S with it."""
        if q.dim() != 4 or q.shape[-1] != self.head_dim:
            raise ValueError(f"queries must be (B, N, H, {self.head_dim}), got {tuple(q.shape)}")
        self._stash = q

    def drop_stash(self) -> None:
        self._stash = self._fused_scale = self._fused = None

    def request_fused(self, scale: float) -> None:
        """Ask the next write (whose queries are stashed) to attend with the fused kernels where it can."""
        self._fused_scale = float(scale)

    def fused_output(self, k: torch.Tensor) -> torch.Tensor | None:
        """The fused attention output (B, Nq, H, D) if `k` is the placeholder of the view it was computed for."""
        if self._fused is None or self._fused[0] is not k:
            return None
        out, self._fused = self._fused[1], None
        return out

    @property
    def _kept(self) -> int:
        """How many heads the store holds (this rank's slice)."""
        return self._heads.stop - self._heads.start

    def _model_heads(self) -> slice:
        """The model heads of the store's heads."""
        first = self.head_offset + self._heads.start
        return slice(first, first + self._kept)

    def _load_calibration(self) -> None:
        """Calibration S for the store's heads: the file holds them, or every model head (sliced here)."""
        S, self._calibrate = self._calibration, False
        if S.shape[0] != self._kept:
            heads = self._model_heads()
            if heads.stop > S.shape[0]:
                raise ValueError(f"query statistics hold {S.shape[0]} heads; this cache keeps model heads "
                                 f"[{heads.start}, {heads.stop})")
            S = S[heads]
        self.store.load_query_stats(0, S)

    def _observe(self) -> None:
        """Stashed queries into S, for the store's heads."""
        q, self._stash = self._stash, None
        if q is None or not self.uses_queries:
            return  # bf16, rtn, kivi, qvg read no statistics
        if q.shape[2] != self._kept:  # Ulysses: the queries still carry every model head
            heads = self._model_heads()
            if heads.stop > q.shape[2]:
                return
            q = q[:, :, heads]
        self.store.observe(0, q)

    # ---- the contract -----------------------------------------------------------------------------------
    def _check(self, key: torch.Tensor, value: torch.Tensor, cache_head_start: int | None, name: str) -> slice:
        if not isinstance(key, torch.Tensor) or not isinstance(value, torch.Tensor):
            raise ValueError(f"{name}: key and value must be tensors")
        if key.dim() != 4 or key.shape != value.shape:
            raise ValueError(f"{name}: key and value must be (B, N, H, D) of one shape, got {tuple(key.shape)} "
                             f"and {tuple(value.shape)}")
        B, N, H, D = key.shape
        if B != self.batch_size or D != self.head_dim or N == 0:
            raise ValueError(f"{name}: key {tuple(key.shape)} does not fit the cache (batch {self.batch_size}, "
                             f"head dim {self.head_dim}, at least one token)")
        if H == self.num_heads:
            return slice(0, H)
        if cache_head_start is None:
            raise ValueError(f"{name} requires cache_head_start when cache heads ({self.num_heads}) differ from "
                             f"input heads ({H})")
        if cache_head_start < 0 or cache_head_start + H > self.num_heads:
            raise ValueError(f"{name}: heads [{cache_head_start}, {cache_head_start + H}) lie outside the cache's "
                             f"{self.num_heads} heads")
        return slice(cache_head_start, cache_head_start + H)

    def update_and_get_attention_kv(self, *, key: torch.Tensor, value: torch.Tensor, current_chunk_start: int,
                                    cache_head_start: int | None = None, recent_window_tokens: int | None = None,
                                    debug_name: str = "QuantWM KV cache"):
        """Write the chunk's K/V (B, N, H, D) at `current_chunk_start`; return the visible view (SGLang's
        `CausalAttentionKVView`: k, v (B, L, H, D) in key's dtype, and the dense cache's indices)."""
        heads = self._check(key, value, cache_head_start, debug_name)
        if self._heads is None:
            self._heads = heads
        elif heads != self._heads:
            raise ValueError(f"{debug_name}: this cache keeps heads [{self._heads.start}, {self._heads.stop}) (one "
                             f"rank's slice); a write for heads [{heads.start}, {heads.stop}) needs its own cache")
        N, start = key.shape[1], int(current_chunk_start)
        advanced = start == self._end and start != self._cur_start
        if not advanced and start != self._cur_start:
            if self._cur_start is None:
                where = "must be 0 (the first write of a video)"
            elif start < self._cur_start:
                where = "goes backwards"
            elif start < self._end:
                where = "lies inside the current chunk"
            else:
                where = "skips ahead"
            raise ValueError(f"{debug_name}: chunk start {start} {where}: the current chunk starts at "
                             f"{self._cur_start} and the next must start at {self._end}")
        if not advanced and N != self._cur_tokens:
            raise ValueError(f"{debug_name}: a pass over the chunk at {start} writes {N} tokens, the chunk has "
                             f"{self._cur_tokens}")
        positions = torch.arange(start, start + N, dtype=torch.long).view(1, N, 1, 1)
        seen = self._window.update_and_get_attention_kv(  # SGLang's own window logic, on positions
            key=positions, value=positions, current_chunk_start=start, recent_window_tokens=recent_window_tokens,
            debug_name=debug_name)

        if advanced:
            if self._cur_start is not None:
                self.store.commit(0, self._chunk)
            self._chunk, self._cur_start, self._cur_tokens, self._end = self._chunk + 1, start, N, start + N
            self._evict()
        if self._calibrate:
            self._load_calibration()
        self.store.write(0, key, value, self._chunk)
        q, scale, self._fused_scale = self._stash, self._fused_scale, None
        self._observe()
        visible = seen.k.view(-1)
        out = self._attend_fused(q, scale, visible) if scale is not None and q is not None else None
        if out is not None:  # placeholders: NaN, so a consumer other than the intercepted call cannot go unnoticed
            k = v = key.new_full((1, 1, 1, 1), float("nan")).expand(self.batch_size, visible.numel(), key.shape[2],
                                                                       self.head_dim)
            self._fused, self.fused_calls = (k, out), self.fused_calls + 1
        else:
            k, v = self._gather(visible, key.dtype)
        return self._contract.CausalAttentionKVView(
            k=k, v=v, local_start_index=seen.local_start_index, local_end_index=seen.local_end_index,
            visible_local_end=seen.visible_local_end, visible_global_end=seen.visible_global_end)

    def _attend_fused(self, q: torch.Tensor, scale: float, visible: torch.Tensor):
        """Fused attention of q (B, Nq, H, D) over the store, if the view is exactly what it holds."""
        if q.shape[2] != self._kept or not use_kernels(q):
            return None
        if not torch.equal(self.store.positions(0), visible):
            return None  # a window that hides stored tokens (partial eviction, recent-token window)
        out = fused_attention(self.store, 0, q.transpose(1, 2), scale)  # (B, H, Nq, D)
        return None if out is None else out.transpose(1, 2).to(q.dtype)

    def _held(self) -> torch.Tensor:
        end = self._window.local_end_index_int
        end = int(self._window.local_end_index.item()) if end is None else end
        return self._window.k[0, :end, 0, 0]

    def _evict(self) -> None:
        """Drop committed spans of which SGLang's window holds no token (before the new chunk is written)."""
        held = self._held()
        for span in self.store.inspect(0):  # committed spans only: the new chunk is not written yet
            a, b = span.start, span.start + span.n_tokens
            if not bool(((held >= a) & (held < b)).any()):
                self.store.evict_span(0, span.index)

    def _gather(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """The stored tokens at `positions` (in that order), decoded: (B, L, H_kept, D) each."""
        held = self.store.positions(0)  # ascending: chunks are appended in order
        at = torch.searchsorted(held, positions)
        if bool((at >= held.numel()).any()) or not torch.equal(held[at.clamp(max=held.numel() - 1)], positions):
            raise RuntimeError("QuantWM KV cache: SGLang's window shows tokens the store no longer holds")
        at = at.to(self.device)
        out = []
        for x in (self.store.keys(0), self.store.values(0)):  # (B, L_stored, H, D) float32
            out.append(x.index_select(1, at).to(dtype))
        return tuple(out)

    # ---- accounting -------------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes the store holds (quantized spans with all their metadata, full-precision chunks)."""
        return self.store.nbytes()

    def resident_nbytes(self) -> int:
        """What QVG's cache reports under this name (the store holds everything: nbytes)."""
        return self.nbytes()

    def bits_per_element(self) -> float:
        """Bits per element of the quantized spans, counted from their stored bytes (nan before any)."""
        return self.store.bits_per_element()
