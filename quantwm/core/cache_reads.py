"""The reading half of `KVCache`: what attention reads from the spans a layer holds (quantwm.core.cache has the
contract): every cached key or value dequantized (or exact), the tokens' absolute positions, pre-RoPE keys rotated at
read, the per-element quantization steps of the keys and the +jensen logit bias made of them.

`CacheReads` is mixed into `KVCache`; it reads the config, `rope`, `quantize_k` and the layers' spans
(`self._chunks`, `self._layer`), and returns tensors in the caller's layout through `self._out`.
"""
from __future__ import annotations

import torch

from .attention import jensen_bias
from .cache_types import Chunk


class CacheReads:
    """The read path of `KVCache` (see the module docstring): decoding spans, gathering them, and the keys' steps."""

    def _decode(self, c: Chunk, which: str) -> torch.Tensor:
        full = c.k if which == "k" else c.v
        if full is not None:
            return full.float()
        if which in c.decoded:
            return c.decoded[which]
        enc = c.k_enc if which == "k" else c.v_enc
        B, H, D = c.bhd
        x = enc.decode().reshape(B, H, c.n_tokens, D)  # a stored span decodes itself
        if self.config.memo_decoded:  # committed spans never change: decode once (working memory, not counted)
            c.decoded[which] = x
        return x

    def positions(self, layer: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Absolute token positions (L,) of everything cached in `layer`, in cache order, made on `device` (the host
        by default, where callers index their own tables; the pre-RoPE read asks for the keys' device: no copy)."""
        cs = self._chunks(self._layer(layer))
        return torch.cat([torch.zeros(0, dtype=torch.long, device=device)] +
                         [torch.arange(c.start, c.start + c.n_tokens, device=device) for c in cs])

    def _read_keys(self, layer: int, exact: bool) -> torch.Tensor:
        """Every cached key of `layer` (B, H, L, D) float32 as attention reads it: dequantized (or exact) and, with
        pre-RoPE keys, rotated at their positions (made on the keys' device)."""
        K = self._gather(layer, "k", exact)
        return self.rope(K, self.positions(layer, K.device)) if self.config.rope == "pre" else K

    def _gather(self, layer: int, which: str, exact: bool) -> torch.Tensor:
        """All cached keys or values of `layer`, (B, H, L, D) float32, dequantized or exact."""
        cs = self._chunks(self._layer(layer))
        if not cs:
            raise ValueError(f"layer {layer} of the cache is empty")
        parts = []
        for c in cs:
            full, kept = (c.k, c.exact_k) if which == "k" else (c.v, c.exact_v)
            if exact and full is None:
                if kept is None:
                    raise ValueError(f"exact {'keys' if which == 'k' else 'values'} of quantized chunks need "
                                     "CacheConfig(keep_exact=True)")
                parts.append(kept.float())
            else:
                parts.append(self._decode(c, which))
        return torch.cat(parts, 2)

    def keys(self, layer: int, exact: bool = False) -> torch.Tensor:
        """All cached keys, dequantized and (pre-RoPE mode) rotated: caller's layout, float32.

        exact=True returns the unquantized keys (needs keep_exact=True for quantized chunks).
        """
        return self._out(self._read_keys(layer, exact))

    def values(self, layer: int, exact: bool = False) -> torch.Tensor:
        """All cached values, dequantized: caller's layout, float32 (exact=True as for keys)."""
        return self._out(self._gather(layer, "v", exact))

    def key_steps(self, layer: int) -> torch.Tensor | None:
        """Per-element quantization step Δ of every cached key (B, H, L, D), internal layout, zeros for
        full-precision chunks; None when no key is quantized. What +jensen's bias is made of."""
        if not self.quantize_k:
            return None
        parts = []
        for c in self._chunks(self._layer(layer)):
            B, H, D = c.bhd
            if c.k_enc is None:
                parts.append(torch.zeros(B, H, c.n_tokens, D, device=c.k.device))  # full precision: exact
            else:
                parts.append(c.k_enc.step().reshape(B, H, c.n_tokens, D))
        return torch.cat(parts, 2)

    def logit_bias(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor | None:
        """The +jensen term -(τ²/24) Σ_i q_i² Δ_{j,i}² for every (query, cached key): (B, H, Nq, L) or None.

        q is (B, H, Nq, D) (internal layout). Every logit a +jensen method compares (attention, shift rates,
        heatmaps) adds this term."""
        if not self.config.jensen:
            return None
        return jensen_bias(q, self.key_steps(layer), scale)
