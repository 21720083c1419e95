"""QuantWM: training-free 2-bit KV-cache quantization for autoregressive video world models.

Public names: the cache (`KVCache`, `CacheConfig`), the method registry (`get_method`, `known_methods`),
trace files (`TraceWriter`, `read_trace`). See README.md and docs/method.md.
"""
from .core.cache import CacheConfig, KVCache
from .core.methods import get_method, known_methods
from .evaluation.trace import TraceWriter, read_trace

__all__ = ["CacheConfig", "KVCache", "get_method", "known_methods", "TraceWriter", "read_trace"]
