"""How much one world's BF16 memory varies: the spread behind the memorisation check's number of seeds.

    python benchmarks/twin_spread.py [--weights W] [--first 200000] [--seeds 24]

For each world seed from `--first` on, rolls the built-in model out in BF16 on a 32-frame loop twice: on the
held-out photographs' world and on its matched twin (`photos="training-matched"`: the same layout, crops,
trajectory and noise, one training photograph of the same kind per held-out scene). Prints per seed the
PSNR against ground truth on the revisited views of both and their difference, then the mean difference,
its standard deviation and the standard error of the mean. The default seeds (200000 on) are used by no
training run (100000 + --worlds) and by no reported evaluation (below 100000), so the spread can size the
evaluation without looking at it.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from quantwm.core.cache import CacheConfig
from quantwm.world.generate import generate, load_world_model


def revisit_psnr(model, seed: int, photos: str) -> float:
    return generate(model, seed, "loop", 32, CacheConfig(), probe=False, photos=photos).revisit_psnr()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--weights", default=None, help="model weights (default: the committed model)")
    ap.add_argument("--first", type=int, default=200_000, help="first world seed")
    ap.add_argument("--seeds", type=int, default=24, help="how many seeds")
    a = ap.parse_args(argv)
    if a.seeds < 2:
        ap.error("--seeds must be at least 2 (a spread needs two)")
    torch.set_num_threads(2)
    model = load_world_model(a.weights) if a.weights else load_world_model()
    diffs = []
    for seed in range(a.first, a.first + a.seeds):
        held, twin = revisit_psnr(model, seed, "held-out"), revisit_psnr(model, seed, "training-matched")
        diffs.append(held - twin)
        print(f"seed {seed}: held-out {held:6.2f} dB, matched twin {twin:6.2f} dB, difference {diffs[-1]:+.2f}",
              flush=True)
    sd = statistics.stdev(diffs)
    print(f"mean difference {statistics.fmean(diffs):+.2f} dB, standard deviation {sd:.2f} dB, "
          f"standard error {sd / len(diffs) ** 0.5:.2f} dB over {len(diffs)} seeds")


if __name__ == "__main__":
    main()
