"""`quantwm-trellis`: QuantWM's allocator with each coded channel in a tail-biting bitshift trellis code, or on
its uniform grid where that codes it better (docs/method.md §2.10; quantwm/core/trellis.py), issue 44's block code.

Everything else is `quantwm-alloc`'s: the centroids, the Keys in the Queries' basis, loud tokens in BF16, S
re-aimed by RoPE, the per-channel widths by reverse water-filling within the budget (a channel priced as its
uniform grid's measured error times the trellis's Gaussian error ratio at that width). The stored bytes are the
allocator's to the byte: the same widths, tables and code buffer, only read differently; which of trellis and
grid codes a channel is a flag in its width byte, chosen at commit by their measured errors. One default differs:
its Values are decoded without shrinkage (`unbias`, docs/method.md §2.6 step 5), which a code that decodes to its
cell's mean needs more than a grid.

On a GPU the encoder is two Triton launches per batch of channels (kernels/trellis_viterbi.py: the tail-biting
start's search, then the channel's) and the fused attention kernel reads the codes (its TRELLIS form); on a CPU
PyTorch searches per width. Opt-in: the search does 256 state updates per coded sample (2^8 states; the 2^12 this
format first used would be 16 times as many), not yet timed on a GPU against the commit budget `quantwm` meets
(docs/results.md, "Trellis codes").
"""
from __future__ import annotations

from dataclasses import dataclass

from .allocator import QuantWMAlloc
from .base import BUDGETS, register


@register("quantwm-trellis")
@dataclass(frozen=True)
class QuantWMTrellis(QuantWMAlloc):
    name = "quantwm-trellis"
    source = ("this project (docs/method.md §2.10): quantwm-alloc with bitshift trellis codes after QTIP "
              "(arXiv 2406.11235)")
    at_budget = "quantwm-trellis"
    sweep = tuple({"budget": b} for b in BUDGETS)
    unbias: bool = True  # Values decoded without shrinkage: its codes shrink more than a grid (docs/method.md §2.6)
    codes: str = "trellis"
