"""The history-Query statistics half of `KVCache`: the running S = E[q qᵀ] per (layer, head) that QSAC, PSAC and
the allocator read when a span is quantized (quantwm.core.cache has the contract).

`QueryHistory` is mixed into `KVCache`; it reads the config, the layers' states and `tracks_queries`. S is kept
only where a quantizing method reads it or `CacheConfig(track_queries=True)` asks (for diagnostics such as the
query energy spectra); elsewhere attending computes no statistics at all.
"""
from __future__ import annotations

import torch

from .cache_types import Chunk, LayerState
from .methods import SpanContext
from .stats import QueryStats, rope_conjugate


class QueryHistory:
    """The running S of `KVCache` (see the module docstring): observing queries, seeding S, reading it, and the
    statistics a span is quantized with."""

    def _span_context(self, layer: int, st: LayerState, c: Chunk) -> SpanContext:
        """What the methods may read when span `c` is quantized: S (batch-major, one per stream) as it stands
        (with causal_stats, the queries of earlier chunks only; pre-RoPE spans get it in their keys' space), the
        layer's method state and a seed. A cache that keeps no statistics passes none (methods see identity)."""
        B, H, N, D = c.k.shape
        seed = self.config.seed + 7919 * layer + c.index
        if not self.tracks_queries:
            return SpanContext(state=st.method_state, seed=seed)
        for j in sorted(j for j in st.pending if j <= c.index):  # causal_stats: queries of earlier chunks only
            self._stats(st, H, D, c.k.device).merge(st.pending.pop(j))
        stats = self._stats(st, H, D, c.k.device).matrix().to(c.k.device)
        if self.config.rope == "pre" and st.stats.count:  # S into the keys' space
            stats = rope_conjugate(stats, self.rope, torch.arange(c.start, c.start + N, device=c.k.device))
        aim = None
        if self.config.rope == "post" and self.frame_shift is not None:
            def aim(chunks: int) -> torch.Tensor | None:
                S = self.aimed(st, c, chunks)
                return None if S is None else S.to(c.k.device).repeat(B, 1, 1)
        return SpanContext(stats=stats.repeat(B, 1, 1), state=st.method_state, seed=seed, history=st.stats.count,
                           window=self.window_spans(), aim=aim)

    def window_spans(self) -> int | None:
        """How many quantized spans a full rolling window holds at least (`max_chunks` less the sink and recent
        chunks, in spans), or None without a window: what a span sharing stored state pays its share by."""
        c = self.config
        if c.max_chunks is None:
            return None
        return max(1, (c.max_chunks - c.sink_chunks - c.recent_chunks) // max(1, c.span_chunks))

    def _fold_point(self, chunk: int) -> int:
        """The first span start after `chunk`: spans start at sink, sink + n, ... (n = span_chunks), and a chunk's
        queries may enter S when a later span is quantized, so all chunks before one start fold together."""
        sink, n = self.config.sink_chunks, self.config.span_chunks
        return sink if chunk < sink else sink + n * ((chunk - sink) // n + 1)

    def _stats(self, st: LayerState, H: int, D: int, device=None) -> QueryStats:
        """The layer's S, made (on `device`: where the queries are, no copy at their first update) if none yet."""
        if st.stats is None:
            st.stats = QueryStats(H, D, self.config.stats_decay, device)
        return st.stats

    def observe(self, layer: int, q: torch.Tensor) -> None:
        """Add queries (caller's layout, post-RoPE) to layer's history statistics S (kept post-RoPE; pre-RoPE
        spans get S rotated into their keys' space when they are quantized, `stats.rope_conjugate`). A cache that
        keeps no statistics (`tracks_queries` False) ignores them."""
        qb = self._in(q, "q")
        self._check(layer, self._layer(layer).next_chunk, q=q)
        if self.tracks_queries:
            self._observe(layer, qb)

    def _observe(self, layer: int, qb: torch.Tensor) -> None:
        st = self._layer(layer)
        H, D = qb.shape[1], qb.shape[3]
        stats = self._stats(st, H, D, qb.device)
        if self.causal_stats:  # held back until the chunks before it are quantized, grouped by when that happens
            idx = st.current.index if st.current is not None else st.next_chunk
            stats = st.pending.setdefault(self._fold_point(idx), QueryStats(H, D, self.config.stats_decay, qb.device))
        stats.update(qb, anchor=self._anchor(st, qb.device))

    def _anchor(self, st: LayerState, device: torch.device) -> torch.Tensor | None:
        """M (D, D) moving the queries of the chunk being written back to frame 0 by its first frame (the cache's
        `frame_shift`), or None: no frame shift, or a chunk that does not start on a frame."""
        if self.frame_shift is None or self.config.rope != "post":
            return None
        frames = self.frame_shift.frames(st.current.start if st.current is not None else st.next_token)
        return None if frames is None else self.frame_shift.matrix(-frames, device)

    def aimed(self, st: LayerState, c: Chunk, chunks: int) -> torch.Tensor | None:
        """S (H, D, D) re-aimed at the frames that read span `c` next: the anchored queries moved to the starts of
        the `chunks` chunks after the last committed one, averaged (Mᵀ S₀ M for each shift M); None where the
        statistics keep no anchored moment."""
        stats = st.stats
        if stats is None or stats.anchored is None or chunks < 1:
            return None
        step = c.n_tokens // c.n_chunks  # tokens per chunk
        shifts = [self.frame_shift.frames(st.next_token + m * step) for m in range(chunks)]
        if any(f is None for f in shifts):
            return None
        S0 = stats.anchored
        out = sum(M.T @ S0 @ M for M in (self.frame_shift.matrix(f, S0.device) for f in shifts)) / chunks
        return out.float()

    def load_query_stats(self, layer: int, second: torch.Tensor, count: int = 1) -> None:
        """Seed layer's S (H, D, D) from a calibration run or a trace's earlier queries."""
        H, D = second.shape[0], second.shape[-1]
        self._stats(self._layer(layer), H, D, second.device).load(second, count)

    def query_stats(self, layer: int) -> torch.Tensor:
        """S (H, D, D) of `layer` (identity before any query). Needs a cache that keeps them (`tracks_queries`)."""
        st = self._layer(layer)
        if not self.tracks_queries and (st.stats is None or not st.stats.count):
            raise ValueError("this cache keeps no query statistics (its method does not read them): "
                             "CacheConfig(track_queries=True) keeps them for diagnostics")
        if st.stats is None:
            cs = self._chunks(st)
            if not cs:
                raise ValueError(f"layer {layer} is empty: its head count and head dim are not known yet")
            _, H, D = cs[0].bhd
            return self._stats(st, H, D).matrix()
        return st.stats.matrix()
