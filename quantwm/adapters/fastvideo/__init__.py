"""The QuantWM paper's five world models run through QuantWM's cache inside FastVideo's own model code.

    from quantwm.adapters.fastvideo import get_model
    spec = get_model("lingbot-world-v2")            # or matrix-game-2, hy-world-1.5, longcat-video, self-forcing
    model = spec.load("/ckpt/LingBot-World-v2", device="cuda")       # FastVideo's TransformerLoader
    cache = KVCache(spec.cache_config(model, method="quantwm", budget=2.5), spec.shape(model)[0])
    rollout = spec.rollout(model, spec.plan(model, 21, (60, 104), seed=0), ChunkedAttention(cache))

`quantwm record --pipeline fastvideo:NAME` (record.py) writes BF16 (FastVideo's own KV cache) and a method (QuantWM's)
from the same noise into a run file for the app. Every model is one module here (see base.py for what a module
writes); FastVideo is imported only when a model is used (runtime.require says how to install it).
docs/real-models.md has what ran on the CPU and what needs weights and a GPU.
"""
from __future__ import annotations

import importlib

from .base import FastVideoModel, Plan, Rollout

# name -> (module, class); aliases point at the same class
_MODELS = {
    "lingbot-world-v2": (".lingbot", "LingBotWorld2"),
    "matrix-game-2": (".matrixgame", "MatrixGame2"),
    "hy-world-1.5": (".hyworld", "HYWorld15"),
    "longcat-video": (".longcat", "LongCatVideo"),
    "self-forcing": (".causal_wan", "SelfForcing"),
}
ALIASES = {"causal-forcing": "self-forcing"}  # Causal-Forcing runs FastVideo's same CausalWanTransformer3DModel
NAMES = tuple(_MODELS)


def get_model(name: str) -> FastVideoModel:
    """The FastVideo model description by name or alias; ValueError listing the known names."""
    key = ALIASES.get(name, name)
    if key not in _MODELS:
        known = ", ".join([*NAMES, *ALIASES])
        raise ValueError(f"unknown FastVideo model {name!r}; known: {known}")
    mod, cls = _MODELS[key]
    return getattr(importlib.import_module(mod, __name__), cls)()


__all__ = ["ALIASES", "NAMES", "FastVideoModel", "Plan", "Rollout", "get_model"]
