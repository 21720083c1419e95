"""How hard each bundled photograph is for a model that has never seen any photograph: the split's check.

    python benchmarks/photo_difficulty.py [--weights out/stage2.safetensors] [--seeds 3]

For every photograph in `scene.TRAIN_PHOTOS + scene.HELD_OUT_PHOTOS`, worlds are drawn from that photograph
alone (same crops, flips and jitter as `scene.photo_world`) on seeds 300000 + i, which no evaluation and no
training run uses, and rolled out in BF16 on a 32-frame loop. Prints per photograph the mean PSNR against
ground truth on the revisited views, then the means of the two sides of the split. Run with the stage-2
weights (procedural worlds only: `git show 35d623a:assets/world_model.safetensors > out/stage2.safetensors`),
it measures the content's difficulty, not memorisation: the split is chosen so both sides score alike.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from quantwm.core.cache import CacheConfig
from quantwm.world import scene
from quantwm.world.generate import generate, load_world_model

SEED_BASE = 300_000  # neither evaluation (< 100000) nor training (100000 + --worlds)


def photo_psnr(model, name: str, seeds: int) -> float:
    saved = scene.TRAIN_PHOTOS
    scene.TRAIN_PHOTOS = (name,)  # photo_world draws tiles for seeds >= TRAIN_SEED_BASE from this tuple
    try:
        return statistics.fmean(generate(model, SEED_BASE + i, "loop", 32, CacheConfig(), probe=False).revisit_psnr()
                                for i in range(seeds))
    finally:
        scene.TRAIN_PHOTOS = saved


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--weights", default=None, help="model weights (default: the committed model)")
    ap.add_argument("--seeds", type=int, default=3)
    a = ap.parse_args(argv)
    torch.set_num_threads(2)
    model = load_world_model(a.weights) if a.weights else load_world_model()
    names = scene.TRAIN_PHOTOS + scene.HELD_OUT_PHOTOS
    res = {}
    for n in names:
        res[n] = photo_psnr(model, n, a.seeds)
        side = "held out" if n in scene.HELD_OUT_PHOTOS else "training"
        print(f"{n:22s} {side:9s} revisited views {res[n]:6.2f} dB", flush=True)
    for side, group in (("training", scene.TRAIN_PHOTOS), ("held out", scene.HELD_OUT_PHOTOS)):
        print(f"mean over {side} photographs: {statistics.fmean(res[n] for n in group):.2f} dB")


if __name__ == "__main__":
    main()
