"""The built-in model's copy ceiling: how faithfully it reproduces places its cache has seen.

(Written when the 192-wide model stopped at ~24 dB on revisited views; docs/world-model.md "Results on the built-in
model" has today's figures.)

    python benchmarks/world_copy_ceiling.py

Prints, for the committed weights and held-out worlds:
1. BF16 PSNR against ground truth with a static camera (every generated place is in all context frames);
2. PSNR on the revisited views of loops of 12, 16, 20 and 32 frames (does distance to the context matter?);
3. the low-frequency part of the revisit error (8x8 average pooling: patch means);
4. per layer, how well a least-squares linear probe reads each token's own patch back from its Values
   (half of the tokens fit, the other half scored), i.e. how much of a patch the model carries.
"""
from __future__ import annotations

import torch

from quantwm.core.cache import CacheConfig
from quantwm.evaluation import metrics as M
from quantwm.world.generate import generate, load_world_model
from quantwm.world.scene import patchify

SEEDS = (0, 1, 2, 3)


def main() -> None:
    torch.set_num_threads(2)
    model = load_world_model()
    cfg = model.cfg
    ctx = cfg.context_frames
    static = [float(M.psnr(r.frames[ctx:], r.ground_truth[ctx:]).mean()) for r in (
        generate(model, s, n_frames=12, probe=False, poses=torch.full((12, 2), 10)) for s in SEEDS)]
    print(f"static camera, 8 generated frames: {sum(static) / len(static):.2f} dB vs ground truth (seeds {SEEDS})")
    for n in (12, 16, 20, 32):
        ps, lows = [], []
        for s in SEEDS:
            r = generate(model, s, "loop", n, CacheConfig(), probe=False)
            rv = r.revisited()
            ps.append(r.revisit_psnr())
            err = (r.frames[rv] - r.ground_truth[rv]).permute(0, 3, 1, 2)
            lows.append(float(torch.nn.functional.avg_pool2d(err, cfg.patch).square().mean().sqrt()))
        print(f"loop of {n} frames: revisited views {sum(ps) / len(ps):.2f} dB; rms error of patch means "
              f"{sum(lows) / len(lows):.4f}")
    values, patches = {l: [] for l in range(cfg.layers)}, []
    for s in range(6):
        r = generate(model, s, "random-walk", 32, CacheConfig(), probe=False)
        patches.append(patchify(r.frames, cfg.patch).reshape(-1, cfg.patch_dim))  # what each clean pass saw
        for l in range(cfg.layers):
            v = r.cache.values(l, exact=True)[0]  # (H, L, D)
            values[l].append(v.permute(1, 0, 2).reshape(v.shape[1], -1))
    X = torch.cat(patches).double()
    for l in range(cfg.layers):
        V = torch.cat(values[l]).double()
        V = torch.cat([V, torch.ones(len(V), 1, dtype=V.dtype)], 1)
        half = len(V) // 2
        W = torch.linalg.lstsq(V[:half], X[:half]).solution
        mse = (V[half:] @ W - X[half:]).square().mean()
        print(f"layer {l}: linear probe Values -> own patch {float(-10 * torch.log10(mse)):.2f} dB ({len(V)} tokens)")


if __name__ == "__main__":
    main()
