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

`quantwm-trellis-v` (opt-in) codes the Values alone in the trellis (the Keys on quantwm-alloc's grids) and moves
0.25 bit per element of a budget for both from the Values to the Keys (`key_extra_bits`, read by
quantwm.core.budget.kind_budgets): the trellis's Values code about 3 dB better at the same bits, and the place
shift follows the Keys' bits (docs/method.md §2.10, "The Keys' share").
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


@register("quantwm-trellis-v")
@dataclass(frozen=True)
class QuantWMTrellisValues(QuantWMTrellis):
    """The Values alone in the trellis (the Keys on quantwm-alloc's grids), and 0.25 bit per element of a budget
    for both moved from the Values to the Keys (`key_extra_bits`): at B bits the Keys are configured at B + 0.25
    and the Values at B − 0.25, the two together storing B (docs/method.md §2.10, "The Keys' share")."""

    name = "quantwm-trellis-v"
    source = ("this project (docs/method.md §2.10): quantwm-trellis with the Values alone in trellis codes and "
              "0.25 bit of their budget spent on the Keys")
    at_budget = "quantwm-trellis-v"
    sweep = tuple({"budget": b} for b in BUDGETS)
    trellis_kinds: str = "v"
    key_extra_bits: float = 0.25
