"""The procedural world: a textured 2-D map larger than the view, camera trajectories, rendering.

A world is a (3, S, S) image in [0, 1] made of a smooth colour field, rectangles at several scales and
fine 2-pixel block texture (so blur is punished). The camera sees a `view` x `view` patch window; its
pose is the window's top-left corner in patch units. Trajectories move at most one patch per frame per
axis and come back to places seen earlier:

* "loop":        out along a random direction, then back the same way (revisits the start)
* "pan-return":  pan horizontally, then return
* "random-walk": random steps, pulled back towards the start
"""
from __future__ import annotations

import math

import torch

TRAJECTORIES = ("loop", "pan-return", "random-walk")


def make_world(seed: int, size: int = 256) -> torch.Tensor:
    """A (3, size, size) float world map in [0, 1], fully determined by `seed`."""
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
