"""Worlds, camera trajectories, rendering.

A world is a (3, S, S) map in [0, 1], larger than the view. Three kinds (`WORLDS`):

* "photo" (the default): a mosaic of real photographs and textures bundled with scikit-image (read
  offline with `skimage.data`): 1 to 4 rectangular tiles, each a crop of one photograph at a random scale,
  flipped and colour-jittered (grey textures get a random tint). The photographs are split once, by name:
  `HELD_OUT_PHOTOS` are never used for training; world seeds below `TRAIN_SEED_BASE` (evaluation) draw
  only from them, seeds at or above it only from `TRAIN_PHOTOS`.
* "procedural": a smooth colour field, rectangles at several scales and fine 2-pixel block texture (the
  world of the first models; kept so their results can be reproduced).
* "place": one held-out photograph, whole and untouched (no tiles, flips or jitter): its largest centred
  square resized to the map, so a view of a quarter of the map's side shows a quarter of the photograph's
  width and height, a part a person can name (the cat's eye, the cameraman's face). The seed picks the
  photograph (`place_photo`), and the trajectory's start as for every kind. Its 1.2 to 2 source pixels per map
  pixel lie inside the mosaic tiles' zoom range (0.5 to 2). An evaluation world only: a seed at or above
  `TRAIN_SEED_BASE` raises, so no training run can draw one.

The camera sees a `view` x `view` patch window; its pose is the window's top-left corner in patch units.
Trajectories move at most one patch per frame per axis and come back to places seen earlier:

* "loop":        out along a random direction, then back the same way (revisits the start)
* "pan-return":  pan horizontally, then return
* "random-walk": random steps, pulled back towards the start
"""
from __future__ import annotations

import math
from functools import cache

import torch
import torch.nn.functional as F

TRAJECTORIES = ("loop", "pan-return", "random-walk")
WORLDS = ("photo", "procedural", "place")
TRAIN_SEED_BASE = 100_000  # world seeds >= this are training worlds; evaluation seeds lie below it

# scikit-image's bundled photographs (name -> how to read it), split by scene. The held-out set is chosen by a
# rule on a model-free measure (benchmarks/photo_split.py): two colour and two grey scenes, one photograph each,
# whose fine-detail energy (8x8-patch residual) matches the training side in mean and spread. The motorcycle
# stereo pair is one scene, so both views sit on the same side: the training side.
TRAIN_PHOTOS = ("astronaut", "hubble_deep_field", "retina", "immunohistochemistry", "coffee", "motorcycle_left",
                "motorcycle_right", "grass", "brick", "moon", "coins", "clock")
HELD_OUT_PHOTOS = ("rocket", "chelsea", "camera", "gravel")
HELD_OUT_SCENES = HELD_OUT_PHOTOS


PHOTO_SIDES = ("training", "training-matched", "held-out")


def make_world(seed: int, size: int = 256, kind: str = "photo", photos: str | None = None) -> torch.Tensor:
    """A (3, size, size) float world map in [0, 1] of the given kind, fully determined by `seed`.

    `photos` ("training" / "training-matched" / "held-out") overrides which side of the split a photographic
    world's tiles come from; by default the seed decides (see the module docstring). The layout (tiles,
    crops, zooms, jitter) still follows the seed, so `photos="training"` on an evaluation seed gives that
    world's twin made of training photographs: the memorisation check compares such pairs.
    "training-matched" gives the twin one training photograph per held-out scene (a per-seed choice, grey for
    grey and colour for colour), so its tiles repeat a photograph exactly where the held-out world's tiles
    repeat a scene, and are grey exactly where the held-out world's are."""
    if kind not in WORLDS:
        raise ValueError(f"unknown world {kind!r}; known: {', '.join(WORLDS)}")
    if seed < 0:
        raise ValueError(f"world seed must be >= 0, got {seed}")
    if photos is not None and photos not in PHOTO_SIDES:
        raise ValueError(f"photos must be one of {', '.join(PHOTO_SIDES)}, got {photos!r}")
    if kind == "place":
        if seed >= TRAIN_SEED_BASE:
            raise ValueError(f"a place world shows a held-out photograph, so it is an evaluation world: its seed "
                             f"must lie in [0, {TRAIN_SEED_BASE}), got {seed}")
        if photos not in (None, "held-out"):
            raise ValueError(f"a place world shows a held-out photograph only; photos={photos!r} applies to the "
                             "photo world")
        return place_world(seed, size)
    return photo_world(seed, size, photos) if kind == "photo" else procedural_world(seed, size)


@cache
def load_photo(name: str) -> torch.Tensor:
    """One bundled photograph as (3, H, W) float in [0, 1] (grey ones repeated over the channels)."""
    try:
        import skimage.data as data
    except ImportError as e:
        raise RuntimeError("the photographic world needs scikit-image (pip install scikit-image); "
                           "--world procedural does without") from e
    if name.startswith("motorcycle_"):
        left, right, _ = data.stereo_motorcycle()
        img = left if name == "motorcycle_left" else right
    else:
        img = getattr(data, name)()
    t = torch.from_numpy(img.copy()).float() / 255.0
    t = t[None].expand(3, -1, -1) if t.dim() == 2 else t[..., :3].permute(2, 0, 1)
    return t.contiguous()


def _split(g: torch.Generator, h: int, w: int, depth: int) -> list[tuple[int, int, int, int]]:
    """Rectangles (y, x, h, w) tiling an h x w map: cut across the longer side, up to `depth` times."""
    if depth == 0 or min(h, w) < 96 or torch.rand(1, generator=g).item() < 0.25:
        return [(0, 0, h, w)]
    along_h = h > w or (h == w and torch.rand(1, generator=g).item() < 0.5)
    n = h if along_h else w
    cut = int(n * (0.3 + 0.4 * torch.rand(1, generator=g).item()))
    a, b = _split(g, *((cut, w) if along_h else (h, cut)), depth - 1), \
        _split(g, *((h - cut, w) if along_h else (h, w - cut)), depth - 1)
    return a + [(y + cut, x, hh, ww) if along_h else (y, x + cut, hh, ww) for y, x, hh, ww in b]


def photo_world(seed: int, size: int = 256, photos: str | None = None) -> torch.Tensor:
    """A mosaic world of bundled photographs (held-out ones for seeds below TRAIN_SEED_BASE, unless `photos`
    names the side)."""
    return mosaic(seed, size, photos)[0]


def place_photo(seed: int) -> str:
    """The held-out photograph a place world of `seed` shows: seeds 0, 1, 2, 3 take rocket, chelsea, camera,
    gravel, and so on round."""
    return HELD_OUT_PHOTOS[int(seed) % len(HELD_OUT_PHOTOS)]


def place_world(seed: int, size: int = 256) -> torch.Tensor:
    """The place world (3, size, size): `place_photo(seed)`'s largest centred square, resized (antialiased when
    shrunk), its pixels otherwise the photograph's."""
    photo = load_photo(place_photo(seed))
    _, h, w = photo.shape
    side = min(h, w)
    y, x = (h - side) // 2, (w - side) // 2
    square = photo[None, :, y:y + side, x:x + side]  # (1, 3, side, side)
    return F.interpolate(square, size=(size, size), mode="bilinear", antialias=side > size,
                         align_corners=False)[0].clamp(0, 1)


def is_grey(name: str) -> bool:
    """Whether a bundled photograph is grey (its colour in a world comes from the jitter's tint alone)."""
    photo = load_photo(name)
    return bool(torch.equal(photo[0], photo[1]))


def _photo_list(seed: int, side: str) -> tuple[str, ...]:
    """The photographs a world's tiles are drawn from; for "training-matched", the stand-in of each of
    `HELD_OUT_SCENES` in turn: a training photograph of the same kind (grey or colour), of another scene per scene."""
    if side == "held-out":
        return HELD_OUT_PHOTOS
    if side == "training":
        return TRAIN_PHOTOS
    g = torch.Generator().manual_seed(1_000_003 + int(seed))  # its own stream: the layout's stays the same
    pools = {kind: [n for n in TRAIN_PHOTOS if is_grey(n) == kind] for kind in (False, True)}
    stand_ins = []
    for held in HELD_OUT_SCENES:
        pool = [n for n in pools[is_grey(held)] if scene_of(n) not in {scene_of(x) for x in stand_ins}]
        stand_ins.append(pool[int(torch.randint(0, len(pool), (1,), generator=g))])
    return tuple(stand_ins)


def scene_of(name: str) -> str:
    """The scene a photograph shows: the motorcycle stereo pair is one."""
    return "motorcycle" if name.startswith("motorcycle_") else name


def mosaic(seed: int, size: int = 256, photos: str | None = None) -> tuple[torch.Tensor, list[str]]:
    """The photographic world (3, size, size) and the photograph each tile was cut from, in tile order."""
    side = photos or ("training" if seed >= TRAIN_SEED_BASE else "held-out")
    names, forced = _photo_list(seed, side), None
    if side == "training-matched":  # tile i: the stand-in of the held-out world's tile i's scene (same repeats)
        stand_in = dict(zip(HELD_OUT_SCENES, names))
        forced = [stand_in[scene_of(n)] for n in mosaic(seed, size, "held-out")[1]]
    g = torch.Generator().manual_seed(int(seed))
    img, used = torch.zeros(3, size, size), []
    for i, (y, x, h, w) in enumerate(_split(g, size, size, depth=2)):
        pick = int(torch.randint(0, len(names), (1,), generator=g))
        used.append(forced[i] if forced else names[pick])
        photo = load_photo(used[-1])
        _, ph, pw = photo.shape
        zoom = 2 ** (torch.rand(1, generator=g).item() * 2.0 - 1.0)  # source pixels per map pixel: 0.5 .. 2
        ch, cw = min(ph, max(8, round(h * zoom))), min(pw, max(8, round(w * zoom)))
        cy = int(torch.randint(0, ph - ch + 1, (1,), generator=g))
        cx = int(torch.randint(0, pw - cw + 1, (1,), generator=g))
        tile = photo[:, cy:cy + ch, cx:cx + cw]
        if torch.rand(1, generator=g).item() < 0.5:
            tile = tile.flip(2)
        if torch.rand(1, generator=g).item() < 0.2:
            tile = tile.flip(1)
        tile = F.interpolate(tile[None], size=(h, w), mode="bilinear", antialias=zoom > 1, align_corners=False)[0]
        gain = 0.8 + 0.4 * torch.rand(3, 1, 1, generator=g)  # colour jitter; grey textures get a stronger tint
        if is_grey(used[-1]):
            gain = 0.55 + 0.9 * torch.rand(3, 1, 1, generator=g)
        gamma = 2 ** (0.6 * torch.rand(1, generator=g).item() - 0.3)
        img[:, y:y + h, x:x + w] = (tile.clamp(0, 1) ** gamma * gain).clamp(0, 1)
    return img, used


def procedural_world(seed: int, size: int = 256) -> torch.Tensor:
    """The procedural (3, size, size) world: colour field, rectangles and 2-pixel block texture."""
    g = torch.Generator().manual_seed(int(seed))
    yy, xx = torch.meshgrid(torch.linspace(0, 1, size), torch.linspace(0, 1, size), indexing="ij")
    img = torch.zeros(3, size, size)
    for c in range(3):  # smooth colour field
        a, b, p = torch.rand(3, generator=g) * torch.tensor([4.0, 4.0, 6.28])
        img[c] = 0.5 + 0.25 * torch.sin(a * 3.1 * xx + b * 2.3 * yy + p)
    for scale, count in ((48, 10), (24, 40), (10, 160), (4, 500)):  # rectangles, coarse to fine
        for _ in range(count):
            h, w = (int(v) for v in torch.randint(scale // 2, scale + 1, (2,), generator=g))
            y, x = (int(v) for v in torch.randint(0, size, (2,), generator=g))
            img[:, y:y + h, x:x + w] = torch.rand(3, 1, 1, generator=g)
    fine = torch.rand(3, size // 2, size // 2, generator=g).repeat_interleave(2, 1).repeat_interleave(2, 2)
    return (0.8 * img + 0.2 * fine).clamp(0, 1)


def trajectory(kind: str, n_frames: int, seed: int, world_patches: int = 32, view: int = 8) -> torch.Tensor:
    """Camera poses (n_frames, 2) long: the view's top-left corner (row, col) in patches."""
    if kind not in TRAJECTORIES:
        raise ValueError(f"unknown trajectory {kind!r}; known: {', '.join(TRAJECTORIES)}")
    if n_frames < 1:
        raise ValueError(f"n_frames must be >= 1, got {n_frames}")
    g = torch.Generator().manual_seed(int(seed) + 7)
    hi = world_patches - view
    t = torch.arange(n_frames).float()
    out_and_back = torch.minimum(t, (n_frames - 1 - t)).clamp_min(0)  # distance from the start
    if kind == "random-walk":
        start = torch.randint(0, hi + 1, (2,), generator=g)
        poses = torch.zeros(n_frames, 2)
        poses[0] = start.float()
        for i in range(1, n_frames):
            pull = (start.float() - poses[i - 1]).sign() * (torch.rand(2, generator=g) < 0.35).float()
            step = torch.randint(-1, 2, (2,), generator=g).float()
            poses[i] = poses[i - 1] + torch.where(pull != 0, pull, step)
    else:
        if kind == "loop":
            ang = torch.rand(1, generator=g).item() * 2 * math.pi
            d = torch.tensor([math.sin(ang), math.cos(ang)])
            d = d / d.abs().max()  # at most one patch per frame per axis
        else:
            d = torch.tensor([0.0, 1.0 if torch.rand(1, generator=g).item() < 0.5 else -1.0])
        ext = d * out_and_back.max()
        lo, top = (-ext).clamp_min(0), (hi - ext).clamp(max=hi)  # starts that keep the whole path inside
        start = lo + torch.rand(2, generator=g) * (top - lo).clamp_min(0)
        poses = start[None] + out_and_back[:, None] * d[None]
    poses = poses.round().long()
    # reflect off the world's edges so the view stays inside
    poses = torch.where(poses < 0, -poses, poses)
    poses = torch.where(poses > hi, 2 * hi - poses, poses)
    return poses.clamp(0, hi)


def render(world: torch.Tensor, poses: torch.Tensor, view: int = 8, patch: int = 8) -> torch.Tensor:
    """Frames (T, view*patch, view*patch, 3) float in [0, 1] seen from `poses` (T, 2) in patches."""
    px = view * patch
    frames = [world[:, r * patch:r * patch + px, c * patch:c * patch + px] for r, c in poses.tolist()]
    return torch.stack(frames).permute(0, 2, 3, 1).contiguous()


def token_world_coords(poses: torch.Tensor, view: int = 8) -> torch.Tensor:
    """World patch coordinates (T, view*view, 2) of every token, row-major inside a frame."""
    r, c = torch.meshgrid(torch.arange(view), torch.arange(view), indexing="ij")
    local = torch.stack([r.reshape(-1), c.reshape(-1)], -1)
    return poses[:, None, :] + local[None]


def patchify(frames: torch.Tensor, patch: int = 8) -> torch.Tensor:
    """(T, H, W, 3) -> (T, H/p * W/p, p*p*3) tokens, row-major."""
    T, H, W, C = frames.shape
    x = frames.reshape(T, H // patch, patch, W // patch, patch, C).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(T, (H // patch) * (W // patch), patch * patch * C)


def unpatchify(tokens: torch.Tensor, view: int = 8, patch: int = 8) -> torch.Tensor:
    """(T, view*view, p*p*3) -> (T, view*p, view*p, 3)."""
    T = tokens.shape[0]
    x = tokens.reshape(T, view, view, patch, patch, 3).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(T, view * patch, view * patch, 3)
