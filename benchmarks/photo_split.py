"""How the photographic world's held-out set was chosen: a rule on a model-free measure, no model involved.

    python benchmarks/photo_split.py [--top 10]

A model copying a revisited place must reproduce each 8x8 patch; what is hard to copy is the detail inside a
patch. For every bundled photograph this prints its fine-detail energy (the mean squared residual after
removing each 8x8 patch's mean, at the photograph's own scale), whether it is grey, and then ranks every
held-out set of two colour and two grey scenes, one photograph each (the motorcycle stereo pair is one scene
of two photographs, so it stays on the training side), by how far the held-out side's mean and spread of
detail lie from the training side's: |difference of means| + |difference of standard deviations|, each side
over its photographs. `scene.HELD_OUT_PHOTOS` is the first row.
"""
from __future__ import annotations

import argparse
import itertools
import statistics

import torch.nn.functional as F

from quantwm.world import scene

PAIR = ("motorcycle_left", "motorcycle_right")


def detail(name: str) -> float:
    """Mean squared residual of a photograph after subtracting every 8x8 patch's mean."""
    p = scene.load_photo(name)
    h, w = p.shape[1] // 8 * 8, p.shape[2] // 8 * 8
    x = p[:, :h, :w]
    means = F.avg_pool2d(x[None], 8)[0].repeat_interleave(8, 1).repeat_interleave(8, 2)
    return float(((x - means) ** 2).mean())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--top", type=int, default=10, help="how many candidate splits to print")
    a = ap.parse_args(argv)
    names = sorted(scene.TRAIN_PHOTOS + scene.HELD_OUT_PHOTOS)
    d = {n: detail(n) * 1e3 for n in names}
    for n in names:
        print(f"{n:22s} {'grey ' if scene.is_grey(n) else 'colour'} detail {d[n]:6.2f}e-3")
    single = [n for n in names if n not in PAIR]
    colour, grey = [n for n in single if not scene.is_grey(n)], [n for n in single if scene.is_grey(n)]
    rows = []
    for held in (c + g for c in itertools.combinations(colour, 2) for g in itertools.combinations(grey, 2)):
        hv, tv = [d[n] for n in held], [d[n] for n in names if n not in held]
        score = abs(statistics.fmean(hv) - statistics.fmean(tv)) + abs(statistics.pstdev(hv) - statistics.pstdev(tv))
        rows.append((score, statistics.fmean(hv), statistics.fmean(tv), statistics.pstdev(hv),
                     statistics.pstdev(tv), held))
    rows.sort()
    print("\nscore  mean held/training  sd held/training  held-out set")
    for score, hm, tm, hs, ts, held in rows[:a.top]:
        print(f"{score:5.2f}  {hm:5.2f} / {tm:5.2f}      {hs:5.2f} / {ts:5.2f}     {', '.join(held)}")
    print(f"\nscene.HELD_OUT_PHOTOS: {', '.join(scene.HELD_OUT_PHOTOS)}")


if __name__ == "__main__":
    main()
