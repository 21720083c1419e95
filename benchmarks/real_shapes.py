"""Wan-1.3B-sized chunked generation through the QuantWM cache: cache bytes, peak memory, time per chunk.

A randomly initialised diffusers WanTransformer3DModel with Wan 2.1 1.3B's shapes (30 layers, 12 heads x
128, FFN 8960, text dim 4096; 480x832 video -> 60x104 latents -> 30x52 = 1560 tokens per latent frame)
generates 7 chunks of 3 latent frames (21 latent frames) through `WanCacheAdapter`: per chunk `--steps`
Euler denoising passes, then the clean pass that commits. Each method runs in its own process so peak
memory is its own (CUDA: max allocated; CPU: max resident set). No weights are downloaded.

    python benchmarks/real_shapes.py                          # full size (a GPU: ~3 GB of bf16 weights)
    python benchmarks/real_shapes.py --reduced --steps 1      # CPU: 4x6 tokens per frame, same layers/heads

Cache bytes are counted from the tensors the cache stores after the last commit: `bf16 per latent frame`
from the full-precision chunks, `quantized per latent frame` from the quantized ones (codes and every piece
of metadata), and the whole-cache average with the BF16 sink/recent chunks included.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FULL = dict(latent_hw=(60, 104), text_tokens=512)
REDUCED = dict(latent_hw=(8, 12), text_tokens=16)


def build_model(layers: int, device: str, dtype: torch.dtype):
    """Wan 2.1 1.3B's architecture, randomly initialised in place (no fp32 copy, no download)."""
    from diffusers import WanTransformer3DModel
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    with torch.device("meta"):
        model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128,
                                      in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960,
                                      num_layers=layers)
    model = model.to(dtype).to_empty(device=device)  # allocated once, in the run dtype
    g = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "scale_shift_table" in name:  # as diffusers initialises it
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
            elif p.dim() >= 2:  # linear / conv weights: std 1/sqrt(fan_in)
                p.copy_(torch.randn(p.shape, generator=g) * p[0].numel() ** -0.5)
            elif name.endswith("weight"):  # norm gains
                p.fill_(1.0)
            else:
                p.zero_()
    model.rope = WanRotaryPosEmbed(128, (1, 2, 2), 1024).to(device)  # float64 tables (buffers): rebuild them
    return model.eval()


def peak_memory(device: str) -> int:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def worker(a) -> dict:
    """One method: build, generate, measure. Returns the JSON row."""
    from quantwm.adapters.diffusers_wan import WanCacheAdapter, wan_kv_cache
    from quantwm.core.cache import CacheConfig

    dev, dtype = a.device, torch.bfloat16
    shape = REDUCED if a.reduced else FULL
    lh, lw = shape["latent_hw"]
    tpf = (lh // 2) * (lw // 2)
    model = build_model(a.layers, dev, dtype)
    cache = wan_kv_cache(model, CacheConfig(a.method))
    g = torch.Generator(device="cpu").manual_seed(1)
    text = torch.randn(1, shape["text_tokens"], 4096, generator=g).to(dev, dtype)
    sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
    if dev.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    times, peak_cache, latents = [], 0, []
    with torch.no_grad(), WanCacheAdapter(model, cache) as wan:
        for i in range(a.chunks):
            x = torch.randn(1, 16, a.chunk_frames, lh, lw, generator=g).to(dev, dtype)
            sync()
            t0 = time.perf_counter()
            for s in range(a.steps):  # Euler steps of the flow from t=1000 to 0
                with wan.chunk(i):
                    v = model(x, torch.tensor([1000.0 * (1 - s / a.steps)], device=dev), text).sample
                x = (x.float() - v.float() / a.steps).to(dtype)
            with wan.chunk(i, commit=True):
                model(x, torch.tensor([0.0], device=dev), text)
            sync()
            times.append(time.perf_counter() - t0)
            peak_cache = max(peak_cache, cache.nbytes())
            latents.append(x.float().cpu())
    quant = cache.quantized_bytes()
    full = cache.nbytes() - quant
    frames = lambda quantized: sum(c.n_tokens for c in cache.inspect(0) if c.quantized == quantized) // tpf
    total_frames = a.chunks * a.chunk_frames
    if a.latents_out:
        torch.save(torch.cat(latents, 2), a.latents_out)
    return {"method": a.method, "device": dev, "layers": a.layers, "tokens_per_frame": tpf, "latent_hw": [lh, lw],
            "chunks": a.chunks, "chunk_frames": a.chunk_frames, "steps": a.steps,
            "bf16_bytes_per_latent_frame": full / frames(False) if frames(False) else None,
            "quantized_bytes_per_latent_frame": quant / frames(True) if frames(True) else None,
            "cache_bytes_per_latent_frame": cache.nbytes() / total_frames, "cache_bytes": cache.nbytes(),
            "peak_cache_bytes": peak_cache, "peak_memory_bytes": peak_memory(dev),
            "seconds_per_chunk": sum(times[1:]) / max(1, len(times) - 1), "chunk_seconds": times,
            "bits_per_element": cache.bits_per_element()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reduced", action="store_true", help="CPU size: 8x12 latents (4x6 tokens per frame), 16 text tokens")
    ap.add_argument("--methods", default="bf16,quantwm")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--chunks", type=int, default=7)
    ap.add_argument("--chunk-frames", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="denoising passes per chunk before the committing pass")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--method", help=argparse.SUPPRESS)  # worker mode: one method, one JSON line
    ap.add_argument("--latents-out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    for name in ("layers", "chunks", "chunk_frames", "steps", "threads"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    torch.set_num_threads(a.threads)
    if a.method:
        print(json.dumps(worker(a)))
        return 0
    from quantwm.core.methods import parse_method_name
    from quantwm.evaluation.metrics import rel_err

    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    for m in methods:
        parse_method_name(m)
    rows, tmp = [], tempfile.mkdtemp()
    for m in methods:
        args = [sys.executable, __file__, "--method", m, "--latents-out", os.path.join(tmp, f"{m}.pt")]
        args += [f"--{k.replace('_', '-')}={getattr(a, k)}" for k in ("layers", "chunks", "chunk_frames", "steps", "device", "threads")]
        args += ["--reduced"] if a.reduced else []
        done = subprocess.run(args, capture_output=True, text=True, check=False)
        if done.returncode:
            print(done.stderr, file=sys.stderr)
            return 1
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    ref = os.path.join(tmp, "bf16.pt")
    for r in rows:
        if os.path.exists(ref):
            r["latents_rel_mse_vs_bf16"] = rel_err(torch.load(os.path.join(tmp, f"{r['method']}.pt")), torch.load(ref))
    r0 = rows[0]
    print(f"Wan-1.3B-sized random transformer on {r0['device']}: {r0['layers']} layers, 12 heads x 128, "
          f"{r0['tokens_per_frame']} tokens/latent frame, {r0['chunks']} chunks x {r0['chunk_frames']} latent frames, "
          f"{r0['steps']} denoising pass(es) + 1 commit pass per chunk")
    mb = lambda x: "n/a" if x is None else f"{x / 2**20:.2f} MiB"
    for r in rows:
        print(f"{r['method']:>8}: quantized {mb(r['quantized_bytes_per_latent_frame'])}/frame, bf16 "
              f"{mb(r['bf16_bytes_per_latent_frame'])}/frame, whole cache {mb(r['cache_bytes_per_latent_frame'])}/frame "
              f"({mb(r['cache_bytes'])}); peak cache {mb(r['peak_cache_bytes'])}, peak memory {mb(r['peak_memory_bytes'])}; "
              f"{r['seconds_per_chunk']:.2f} s/chunk (chunks 2..); "
              "latents rel MSE vs bf16 " + (f"{r['latents_rel_mse_vs_bf16']:.3g}" if "latents_rel_mse_vs_bf16" in r
                                            else "n/a (bf16 not run)"))
    full_bf16 = next((r["bf16_bytes_per_latent_frame"] for r in rows if r["method"] == "bf16"), None)
    for r in rows:
        if full_bf16 and r["quantized_bytes_per_latent_frame"]:
            print(f"{r['method']}: quantized chunks {full_bf16 / r['quantized_bytes_per_latent_frame']:.2f}x smaller "
                  f"per latent frame than bf16; whole cache {full_bf16 / r['cache_bytes_per_latent_frame']:.2f}x")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
