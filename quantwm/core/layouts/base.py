"""The contract every span layout implements (see the package docstring), and the count of kernel views built.

A layout is frozen: a committed span never changes, so what is derived from it (the kernel's view, the 8-bit
path's centre) is computed on first use and kept (`functools.cached_property`). The cache asks for both when
it commits a span the fused path may read (`prepare`; on CUDA, or with QUANTWM_KERNELS=triton or `lowp`), so an
attend over a warm cache builds nothing and makes no host-device sync.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import torch

from ...kernels.span_args import PsacArgs, SideArgs

_built = [0]


def views_built() -> int:
    """How many kernel views of quantized spans this process has built (tests count a warm attend's builds)."""
    return _built[0]


class CodeForm(NamedTuple):
    """A quantized key side as integer codes (the 8-bit path's operand, quantwm/core/fp8.py): every key is
    k̂ = u ⊙ scale + offset (+ its codebook row), u = code − 2^(b−1) exact in 8 bits.

    u (S, N, D) float32; scales and offsets per token in groups of `group_size` channels (S, N, D / G), or per
    channel over groups of `group_size` tokens (S, ceil(N / G), D) when `axis_token`. `two_term`: the queries
    times the scales are rounded in two terms (the allocator's channels, whose widths differ)."""

    u: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    group_size: int
    axis_token: bool
    two_term: bool = False
    codebook: torch.Tensor | None = None
    ids: torch.Tensor | None = None


def _widened_for_device(side: SideArgs) -> SideArgs:
    """The side with its fp8 tensors (scales, zeros, codebook) widened to fp16 on GPUs without fp8 loads (compute
    capability below 8.9: Triton has no e4m3 there), once, here, rather than at every launch. Exact: every e4m3
    value is an fp16 value. Elsewhere the side as it is."""
    if not side.data.is_cuda or torch.cuda.get_device_capability(side.data.device) >= (8, 9):
        return side
    wide = {f: getattr(side, f).half() for f in ("scales", "zeros", "codebook")
            if getattr(side, f) is not None and getattr(side, f).dtype == torch.float8_e4m3fn}
    return side._replace(**wide)


ROLES = ("payload", "tables", "basis", "loud")  # Layout.roles: what a stored tensor is for


@dataclass(frozen=True, eq=False)
class Layout:
    """A stored span of S streams (one (batch, head) of a layer each), N tokens and head dim D."""

    @property
    def shape(self) -> tuple[int, int, int]:
        """(S, N, D) of the span."""
        raise NotImplementedError

    def components(self) -> dict[str, torch.Tensor]:
        """Every tensor this span alone stores, by component name."""
        raise NotImplementedError

    def shared(self) -> dict[str, torch.Tensor]:
        """Stored tensors this span shares with other spans (a PSAC basis); the cache counts each once."""
        return {}

    def roles(self) -> dict[str, str]:
        """What each stored tensor (components and shared) is for, one of ROLES: "payload" (the coded values),
        "tables" (scales, low ends, codebooks), "basis" (a stored basis) or "loud" (tokens kept exact). Forms that
        do not tell their side information apart call everything "payload"."""
        return dict.fromkeys({**self.components(), **self.shared()}, "payload")

    def bytes_by_component(self) -> dict[str, int]:
        return {k: t.numel() * t.element_size() for k, t in {**self.components(), **self.shared()}.items()}

    def nbytes(self) -> int:
        """Bytes of this span, shared tensors included."""
        return sum(self.bytes_by_component().values())

    def decode(self) -> torch.Tensor:
        """The span rebuilt, (S, N, D) float32."""
        raise NotImplementedError

    def step(self) -> torch.Tensor | None:
        """Per-element quantization step Δ (S, N, D) (what +jensen's bias is made of), or None if exact."""
        return None

    def describe(self) -> str:
        """One line naming the form, for reports."""
        return type(self).__name__

    def channel_bits(self) -> torch.Tensor | None:
        """(S, D) bits of each channel where the form gives every channel a width of its own (the allocator's
        `Channels`), else None: one grid for all."""
        return None

    # ---- the fused read path ------------------------------------------------------------------
    def make_kernel_side(self) -> SideArgs | None:
        """Build the kernel's view, uncached (subclasses; `kernel_side` keeps it); None when the kernel cannot
        read this form."""
        return None

    @cached_property
    def kernel_side(self) -> SideArgs | None:
        """The kernel's view of this span (kernels/span_args.py), built once; None: the reference path reads it."""
        side = self.make_kernel_side()
        if side is not None and self.quantized:
            _built[0] += 1
            side = _widened_for_device(side)
        return side

    @property
    def quantized(self) -> bool:
        return True

    def coded(self) -> tuple[torch.Tensor | None, Layout]:
        """(U, layout): the orthogonal basis the span's vectors are coded in (S, D, D), None for the model's own, and
        the layout of the coded coordinates. The read path attends with queries q U over that layout."""
        return None, self

    def keys_read(self) -> Layout:
        """The layout whose values the kernel rebuilds tile by tile (PSAC's correction comes apart, `psac_args`)."""
        return self

    def psac_args(self, q: torch.Tensor) -> PsacArgs | None:
        """PSAC's per-query inputs for queries q (S, Nq, D), or None when the span has no PSAC coefficients."""
        return None

    def reads_codes(self, qk: str) -> bool:
        """Whether the 8-bit path's QKᵀ takes this key side's integer codes as they are (`code_form`)."""
        return False

    def code_form(self) -> CodeForm:
        raise ValueError(f"{self.describe()} has no integer-code form")

    @cached_property
    def center(self) -> torch.Tensor:
        """A per-channel centre (S, D) float32 of the span read off its stored parameters (no decode pass): the
        8-bit path subtracts it from keys it rounds. Any centre keeps the logits exact but for rounding."""
        return self.make_center()

    def make_center(self) -> torch.Tensor:
        """The centre, uncached (subclasses read it off their stored parameters; `center` keeps it)."""
        return self.decode().mean(1)

    def view_tensors(self) -> list[torch.Tensor]:
        """What the read path derived from this span and keeps with it (the kernel view's own tables, the 8-bit
        path's centre), tensors the span stores excluded: runtime state, not in its stored bytes. Tensors several
        spans share (a PSAC basis in fp32) are the same objects in each; the cache counts them once."""
        stored = {t.data_ptr() for t in {**self.components(), **self.shared()}.values()}
        side = self.__dict__.get("kernel_side")
        derived = [t for t in (side or ()) if isinstance(t, torch.Tensor)] + [self.__dict__.get("center")]
        return [t for t in derived if t is not None and t.data_ptr() not in stored]

    def prepare(self, lowp: str | None = None) -> None:
        """Build what the read path needs now (at commit), so that attends over a warm cache build nothing."""
        side = self.kernel_side
        if side is not None and lowp is not None:
            _ = self.center
