"""Quantization methods behind one interface (`Method`) and a registry keyed by name.

Every module of this package is imported here, so a method is one file: `quantwm/core/methods/foo.py` whose class,
decorated `@register("foo")`, declares its `source`, its budget rule (`budget_candidates`) and its frontier presets
(`sweep`); the registry, `quantwm methods`, the budget and the frontier read them from there (docs/api.md).
"""
import importlib
import pkgutil

from .base import REGISTRY, Method, SpanContext, get_method, known_methods, make_method, method_sources, method_sweeps, parse_method_name

for _module in pkgutil.iter_modules(__path__):  # registers every method, in file-name order
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["REGISTRY", "Method", "SpanContext", "get_method", "known_methods", "make_method", "method_sources",
           "method_sweeps", "parse_method_name"]
