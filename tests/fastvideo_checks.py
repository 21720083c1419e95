"""The checks every FastVideo model's test runs (tests/test_fastvideo_*.py), on a tiny randomly initialised model of
FastVideo's own class, saved as a FastVideo transformer folder and loaded back by FastVideo's TransformerLoader."""
from __future__ import annotations

import fastvideo_shim
import torch

fastvideo_shim.install()

from quantwm.adapters.attention import ChunkedAttention  # noqa: E402
from quantwm.adapters.self_forcing import ProbeCapture  # noqa: E402
from quantwm.core.cache import KVCache  # noqa: E402


def tiny_loaded(spec, tmp_path, arch: dict | None = None, seed: int = 0):
    """spec's tiny model (optionally other arch fields), written as a FastVideo folder and loaded by FastVideo."""
    arch = {**spec.tiny_arch(), **(arch or {})}
    orig = spec.tiny_arch
    spec.tiny_arch = lambda: arch
    try:
        model = spec.build_tiny(seed)
        spec.save(model, tmp_path / "transformer", arch)
        return spec.load(tmp_path)
    finally:
        spec.tiny_arch = orig


def bf16_pair(spec, model, plan):
    """(FastVideo's own rollout, the same rollout through QuantWM's cache with method bf16)."""
    ref = spec.rollout(model, plan, None)
    cache = KVCache(spec.cache_config(model), spec.shape(model)[0], rope=spec.key_rope(model))
    return ref, spec.rollout(model, plan, ChunkedAttention(cache))


def quantized(spec, model, plan, budget: float = 2.5):
    """A quantwm rollout at `budget` bits: (rollout, cache, probe)."""
    L = spec.shape(model)[0]
    probe = ProbeCapture(L, [0], [0])
    cache = KVCache(spec.cache_config(model, method="quantwm", budget=budget, keep_exact=True, track_queries=True), L,
                    rope=spec.key_rope(model))
    return spec.rollout(model, plan, ChunkedAttention(cache, probe)), cache, probe


def check_quantized(spec, model, plan, budget: float = 2.5):
    """quantwm at `budget`: a top-1 shift recorded for every chunk after the first, bits within the budget, latents
    finite and near BF16's."""
    ref = spec.rollout(model, plan, None)
    out, cache, probe = quantized(spec, model, plan, budget)
    top1 = probe.top1()
    assert sorted(top1) == list(range(1, plan.chunks)), sorted(top1)
    L, H, _ = spec.shape(model)
    shifts = []
    for e, q in top1.values():
        assert e.shape[:2] == (L, H) and e.shape == q.shape
        shifts.append((e != q).float().mean().item())
    assert 0 <= min(shifts) and max(shifts) <= 1
    bits = cache.memory().span_bits_per_element
    assert 1.5 < bits <= budget + 1e-6, bits
    assert torch.isfinite(out.latents).all()
    rel = ((out.latents - ref.latents).norm() / ref.latents.norm()).item()
    assert 0 < rel < 0.5, rel
    return shifts, bits, rel
