"""Fake CUDA: tensors that say `device="cuda"` on a CPU-only machine and hold real values, so that a GPU path runs
here end to end with the two checks a GPU makes and a CPU run skips.

    with FakeCuda() as gpu:
        q = torch.randn(1, 2, 16, 64, device="cuda")   # a FakeCudaTensor: q.is_cuda, its values on the CPU
        out = cache.attend(0, q, k, v, chunk=0)        # every call runs on the CPU copies
    gpu.syncs                                          # Counter {(site, call): n} of the host reads made

* Devices: a call where a fake-CUDA tensor meets a CPU tensor (other than a 0-dim CPU tensor, which CUDA kernels
  take as a scalar) raises `FakeTensorDeviceMismatchError`, as CUDA would; so does a CPU `torch.Generator`
  drawing onto the device, and `.numpy()` of a device tensor. Indices may be CPU tensors (CUDA copies them over).
* Host syncs: a read of a device value on the host (`.item()`, `float(t)`, `bool(t)`, `.tolist()`, `.cpu()`,
  `torch.equal`, ...) or a result whose shape depends on device values (`nonzero`, `unique`, boolean-mask
  indexing, ...) goes through with its real value and is counted in `syncs`, keyed by the quantwm function that
  made it ("quantwm/core/quant.py:DeferredChecks.passed") and the call; the list is quantwm.core.syncs'. So is a
  copy of host data to the device ("to (upload)": `.to("cuda")`, `torch.tensor(..., device="cuda")`, CPU indices
  or values at an indexing): from pageable memory CUDA waits for the stream to finish it (memcpy_and_sync).
* `torch.cuda.get_device_capability` answers `capability` (default 9.0, an H100/H200) while the mode is on.

Why not torch's FakeTensorMode alone: its tensors hold no values, so the first host read ends the path (`bool(t)`
raises DataDependentOutputException; `float(t)`, `nonzero` and boolean masks reach a CUDA device guard and raise
"not linked with support for cuda devices"); with a ShapeEnv a read becomes an unbacked symbol that the first
branch on it refuses. The cache reads its span's checks at every quantizing commit, so no warm attend over a
quantized span would be reached. Here the calls are caught where Python calls torch (a TorchFunctionMode) and run
on the CPU copies: torch's own composite functions run inside on CPU tensors, not checked op by op.

What it cannot see: Triton kernels (run the references: QUANTWM_KERNELS=ref) and syncs inside a C++ call
(linalg's error checks).
"""
from __future__ import annotations

import os
import sys
from collections import Counter

import torch
from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError
from torch.overrides import TorchFunctionMode

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "quantwm") + os.sep

HOST_READS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__format__", "cpu",
                        "equal", "allclose", "is_nonzero"})
VALUE_SHAPED = frozenset({"nonzero", "unique", "unique_consecutive", "masked_select", "argwhere"})
INDEXING = frozenset({"__getitem__", "__setitem__", "index_put_", "index_put"})
# answered by the wrapper itself, not its CPU copy (_parse_to: nn.Module.to's parser keeps the device it is given)
METADATA = frozenset({"device", "is_cuda", "is_cpu", "get_device", "_parse_to"})
# calls that move data between devices or build tensors from host data: no one-device rule
CROSS_DEVICE = INDEXING | {"to", "copy_", "cpu", "cuda", "tensor", "as_tensor", "__repr__", "__format__", "__str__"}


class FakeCudaTensor(torch.Tensor):
    """A tensor that reports cuda:0 and keeps its values in `elem`, a CPU tensor of the same shape and strides."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, strides=elem.stride(),
                                                   storage_offset=elem.storage_offset(), dtype=elem.dtype,
                                                   device=CUDA, requires_grad=False)

    def __init__(self, elem: torch.Tensor):
        self.elem = elem

    def __repr__(self):
        return f"FakeCudaTensor({self.elem!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        """Outside a FakeCuda block (a failure report's repr): run on the CPU copies, wrap what comes back."""
        out = func(*_map(_unwrap, args), **_map(_unwrap, kwargs or {}))
        return _map(lambda t: FakeCudaTensor(t) if type(t) is torch.Tensor else t, out)


def _map(fn, x):
    """fn over the leaves of nested tuples (named, torch.Size, torch.return_types), lists and dicts."""
    if isinstance(x, list | tuple):
        out = [_map(fn, v) for v in x]
        if type(x) is list or type(x) is tuple:
            return type(x)(out)
        return type(x)(*out) if hasattr(x, "_fields") else type(x)(out)
    if isinstance(x, dict):
        return {k: _map(fn, v) for k, v in x.items()}
    return fn(x)


def _leaves(x, out: list) -> list:
    if isinstance(x, list | tuple):
        for v in x:
            _leaves(v, out)
    elif isinstance(x, dict):
        for v in x.values():
            _leaves(v, out)
    else:
        out.append(x)
    return out


def _unwrap(x):
    """A fake tensor's CPU copy; a cuda device named in the arguments becomes the CPU."""
    if isinstance(x, FakeCudaTensor):
        return x.elem
    d = _device_of(x)
    return CPU if d is not None and d.type == "cuda" else x


def _device_of(x) -> torch.device | None:
    if isinstance(x, torch.device):
        return x
    if isinstance(x, str) and x.split(":")[0] in ("cuda", "cpu"):
        return torch.device(x)
    return None


def _name(func) -> str:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):  # a property: its name is the property's
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def sync_site() -> str:
    """The innermost function in quantwm/ that led here, as "quantwm/core/cache.py:KVCache.commit" (a comprehension
    or lambda is named by the function that holds it)."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith(PACKAGE):
            return f"{os.path.relpath(code.co_filename, ROOT)}:{code.co_qualname.split('.<locals>')[0]}"
        frame = frame.f_back
    return "<outside quantwm>"


class FakeCuda(TorchFunctionMode):
    """Within `with FakeCuda() as gpu:`, `device="cuda"` makes FakeCudaTensors; see the module docstring."""

    def __init__(self, capability: tuple[int, int] = (9, 0)):
        super().__init__()
        self.syncs: Counter = Counter()
        self.capability = capability

    def __enter__(self):
        self._capability = torch.cuda.get_device_capability
        torch.cuda.get_device_capability = lambda device=None: self.capability
        return super().__enter__()

    def __exit__(self, *exc):
        torch.cuda.get_device_capability = self._capability
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = _leaves(kwargs, _leaves(args, []))
        fakes = [x for x in flat if isinstance(x, FakeCudaTensor)]
        wanted = [d for d in map(_device_of, flat) if d is not None]
        if not fakes and not any(d.type == "cuda" for d in wanted):
            return func(*args, **kwargs)  # nothing on the device
        name = _name(func)
        if name in METADATA:
            return func(*args, **kwargs)
        if name == "_has_compatible_shallow_copy_type":  # a CUDA tensor is no CPU tensor's: Module.to makes Parameters
            return len({isinstance(a, FakeCudaTensor) for a in args}) == 1
        if name in ("numpy", "__array__"):
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                            "to host memory first.")
        if name not in CROSS_DEVICE:
            _check_devices(func, flat)
        if name in INDEXING:
            _check_indexing(func, args)
        target = _target(name, args, kwargs, wanted, fakes)
        gen = kwargs.get("generator")
        if gen is not None and gen.device.type != target.type:
            raise FakeTensorDeviceMismatchError(func, target, gen.device)
        if fakes and _reads(name, args, kwargs, target.type == "cpu"):
            self.syncs[(sync_site(), name)] += 1
        elif target.type == "cuda" and _uploads(name, args, kwargs, flat):
            self.syncs[(sync_site(), f"{name} (upload)")] += 1
        if name == "cuda":
            func, args = torch.Tensor.to, (args[0], CPU)
        out = func(*_map(_unwrap, args), **_map(_unwrap, kwargs))
        if target.type != "cuda":
            return out
        elems = {id(x.elem): x for x in fakes}  # an in-place op returns its own (fake) tensor
        host = {id(x) for x in flat if isinstance(x, torch.Tensor) and not isinstance(x, FakeCudaTensor)}
        return _map(lambda t: _to_fake(t, elems, host), out)


def _to_fake(t, elems: dict, host: set):
    if not isinstance(t, torch.Tensor) or isinstance(t, FakeCudaTensor):
        return t
    if id(t) in elems:
        return elems[id(t)]
    return FakeCudaTensor(t.clone() if id(t) in host else t)  # .to("cuda") of a CPU tensor copies it, as on a GPU


def _is_fake(x) -> bool:
    return isinstance(x, FakeCudaTensor)


def _reads(name: str, args: tuple, kwargs: dict, to_host: bool, on_device=_is_fake) -> bool:
    """Whether a call on device tensors makes the host wait for a device value (quantwm.core.syncs' list);
    `to_host`: a `to` call copies to the host; `on_device(x)`: x is a device tensor."""
    if name in HOST_READS or name in VALUE_SHAPED:
        return True
    if name == "to":
        return to_host
    if name == "where":
        return len(args) + len(kwargs) == 1
    if name == "repeat_interleave":
        return any(on_device(a) for a in (*args[1:], *kwargs.values()))
    if name in INDEXING:
        index = args[1] if len(args) > 1 else None
        return any(on_device(p) and p.dtype == torch.bool for p in _leaves(index, []))
    return False


def _index_uploads(args: tuple) -> bool:
    """Whether an indexing call copies host data over: CPU indices, or a CPU value (not 0-dim) assigned."""
    index = _leaves(args[1] if len(args) > 1 else None, [])
    value = args[2] if len(args) > 2 else None
    return any(isinstance(p, torch.Tensor) and p.device.type == "cpu" for p in index) or (
        isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.dim() > 0)


def _uploads(name: str, args: tuple, kwargs: dict, flat: list) -> bool:
    """Whether the call copies host data to the device: CUDA's copy from pageable memory waits for the stream
    (memcpy_and_sync), a host sync like a read. A 0-dim CPU tensor passed as a kernel's scalar is no copy."""
    if name in ("to", "cuda", "copy_", "tensor", "as_tensor", "new_tensor"):
        return any(isinstance(x, torch.Tensor) and not isinstance(x, FakeCudaTensor) for x in flat) or \
            name in ("tensor", "as_tensor", "new_tensor")
    return name in INDEXING and _index_uploads(args)


def _check_devices(func, flat: list) -> None:
    """CUDA's rule: one device among the tensors, 0-dim CPU tensors aside (a kernel takes them as scalars)."""
    devices = {x.device for x in flat if isinstance(x, torch.Tensor) and not (x.device.type == "cpu" and x.dim() == 0)}
    if len(devices) > 1:
        raise FakeTensorDeviceMismatchError(func, CUDA, CPU)


def _check_indexing(func, args: tuple) -> None:
    """Indices on the CPU or the indexed tensor's device; values assigned at tensor indices on its device (or 0-dim)."""
    self = args[0]
    parts = [p for p in _leaves(args[1] if len(args) > 1 else None, []) if isinstance(p, torch.Tensor)]
    if any(p.device != self.device and p.device.type != "cpu" for p in parts):
        raise FakeTensorDeviceMismatchError(func, self.device, CUDA)
    value = args[2] if len(args) > 2 else None
    if isinstance(value, torch.Tensor) and value.device != self.device and value.dim() > 0 and parts:
        raise FakeTensorDeviceMismatchError(func, self.device, value.device)


def _target(name: str, args: tuple, kwargs: dict, wanted: list, fakes: list) -> torch.device:
    """Where a call's results live: the device it names, the CPU for a copy to host, else its tensors' device."""
    if name in ("cpu", "cuda"):
        return CPU if name == "cpu" else CUDA
    if wanted:
        return CUDA if wanted[-1].type == "cuda" else CPU
    if name == "to":
        other = next((a for a in (*args[1:], *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if other is not None:
            return other.device
    if name in ("__setitem__", "copy_"):
        return args[0].device
    return CUDA if fakes else CPU


class RealCuda(TorchFunctionMode):
    """The same count on a machine with a GPU: `device="cuda"` makes real CUDA tensors (CUDA raises its own device
    mismatches), and every host read of a device value, value-shaped result or copy of host data to the device is
    counted in `syncs` by quantwm site, with FakeCuda's rule. `device` names the device to watch (tests of this
    class use "cpu"). What a C++ call syncs inside (linalg's error checks, a kernel's own copies) is not seen here:
    `torch.cuda.set_sync_debug_mode` sees those (benchmarks/warm_attend.py)."""

    def __init__(self, device: str = "cuda"):
        super().__init__()
        self.syncs: Counter = Counter()
        self.device_type = device

    def _on_device(self, x) -> bool:
        return isinstance(x, torch.Tensor) and x.device.type == self.device_type

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = _leaves(kwargs, _leaves(args, []))
        name = _name(func)
        if name not in METADATA:
            on = [x for x in flat if self._on_device(x)]
            wanted = [d for d in map(_device_of, flat) if d is not None]
            to_host = bool(wanted) and wanted[-1].type == "cpu" and self.device_type != "cpu"
            if on and _reads(name, args, kwargs, to_host, self._on_device):
                self.syncs[(sync_site(), name)] += 1
            elif _real_uploads(name, args, kwargs, flat, wanted, self.device_type):
                self.syncs[(sync_site(), f"{name} (upload)")] += 1
        return func(*args, **kwargs)


def _real_uploads(name: str, args: tuple, kwargs: dict, flat: list, wanted: list, device: str) -> bool:
    """FakeCuda's `_uploads` for real tensors: host data copied to `device` (never on a CPU run of this class)."""
    if device == "cpu" or not (wanted and wanted[-1].type == device or any(
            isinstance(x, torch.Tensor) and x.device.type == device for x in flat)):
        return False
    if name in ("to", "cuda", "copy_"):
        return any(isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.dim() > 0 for x in flat)
    if name in ("tensor", "as_tensor", "new_tensor"):
        return True
    return name in INDEXING and _index_uploads(args)
