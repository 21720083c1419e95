"""Quantization methods behind one interface (`Method`) and a registry keyed by name."""
from . import allocator, formats, oscar, quantwm, qvg, rtn, span_rtn, turboquant  # noqa: F401  (registers every method)
from .base import REGISTRY, Method, SpanContext, get_method, known_methods, make_method, method_sources, parse_method_name

__all__ = ["REGISTRY", "Method", "SpanContext", "get_method", "known_methods", "make_method", "method_sources",
           "parse_method_name"]
