"""`quantwm record --pipeline fastvideo:NAME`: BF16 and a method from the same noise, through FastVideo's own model
code, into a run file that `python app.py --run FILE` opens.

* **Model.** `tiny=True` builds a randomly initialised model of FastVideo's class at the module's tiny config,
  writes it as a FastVideo transformer folder and loads it back through FastVideo's `TransformerLoader` (the road a
  real checkpoint takes); `weights=DIR` loads a real one (a model folder with transformer/, or the transformer folder).
* **Runs.** BF16 is FastVideo's own KV cache (the reference); the method is QuantWM's cache, with the model's sink and
  window (`FastVideoModel.cache_config`). Both draw the same noise and conditioning from `seed`.
* **Probes.** On the last denoising pass of every chunk after the first, per layer and head, each query's top-1
  cached token under exact and under stored keys, the logits of the layers/heads asked for, and which latent token
  every cached key is (`Run.positions`: a window or a memory is not a prefix).
* **Frames.** A latent preview, not decoded pixels: the latents projected on the three principal directions of the
  BF16 run's latent channels (one projection for both runs), scaled to ±2.5 standard deviations and enlarged by the
  VAE's spatial factor, one image per latent frame. No VAE is loaded (a tiny run has none; decoding a real run's
  latents with its VAE is the pipeline's own decoding stage).
* **Cache map.** Per chunk, which latent frames its queries read and how they were held (BF16, quantized, a
  retrieved memory, conditioning): `meta["cache_map"]`, drawn on the app's long-run strip.
"""
from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from ...core.cache import KVCache
from ..attention import ChunkedAttention
from ..self_forcing import ProbeCapture, check_logit_picks
from . import get_model, runtime


class PositionProbe(ProbeCapture):
    """ProbeCapture that also keeps, per probed chunk, the latent token of every cached key (layer 0's order; every
    layer holds the same tokens)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.positions: dict[int, torch.Tensor] = {}

    def observe(self, cache, layer, chunk, commit, q, scale):
        super().observe(cache, layer, chunk, commit, q, scale)
        if not commit and chunk > 0 and layer == 0:
            n = self._bhd(cache, q).shape[1]
            self.positions[chunk] = cache.positions(0)[:-n].int().cpu()


def latent_preview(ref: torch.Tensor, other: torch.Tensor, spatial: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(F, h*spatial, w*spatial, 3) uint8 previews of two latent videos (C, F, h, w), one projection for both:
    BF16's three principal channel directions, ±2.5 standard deviations to the colour range."""
    C = ref.shape[0]
    x = ref.permute(1, 2, 3, 0).reshape(-1, C).double()
    mu = x.mean(0)
    _, _, vh = torch.linalg.svd(x - mu, full_matrices=False)
    P = vh[:3].T  # (C, 3)
    P = P * P.gather(0, P.abs().argmax(0, keepdim=True)).sign()  # a fixed sign: the largest loading positive
    scale = 2.5 * ((x - mu) @ P).std(0).clamp_min(1e-8)

    def img(lat: torch.Tensor) -> torch.Tensor:
        y = ((lat.permute(1, 2, 3, 0).double() - mu) @ P) / scale  # (F, h, w, 3) in about [-1, 1]
        y = ((y.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        return y.repeat_interleave(spatial, 1).repeat_interleave(spatial, 2)

    return img(ref), img(other)


def _given(inputs) -> tuple:
    """((name, tensor), ...) from a safetensors file or a dict; ValueError naming an unreadable file."""
    if inputs is None:
        return ()
    if isinstance(inputs, dict):
        return tuple(sorted(inputs.items()))
    from safetensors.torch import load_file

    if not Path(inputs).is_file():
        raise ValueError(f"--inputs {inputs}: no such file")
    try:
        return tuple(sorted(load_file(str(inputs)).items()))
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same user error
        raise ValueError(f"--inputs {inputs}: not a safetensors file ({str(e).splitlines()[0][:100]})") from None


def record_fastvideo(name: str, method: str = "quantwm", target: str = "kv", bits: int = 2,
                     budget: float | None = None, latent_frames: int | None = None, seed: int = 0,
                     tiny: bool = False, weights: str | Path | None = None, device: str = "cpu",
                     size: tuple[int, int] | None = None, logit_layers=(), logit_heads=(),
                     progress: Callable | None = None, inputs: str | Path | dict | None = None):
    """The run file contents (`runfile.Run`) of FastVideo model `name` with `method`'s cache against BF16.
    size: (height, width) in pixels of a --weights run (a tiny run's latent grid is 8x8). inputs: a safetensors file
    (or a dict) of conditioning tensors that replace the ones drawn from the seed, by name (the model's names: the
    error for an unknown one lists them); without it every input is drawn from `seed`."""
    from ...core.cache import CacheConfig
    from ...evaluation.runfile import Run, RunFacts, memory_meta

    spec = get_model(name)
    if tiny == (weights is not None):
        raise ValueError("give --tiny (a randomly initialised model of FastVideo's class) or --weights DIR, one of them")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device on this machine")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    CacheConfig(method=method, target=target, k_bits=bits, v_bits=bits, budget=budget)  # the cache's own messages
    given = _given(inputs)
    runtime.require()
    if tiny:
        spec.check_plan(spec.tiny_plan(latent_frames, seed))
        model = spec.build_tiny(0)
        with tempfile.TemporaryDirectory() as tmp:  # the checkpoint road: FastVideo's folder, FastVideo's loader
            spec.save(model, Path(tmp) / "transformer")
            model = spec.load(tmp, device)
        plan = replace(spec.tiny_plan(latent_frames, seed), given=given)
    else:
        if not Path(weights).is_dir():
            raise ValueError(f"--weights {weights}: no such folder")
        if size is None:
            raise ValueError("a --weights run needs --height and --width")
        cell = spec.vae_spatial * spec.patch
        if size[0] % cell or size[1] % cell:
            raise ValueError(f"height and width must be multiples of {cell}, got {size[0]}x{size[1]}")
        model = spec.load(weights, device)  # after every check that needs no weights: a real load takes minutes
        plan = replace(spec.plan(model, latent_frames or spec.default_frames, (size[0] // spec.vae_spatial,
                                                                               size[1] // spec.vae_spatial), seed),
                       given=given)
    spec.check_plan(plan)
    L, H, D = spec.shape(model)
    check_logit_picks(L, H, logit_layers, logit_heads)
    step = (lambda a, n: progress(a, 2 * n, "BF16 (FastVideo's cache)")) if progress else None
    ref = spec.rollout(model, plan, None, step)
    notes: list[str] = []
    cache = KVCache(spec.cache_config(model, notes, method=method, target=target, k_bits=bits, v_bits=bits,
                                      budget=budget, keep_exact=True, track_queries=True), L, rope=spec.key_rope(model))
    probe = PositionProbe(L, logit_layers, logit_heads)
    step = (lambda a, n: progress(n + a, 2 * n, f"{method} (QuantWM's cache)")) if progress else None
    out = spec.rollout(model, plan, ChunkedAttention(cache, probe), step)
    bf16, frames = latent_preview(ref.latents, out.latents, spec.vae_spatial)
    h, w = plan.latent_hw
    facts = RunFacts(f"{spec.title} (FastVideo {spec.class_name})", L, H, D, (h // spec.patch, w // spec.patch),
                     plan.chunk_frames, out.context_frames, vae_spatial=spec.vae_spatial, patch=spec.patch,
                     vae_temporal=1)  # chunks count from frame 0: conditioning frames are cache chunks too
    stats = torch.stack([cache.query_stats(layer).float().cpu() for layer in range(L)])
    meta = {"method": method, "target": target, "bits": bits, **memory_meta(cache.memory()),
            "logit_layers": list(logit_layers), "logit_heads": list(logit_heads),
            "configuration": cache.configuration, "cache_map": out.cache_map, "notes": notes + out.notes,
            "frames_are": "latent preview (three principal directions of the BF16 latents), one image per latent frame",
            "source": {"pipeline": f"fastvideo:{spec.name}", "class": spec.class_name, "fastvideo_file": spec.source,
                       "fastvideo": runtime.FASTVIDEO_VERSION, "tiny": tiny, "weights": None if tiny else str(weights),
                       "seed": seed, "latent_frames": plan.latent_frames, "budget": budget, "device": device,
                       "inputs": {"given": sorted(n for n, _ in given), "file": str(inputs) if isinstance(inputs, str | Path)
                                  else None, "drawn_from_seed": "every input not given"}}}
    top1 = probe.top1()
    positions = {c: p for c, p in probe.positions.items() if c in top1}
    return Run(facts, meta, bf16, frames, stats, top1, probe.logits(), positions)
