"""Trace capture: record Q/K/V of chosen layers and chunks while a model generates through the cache.

For every chosen chunk c (c >= 1) and layer l, the last pass of the chosen kind ("denoise" or "commit")
at chunk c leaves in a v1 trace (quantwm.evaluation.trace): `L{l}.q` the chunk's queries (H, N, D), `L{l}.k` /
`L{l}.v` the exact cached keys and values of the chunks before it (H, Nk, D), post-RoPE, and `L{l}.q_hist`
every query the layer issued for earlier chunks (all passes), the statistics the cache's QSAC/PSAC saw.
One trace file per chosen chunk. `max_bytes` bounds everything held (traces plus pending query history):
a layer that would not fit is skipped and listed in `skipped`; history stops growing when it would not fit.

Exact keys of quantized chunks need CacheConfig(keep_exact=True); capture from a bf16 run needs nothing.
Known limits: batch element `batch_index` only; no eviction (the trace's token j must be frame j // (h*w)).
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..evaluation.trace import TraceWriter

PASS_KINDS = ("denoise", "commit")


class TraceCapture:
    """Collects traces of `chunks` (and `layers`, default all) during generation; `save` writes them."""

    def __init__(self, chunks, layers=None, pass_kind: str = "denoise", max_bytes: int | None = None,
                 frame_grid: tuple[int, int] | None = None, model: str = "unknown", history: bool = True,
                 batch_index: int = 0):
        chunks = sorted({int(c) for c in ([chunks] if isinstance(chunks, int) else chunks)})
        if not chunks or chunks[0] < 1:
            raise ValueError(f"chunks must be a non-empty set of chunk indices >= 1 (chunk 0 attends to no "
                             f"cached tokens), got {chunks}")
        if layers is not None:
            layers = sorted({int(l) for l in ([layers] if isinstance(layers, int) else layers)})
            if not layers or layers[0] < 0:
                raise ValueError(f"layers must be None (all) or non-negative layer indices, got {layers}")
        if pass_kind not in PASS_KINDS:
            raise ValueError(f"pass_kind must be one of {', '.join(PASS_KINDS)}, got {pass_kind!r}")
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive or None, got {max_bytes}")
        if batch_index < 0:
            raise ValueError(f"batch_index must be >= 0, got {batch_index}")
        self.chunks, self.layers, self.pass_kind = chunks, layers, pass_kind
        self.max_bytes, self.frame_grid, self.model = max_bytes, frame_grid, model
        self.history, self.batch_index = history, batch_index
        self.writers: dict[int, TraceWriter] = {}
        self.hist: dict[int, list[tuple[int, torch.Tensor]]] = {}  # layer -> [(chunk, q (H, N, D) fp16)]
        self.hist_truncated = False
        self.frames: torch.Tensor | None = None

    # ---- budget ---------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes held: recorded traces plus pending query history."""
        hist = sum(x.numel() * x.element_size() for h in self.hist.values() for _, x in h)
        return hist + sum(w.nbytes() for w in self.writers.values())

    @property
    def skipped(self) -> dict[int, list[int]]:
        """chunk -> layers that did not fit the budget."""
        return {c: sorted(set(w.skipped)) for c, w in self.writers.items() if w.skipped}

    # ---- recording ------------------------------------------------------------------------------
    def _bhd(self, cache, x: torch.Tensor) -> torch.Tensor:
        """One batch element of a cache-layout tensor -> (H, N, D)."""
        if not 0 <= self.batch_index < x.shape[0]:
            raise ValueError(f"batch_index {self.batch_index} out of range for batch size {x.shape[0]}")
        x = x[self.batch_index]
        return x.transpose(0, 1) if cache.config.layout == "BLHD" else x

    def observe(self, cache, layer: int, chunk: int, commit: bool, q: torch.Tensor, scale: float) -> None:
        """Called after `cache.attend` of `layer` at `chunk` (q in the cache's layout)."""
        if self.layers is not None and layer not in self.layers:
            return
        qh = self._bhd(cache, q).detach()
        if self.history and chunk < self.chunks[-1]:
            self._add_history(layer, chunk, qh)
        if chunk in self.chunks and commit == (self.pass_kind == "commit"):
            self._record(cache, layer, chunk, qh, scale)
        if chunk > self.chunks[-1]:
            self.hist.pop(layer, None)  # no chosen chunk left that needs it

    def _add_history(self, layer: int, chunk: int, q: torch.Tensor) -> None:
        x = q.to("cpu", torch.float16)
        if self.max_bytes is not None and self.nbytes() + x.numel() * x.element_size() > self.max_bytes:
            self.hist_truncated = True
            return
        self.hist.setdefault(layer, []).append((chunk, x))

    def _cached(self, cache, layer: int, n_cur: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact cached keys and values before the current chunk, (H, Nk, D) each, post-RoPE."""
        pos = cache.positions(layer)[:-n_cur]
        if not torch.equal(pos, torch.arange(len(pos))):
            raise ValueError("trace capture needs every cached token from position 0 on (no max_chunks eviction)")
        try:
            k, v = cache.keys(layer, exact=True), cache.values(layer, exact=True)
        except ValueError as e:
            raise ValueError(f"trace capture records exact K/V: {e}") from None
        return self._bhd(cache, k)[:, :-n_cur], self._bhd(cache, v)[:, :-n_cur]

    def _writer(self, chunk: int, scale: float, chunk_tokens: int) -> TraceWriter:
        if self.frame_grid is None:
            raise ValueError("trace capture needs the frame grid: TraceCapture(frame_grid=(h, w)) in tokens")
        h, w = self.frame_grid
        if chunk_tokens % (h * w):
            raise ValueError(f"a chunk of {chunk_tokens} tokens is not whole frames of {h}x{w} tokens")
        if chunk not in self.writers:
            wr = TraceWriter(h * w, (h, w), scale, rope="post", model=self.model)
            wr.extra_meta.update(chunk_frames=chunk_tokens // (h * w), chunk=chunk)
            self.writers[chunk] = wr
        return self.writers[chunk]

    def _record(self, cache, layer: int, chunk: int, q: torch.Tensor, scale: float) -> None:
        k, v = self._cached(cache, layer, q.shape[1])
        wr = self._writer(chunk, scale, q.shape[1])
        wr.layers.pop(layer, None)  # a later pass of the same kind replaces an earlier one
        hist = [(c, x) for c, x in self.hist.get(layer, []) if c < chunk]
        q_hist = torch.cat([x for _, x in hist], 1) if hist else None
        chunk_of = torch.cat([torch.full((x.shape[1],), c) for c, x in hist]) if hist else None
        if self.max_bytes is not None:
            wr.max_bytes = self.max_bytes - (self.nbytes() - wr.nbytes())
        if wr.record(layer, q, k, v, q_hist=q_hist, q_hist_chunk=chunk_of):
            wr.skipped = [x for x in wr.skipped if x != layer]

    def set_frames(self, frames: torch.Tensor) -> None:
        """Decoded frames (T, height, width, 3), uint8 or float in [0, 1], written into every trace."""
        f = torch.as_tensor(frames)
        if f.dim() != 4 or f.shape[-1] != 3:
            raise ValueError(f"frames must be (T, height, width, 3), got {tuple(f.shape)}")
        self.frames = f

    def save(self, path: str | Path) -> list[Path]:
        """Write one trace per captured chunk; with several chunks `path` must hold '{chunk}'."""
        path = str(path)
        done = sorted(c for c, w in self.writers.items() if w.layers)
        if not done:
            raise ValueError(f"nothing was captured for chunks {self.chunks} (did generation reach them, "
                             f"with passes of kind {self.pass_kind!r}, within max_bytes?)")
        if len(done) > 1 and "{chunk}" not in path:
            raise ValueError(f"{len(done)} chunks were captured: the path must contain '{{chunk}}', got {path!r}")
        out = []
        for c in done:
            wr = self.writers[c]
            if self.frames is not None:
                wr.set_frames(self.frames)
            p = Path(path.format(chunk=c))
            wr.save(p)
            out.append(p)
        return out
