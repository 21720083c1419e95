"""Typed span layouts: one frozen dataclass per storage form of a quantized span (docs/method.md §3.1).

A method's `encode` returns a layout; everything else reads the layout and never the method: it decodes
itself (`decode`, `step`), reports its stored bytes by component (`components`, `shared`, `nbytes`), and gives
the fused kernel its view (`kernel_side`, built once and kept with the span), the 8-bit path its integer codes
(`code_form`) and its centre (`center`).

    Full          a span kept in BF16 (the `bf16` method)
    Grouped       packed codes with per-group scales and zeros (rtn, kivi; every residual of a group coder)
    Channels      per-channel grids over the span with 0-8 bits each (QuantWM's allocator)
    TrellisChannels   the same buffer read as per-channel bitshift trellis codes (quantwm-trellis)
    Codebook      k-means stages (codebooks and ids) plus a residual layout (qvg, quantwm)
    Compensated   PSAC coefficients along a shared basis on top of a key layout (quantwm); RankCompensated
                  keeps a per-stream rank
    InBasis       any layout of coordinates in a shared orthogonal basis (QuantWM's allocator's Keys in the
                  history Queries' basis)
    TokenSplit    a span's few loud tokens in BF16 apart from any layout of the others (QuantWM's allocator)
    Rotated       per-token norms and Lloyd-Max codes of randomly rotated vectors (turboquant; no fused kernel)
    E2M1Blocks, TokenBlockInt8, ChannelFP8   the deployed formats (nvfp4, int8k-fp8v)

Only this package knows the names of a layout's tensors; `tests/test_layouts.py` checks that nothing outside it
tests them.
"""
from .base import CodeForm, Layout, views_built
from .basis import InBasis
from .channels import Channels
from .floats import ChannelFP8, E2M1Blocks, TokenBlockInt8
from .grouped import Codebook, Full, Grouped
from .psac import Compensated, RankCompensated
from .rotated import Rotated
from .split import TokenSplit, split_tokens
from .trellis import TrellisChannels

__all__ = ["ChannelFP8", "Channels", "CodeForm", "Codebook", "Compensated", "E2M1Blocks", "Full", "Grouped", "InBasis", "Layout",
           "RankCompensated", "Rotated", "TokenSplit", "split_tokens", "TokenBlockInt8", "TrellisChannels", "views_built"]
