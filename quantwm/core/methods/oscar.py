"""OSCAR (Zhou, Zhuang, Li, Chen, Song, Athiwaratkun, Wu, "OSCAR: Offline Spectral Covariance-Aware Rotation for 2-bit
KV Cache Quantization", arXiv 2605.17757) as the `oscar` preset. Released code read: FutureMLS-Lab/OSCAR at 473ff3f
(rotation/compute_kv_rotation.py; the SGLang kernels in sglang-research/.../QuantKernel/oscar_rotation_clip_int2_kv.py).

Per layer and kind, a rotation R = U · H · P (the release's validated composition `r_h_pbr`): U the eigenvectors of an
attention-weighted covariance Σ, H the normalized Hadamard matrix of the head dim, P the permutation that puts the
column of U·H of the i-th largest eigenvalue at channel bitreverse(i).

* Keys: Σ_K = the history Queries' second moment S (SpanContext.stats), averaged over the layer's streams, as the
  release averages QᵀQ / n over a layer's KV heads.
* Values: Σ_V = the score-weighted covariance Σ_t w_t v_t v_tᵀ / N averaged over streams, w_t = k_t S k_tᵀ from the
  same span's keys and its stream's S, normalised to mean 1 per stream. The keys' weights pass from the Keys' encode,
  which the cache runs first (SpanContext.span); Values encoded without oscar's Keys (target "v") take w_t = 1 (the
  release's `vtv` objective).

Each rotated token y = x R is clipped to ±τ, τ the element at index ⌊clip · D⌋ of its sorted |y| (`k_clip` 0.96,
`v_clip` 0.92: the release's serving defaults, picked as its kernels pick them), then coded with `bits` asymmetric
min/max levels per group of `group_size` channels (None: the head dim, the release's group of 128), fp16 scale and
zero: 2 + 32/128 = 2.25 bits per element at 2 bits and head dim 128. Layout: `OscarSpan` (core/layouts/oscar.py).
The release's BF16 sink (64 tokens) and recent window (256) are the cache's `sink_chunks` and `recent_chunks`,
whole chunks, as for `kivi`.

Calibration: the release fits R offline, once per layer, on a calibration set, and serves with it fixed. Here,
training-free, R is fitted at the layer's first span quantized with a history, from that history, and kept
(SpanContext.state): every later span shares it, and the cache counts its D² fp16 values once per layer; the budget
rule counts them too, over what the layer will hold (core/budget.py, `budget_candidates`). Spans
quantized before any history use H alone (the release's data-free `hadamard` mode) and store nothing.

Deviations from the release, named:
* R is fitted from the run's own history, once, not from an offline calibration set; it is stored in fp16 and
  counted (the release keeps fp32 rotations beside the model, uncounted, and folds V's into the weights).
* scale and zero are fp16, rounded so the grid covers the clipped row (quant.quantize_groups, rounding "up"); the
  release serves fp32 scales and zeros (2.5 bits per element), while the paper's 2.28 bits count 16-bit ones (2.25
  plus the BF16 windows at 128K tokens).
* `bits` 3 and 4 use the same grid (the release serves INT2 only); its Lloyd-Max variant (SGLANG_LLOYD_MAX) is
  not built. Where the head dim is not a power of two, H is a seeded random orthogonal matrix and P takes the
  bit-reversed order of the next power of two, restricted to the head dim.
* `values="channels"` (not OSCAR): Values in span-rtn's per-channel span grids at `bits` (core/methods/span_rtn.py).
The fused kernel does not read the form: spans take the reference path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layouts import Grouped, Layout
from ..layouts.oscar import OscarSpan, data_free_rotation
from ..quant import SCALE_DTYPES, check_bits, quantize_groups, to_storage
from ..random_rotation import hadamard, is_power_of_two, random_rotation
from ..tables import on_device
from .base import Method, SpanContext, register
from .span_rtn import channel_values, check_values


def bit_reversed(d: int) -> torch.Tensor:
    """The bit-reversal permutation of range(d) (d a power of two); otherwise that of the next power of two with the
    entries ≥ d left out: (d,) int64."""
    n = max(1, (d - 1).bit_length())
    order = (torch.tensor([int(format(i, f"0{n}b")[::-1], 2) for i in range(2 ** n)], device="cpu") if d > 1
             else torch.zeros(1, device="cpu"))
    return order[order < d].long()


def oscar_rotation(cov: torch.Tensor) -> torch.Tensor:
    """R = U · H · P of a covariance (D, D) (see the module): (D, D) float32, orthogonal."""
    D = cov.shape[-1]
    vals, U = torch.linalg.eigh(cov.double().cpu())  # on the host: one read, once per layer and kind
    mix = hadamard(D).double() / D ** 0.5 if is_power_of_two(D) else random_rotation(D, 0).double()
    perm = torch.empty(D, dtype=torch.long, device="cpu")
    perm[bit_reversed(D)] = vals.argsort(descending=True)  # column bitreverse(i) <- the i-th largest eigenvalue's
    return (U @ mix)[:, perm].float()


def key_weights(k: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    """w_t = k_t S k_tᵀ per stream, normalised to mean 1: k (S, N, D), stats (S, D, D) -> (S, N)."""
    w = ((k @ stats) * k).sum(-1).clamp_min(0)
    return w / w.mean(1, keepdim=True).clamp_min(1e-30)


def clip_rows(y: torch.Tensor, clip: float) -> torch.Tensor:
    """Each row (..., D) clipped to ±τ, τ its element ⌊clip · D⌋ of the sorted |y| (clip 0: unclipped)."""
    if clip <= 0:
        return y
    D = y.shape[-1]
    tau = y.abs().kthvalue(min(int(clip * D), D - 1) + 1, dim=-1, keepdim=True).values
    return torch.maximum(torch.minimum(y, tau), -tau)


@register("oscar")
@dataclass(frozen=True)
class OSCAR(Method):
    name = "oscar"
    source = "arXiv 2605.17757; code github.com/FutureMLS-Lab/OSCAR (read at 473ff3f; also in its SGLang fork)"
    uses_queries = True
    layer_constants = True
    bits: int = 2
    group_size: int | None = None  # None: the head dim (the release's 128)
    k_clip: float = 0.96
    v_clip: float = 0.92
    scale_dtype: str = "fp16"
    values: str = "own"
    sweep = ({},)

    @classmethod
    def budget_candidates(cls, head_dim: int, kind: str) -> list[dict]:
        """Bits 4, 3, 2 (the release's INT2 last), one group of the head dim; last, 2 bits with fp8 scales and zeros
        (a deviation, named: the release serves fp32 ones, the paper counts 16-bit ones), which keep the paper's
        0.25 bits of side information per element where the head dim (64 in the built-in model) is below the
        release's group of 128 channels. The layer's rotation is counted on top (`layer_constants`, core/budget.py:
        over the elements the layer will hold where the caller knows them, else over the first span)."""
        return [{"bits": b} for b in (4, 3, 2)] + [{"bits": 2, "scale_dtype": "fp8"}]

    def __post_init__(self):
        check_bits(self.bits)
        check_values(self.values, self.bits)
        if self.group_size is not None and (isinstance(self.group_size, bool) or not isinstance(self.group_size, int)
                                            or self.group_size < 1):
            raise ValueError(f"group_size must be None (the head dim) or an integer >= 1, got {self.group_size!r}")
        for name in ("k_clip", "v_clip"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must lie in [0, 1] (0: no clipping), got {getattr(self, name)!r}")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype must be one of {', '.join(SCALE_DTYPES)}, got {self.scale_dtype!r}")

    def grid(self) -> str:
        group = f"groups of {self.group_size} channels" if self.group_size else "one group of the head dim"
        own = (f"OSCAR: {self.bits}-bit asymmetric ({2 ** self.bits} levels) per token, {group}, {self.scale_dtype} "
               f"scales and zeros, after the layer's attention-covariance rotation and a per-token clip "
               f"(K {self.k_clip:g}, V {self.v_clip:g} quantile)")
        return own if self.values == "own" else f"Keys {own}; Values span-rtn's per-channel grids at {self.bits} bits"

    def validate(self, x: torch.Tensor, kind: str) -> None:
        super().validate(x, kind)
        if self.group_size and x.shape[-1] % self.group_size:
            raise ValueError(f"head dim {x.shape[-1]} does not divide by group_size={self.group_size}")

    def rotation(self, x: torch.Tensor, kind: str, ctx: SpanContext) -> torch.Tensor | None:
        """The layer's stored rotation for `kind` (1, D, D) fp16, fitted now if this is its first span with a
        history; None before any history (the data-free rotation). x: the span (S, N, D) float32."""
        S, N, D = x.shape
        key = f"oscar.{kind}.rotation"
        if key in ctx.state and ctx.state[key].shape[-1] == D:
            return ctx.state[key]
        if not ctx.history:
            return None
        stats = ctx.stats_or_identity(S, D, x.device)
        if kind == "k":
            ctx.span["oscar.key_weights"] = key_weights(x, stats)  # for this span's Values (the same context)
            cov = stats.mean(0)
        else:
            w = ctx.span.get("oscar.key_weights")
            w = w if w is not None and w.shape == (S, N) else torch.ones(S, N, device=x.device)
            cov = ((x * w[..., None]).transpose(1, 2) @ x / N).mean(0)  # (S, D, D) -> (D, D)
        ctx.state[key] = to_storage(oscar_rotation(cov).to(x.device)[None], torch.float16)
        return ctx.state[key]

    def encode(self, x: torch.Tensor, kind: str, ctx: SpanContext) -> Layout:
        self.validate(x, kind)
        if (values := channel_values(self.values, self.bits, x, kind)) is not None:
            return values
        xf = x.float()
        D = x.shape[-1]
        stored = self.rotation(xf, kind, ctx)
        R = on_device(data_free_rotation(D), x.device)[None] if stored is None else stored.float()  # (1, D, D)
        y = clip_rows(xf @ R, self.k_clip if kind == "k" else self.v_clip)  # (S, N, D) rotated, clipped
        q = quantize_groups(y, self.bits, self.group_size or D, "channel", False, self.scale_dtype, "up")
        return OscarSpan(Grouped(q), stored)
