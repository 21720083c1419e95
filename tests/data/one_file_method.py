"""A method in one file (tests/test_method_in_one_file.py): its class declares its source, budget rule and frontier
presets, and nothing else in the project names it."""
from dataclasses import dataclass

from quantwm.core.methods.base import register
from quantwm.core.methods.span_rtn import SpanRTN


@register("onefile-rtn")
@dataclass(frozen=True)
class OneFileRTN(SpanRTN):
    name = "onefile-rtn"
    source = "tests/data/one_file_method.py: a test's method"
    sweep = ({}, {"values": "channels"})

    @classmethod
    def budget_candidates(cls, head_dim: int, kind: str) -> list[dict]:
        return [{"bits": b} for b in (4, 3)]
