"""`textbook`: the textbook transform coder of the Keys, in QuantWM's own format (issue 44's yardstick).

The coder every transform-coding text describes (Huang & Schultheiss 1963; Gersho & Gray, "Vector Quantization
and Signal Compression", ch. 8), for the logit error eᵀ S e: Keys rotated into the eigenbasis of the history
Queries' S (every direction, stored and counted), each coordinate weighed by λ_i = u_iᵀ S u_i, widths 0-8 bits
given by reverse water-filling of the predicted error within the budget (QuantWM's greedy allocator,
quantwm/core/allocate.py), each coordinate on its own uniform grid with a clip search, the span's mean row as
its one smoothing. Values are coded in the model's channels by the same allocator with every channel weighed
alike.

It is built from QuantWM's allocator (`quantwm-alloc`) with what QuantWM adds beyond the textbook turned off:
the basis is S's own (not W = S^½ C S^½), S as observed (no re-aiming by RoPE), no loud tokens, no k-means
centroids. What it keeps from the allocator, and a textbook coder would not do on its own: a new basis is
stored only where the Gaussian price says it beats the model's channels, and a stored one is shared with later
spans while its first 16 directions capture 95% of S's top-16 energy (its bytes counted once, paid by the span
that stores it, within that span's budget: the basis is counted). Its stored format and read path are the
allocator's (`InBasis` over a `Codebook` of one row plus `Channels`), so a comparison with `quantwm` credits
the method and not the format.
"""
from __future__ import annotations

from dataclasses import dataclass

from .allocator import QuantWMAlloc
from .base import BUDGETS, register


@register("textbook")
@dataclass(frozen=True)
class Textbook(QuantWMAlloc):
    name = "textbook"
    source = "textbook transform coding (Huang & Schultheiss 1963; Gersho & Gray 1992, ch. 8), in this project's format"
    at_budget = "textbook"
    sweep = tuple({"budget": b} for b in BUDGETS)
    basis_rank: int = 128  # every direction of S's eigenbasis (at most the head dim)
    basis_share: float = 0.5  # a span may spend up to half its bits on a new basis (a whole D x D one at D = 128)
    basis_source: str = "queries"  # S's eigenvectors
    aim_chunks: int = 0  # S as observed
    loud: float = 0.0  # no tokens in BF16
    n_centroids: int = 1  # one mean row per span

    def grid(self) -> str:
        return (f"textbook transform coder at {self.budget:g} bits per element: Keys in the history Queries' "
                f"eigenbasis (up to {self.basis_rank} directions, counted), 0-8 bits per coordinate by reverse "
                "water-filling, uniform grids with a clip search, one mean row per span")
