"""What a cache stores, counted from its tensors (docs/method.md §3.1): the accounting half of `KVCache`.

`MemoryAccounting` is mixed into `KVCache`; it reads the layers' chunks (`self.layers`, `self._chunks`) and
nothing else. Every memory figure of the project (the CLI, the app, the adapters, the benchmarks) comes from
`KVCache.memory()` and the methods below.
"""
from __future__ import annotations

import torch

from . import selfcheck
from .cache_types import CacheMemory


class MemoryAccounting:
    def _stored(self):
        """Yield (component, bytes, quantized) for every stored tensor once (shared tensors once in all)."""
        seen: set[int] = set()
        for st in self.layers:
            for c in self._chunks(st):
                for which, enc, full in (("k", c.k_enc, c.k), ("v", c.v_enc, c.v)):
                    if full is not None:
                        yield f"{which}.full", full.numel() * full.element_size(), False
                        continue
                    for name, t in enc.components().items():
                        yield f"{which}.{name}", t.numel() * t.element_size(), True
                    for name, t in enc.shared().items():
                        if id(t) not in seen:
                            seen.add(id(t))
                            yield f"{which}.{name}", t.numel() * t.element_size(), True

    def bytes_by_component(self) -> dict[str, int]:
        """Bytes of every stored tensor, by component ('full' for unquantized chunks)."""
        out: dict[str, int] = {}
        for key, n, _ in self._stored():
            out[key] = out.get(key, 0) + n
        return out

    def channel_bits(self, which: str) -> dict[int, int]:
        """{bits: channels} over every quantized span of every layer whose `which` ("k" or "v") form gives each
        channel a width of its own (the allocator's; `Layout.channel_bits`), one count per (stream, channel) of a
        span; empty where one grid serves all."""
        out: dict[int, int] = {}
        for st in self.layers:
            for c in self._chunks(st):
                enc = c.k_enc if which == "k" else c.v_enc
                bits = enc.channel_bits() if enc is not None else None
                if bits is not None:
                    for b, n in zip(*torch.unique(bits.cpu(), return_counts=True)):
                        out[int(b)] = out.get(int(b), 0) + int(n)
        return dict(sorted(out.items()))

    def head_bits(self, layer: int, which: str) -> torch.Tensor | None:
        """(H, D) bits of each head's channels of `which` ("k" or "v") in `layer`, averaged over its quantized spans
        weighted by tokens, where the form gives each channel a width of its own (the allocator's; B averaged too);
        None where none does."""
        total, tokens = None, 0
        for c in self._chunks(self._layer(layer)):
            enc = c.k_enc if which == "k" else c.v_enc
            bits = enc.channel_bits() if enc is not None else None  # (B*H, D)
            if bits is not None:
                B, H, D = c.bhd
                w = bits.float().reshape(B, H, D).mean(0).cpu() * c.n_tokens  # (B*H, D) -> (H, D)
                total, tokens = (w if total is None else total + w), tokens + c.n_tokens
        return None if total is None else total / tokens

    def runtime_bytes(self) -> dict[str, int]:
        """Working state a deployment keeps beside the stored cache (not in nbytes): the running S per layer
        (float64, pending per-chunk statistics included), the methods' state kept for later spans (k-means
        warm-start centroids; a PSAC basis only where no stored span holds it) and what the read path derived from
        the stored spans at commit (kernel views' tables, the 8-bit path's centres)."""
        stats = sum(x.second.numel() * x.second.element_size()
                    for st in self.layers for x in ([st.stats] if st.stats else []) + list(st.pending.values()))
        stored = {id(t) for st in self.layers for c in st.chunks for e in (c.k_enc, c.v_enc) if e is not None
                  for t in e.shared().values()}  # a PSAC basis the spans store is counted there
        warm = sum(t.numel() * t.element_size() for st in self.layers for t in st.method_state.values()
                   if isinstance(t, torch.Tensor) and id(t) not in stored)  # host-side flags hold no device bytes
        derived = {t.data_ptr(): t for st in self.layers for c in st.chunks for e in (c.k_enc, c.v_enc) if e is not None
                   for t in e.view_tensors()}
        views = sum(t.numel() * t.element_size() for t in derived.values())
        return {"query_stats": stats, "method_state": warm, "kernel_views": views}

    def nbytes(self) -> int:
        return sum(n for _, n, _ in self._stored())

    def quantized_bytes(self, which: str | None = None) -> int:
        """Bytes of the quantized spans' stored tensors (codes and all their metadata; full-precision chunks and
        halves excluded); `which` "k" or "v": that half's alone."""
        if which is None:
            return self._quantized_totals()[0]
        return sum(n for key, n, quantized in self._stored() if quantized and key.startswith(which + "."))

    def _quantized_totals(self) -> tuple[int, int]:
        """(bytes, elements) of the quantized halves of the committed chunks."""
        nbytes = sum(n for _, n, quantized in self._stored() if quantized)
        elems = sum(e.shape[0] * e.shape[1] * e.shape[2] for st in self.layers for c in st.chunks
                    for e in (c.k_enc, c.v_enc) if e is not None)
        return nbytes, elems

    def bits_per_element(self) -> float:
        """Bits per element of the quantized storage (codes plus all their metadata); nan if none."""
        nbytes, elems = self._quantized_totals()
        return 8 * nbytes / elems if elems else float("nan")

    def memory(self) -> CacheMemory:
        """The typed memory report every caller uses (see `CacheMemory`): the quantized spans' bits per element and
        the whole cache's bytes, full-precision chunks counted as stored and as BF16 would hold them."""
        elems = sum(2 * c.n_tokens * c.bhd[0] * c.bhd[1] * c.bhd[2] for st in self.layers for c in self._chunks(st))
        qbytes, qelems = self._quantized_totals()
        return CacheMemory(stored_bytes=self.nbytes(), bf16_bytes=2 * elems, by_component=self.bytes_by_component(),
                           bits_per_element=self.bits_per_element(), cache_bits_per_element=self.cache_bits_per_element(),
                           runtime_bytes=self.runtime_bytes(), cache_bytes=qbytes + 2 * (elems - qelems),
                           kernel_fallbacks=tuple(v.line() for v in selfcheck.fallbacks()))

    def cache_bits_per_element(self) -> float:
        """Bits per element of the whole cache: quantized and full-precision chunks together."""
        elems = sum(2 * c.n_tokens * c.bhd[0] * c.bhd[1] * c.bhd[2] for st in self.layers for c in self._chunks(st))
        return 8 * self.nbytes() / elems if elems else float("nan")
