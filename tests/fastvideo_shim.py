"""The smallest shim that lets FastVideo's model modules import beside torch 2.13's CPU build (tests only).

FastVideo 0.2.1 imports `torchvision.utils.make_grid` at the top of `fastvideo/utils.py`, and torchvision's
compiled ops do not load beside this torch (0.28.0: "operator torchvision::nms does not exist"). The model
modules QuantWM drives never call torchvision. `install()` puts a stand-in `torchvision` into sys.modules that
holds only the names FastVideo's import chain reaches (`utils.make_grid`, `transforms.InterpolationMode`,
`transforms.functional`), each raising if called, and turns off transformers' torchvision probe, which would
otherwise find the stand-in and ask it for things it does not have. Never shipped: quantwm itself imports
FastVideo only when a user has a working one (docs/real-models.md).
"""
from __future__ import annotations

import enum
import importlib.machinery
import sys
import types


def _unavailable(name: str):
    def call(*args, **kwargs):
        raise RuntimeError(f"torchvision.{name} is not available: this is the test shim (tests/fastvideo_shim.py)")
    return call


def _module(name: str) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__spec__ = importlib.machinery.ModuleSpec(name, None)
    m.__path__ = []  # a package, so submodule imports resolve to the ones below
    return m


def install() -> None:
    """Install the stand-in torchvision (idempotent); a real, working torchvision is left alone."""
    if "torchvision" in sys.modules and not getattr(sys.modules["torchvision"], "_quantwm_shim", False):
        return
    import transformers.utils
    import transformers.utils.import_utils as iu

    for owner in (iu, transformers.utils):  # modules that bind the probe later read it from one of these
        owner.is_torchvision_available = owner.is_torchvision_v2_available = lambda: False
    tv, utils, transforms, functional, v2 = (_module(n) for n in (
        "torchvision", "torchvision.utils", "torchvision.transforms", "torchvision.transforms.functional",
        "torchvision.transforms.v2"))
    tv._quantwm_shim = True
    tv.__version__ = "0.0.0+quantwm-shim"
    utils.make_grid = _unavailable("utils.make_grid")

    class InterpolationMode(enum.Enum):
        NEAREST = "nearest"
        NEAREST_EXACT = "nearest-exact"
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"

    transforms.InterpolationMode = InterpolationMode
    for fn in ("resize", "center_crop", "normalize", "to_tensor", "to_pil_image", "pil_to_tensor"):
        setattr(functional, fn, _unavailable(f"transforms.functional.{fn}"))
    def v2_name(name: str):  # MMAudio's stages (imported by FastVideo's registry) name v2's transforms
        if name.startswith("__"):
            raise AttributeError(name)
        return _unavailable(f"transforms.v2.{name}")

    v2.__getattr__ = v2_name
    transforms.functional, transforms.v2 = functional, v2
    tv.utils, tv.transforms = utils, transforms
    sys.modules.update({m.__name__: m for m in (tv, utils, transforms, functional, v2)})
