"""Adapters that run real models' attention over the QuantWM cache, and trace capture.

`chunk_attention` / `ChunkedAttention` (attention.py) serve any model that calls its own attention;
`TraceCapture` (capture.py) records traces; `quantwm.adapters.diffusers_wan` drives diffusers' Wan
transformer (imported on its own, so `import quantwm.adapters` needs no diffusers).
"""
from .attention import ChunkedAttention, chunk_attention
from .capture import TraceCapture

__all__ = ["ChunkedAttention", "TraceCapture", "chunk_attention"]
