"""Counting what a block of PyTorch runs: ATen ops, Triton kernel launches and host syncs, with each launching op's
bytes and FLOPs (benchmarks/commit_cost.py prices them).

    with TritonLaunches() as launches, counting(launches) as tally:
        cache.commit(0, 5)
    tally.ops, tally.launches, tally.views, tally.syncs    # syncs: [(name, where), ...]

Rule (a `TorchDispatchMode` over ATen, plus the kernels/ launchers):
* view: an ATen op whose schema aliases its output (`func.is_view`: view, slice, transpose, expand, detach,
  lift_fresh, ...);
* metadata: an op that launches no kernel: empty / empty_strided / empty_like / new_empty*, _unsafe_view, set_,
  resize_, size/stride queries, and any op whose tensors are all empty;
* host: on a CUDA run, an op whose tensors all live on the CPU (host time, no kernel);
* launching: every other ATen op, and every Triton kernel launch (a call of a kernels/ launcher, each launching one
  kernel; `TritonLaunches(reference=True)` runs its PyTorch twin instead, uncounted). `ops` = all of these.
Host syncs, each counted once:
* dispatch level: _local_scalar_dense (item/float/bool of a tensor), nonzero, _unique*/unique_*, masked_select,
  equal, bincount, histc, repeat_interleave without output_size, index/index_put with a boolean index, a blocking
  copy between host and device (CUDA runs), and the linear algebra that checks its info on the host on CUDA
  (`_linalg_check_errors`, visible after cholesky/inv/solve; hidden inside `_linalg_eigh` (eigh, eigvalsh),
  `_linalg_svd`, linalg_lstsq and linalg_eig, counted by name);
* function level: `quantwm.core.syncs.HostSyncs` (item, tolist, bool/int/float, .cpu(), torch.tensor, boolean
  indexing, ...). A call it names and the dispatch-level syncs inside it are one event each (the call alone when
  the dispatch level shows none, e.g. .cpu() on the CPU); on a CUDA run only a call with a CUDA tensor counts, on
  the CPU a .to(device object) does not (`x.to(y.device)` is "cpu" here and device-resident on a GPU).
Each sync's `where` is the innermost frame in quantwm/ or kernels/ ("quantwm/core/quant.py:120 quantize").
Bytes of an op: its tensors' distinct elements, in and out. FLOPs: 2MNK for mm/bmm/addmm/baddbmm, 4·B·H·Nq·Nkv·D
for SDPA, 2·x·K for a k-means or QSAC assignment, a constant x n³ per matrix for decompositions (DECOMPOSITIONS),
VITERBI_OPS per state update and VITERBI_STEP_OPS per step for the trellis's Viterbi search (a coded row's samples x
2^TABLE_BITS[width] updates, its sequential steps as work: see the constants), else the largest tensor's numel
(elementwise: the output; a reduction: its input).
Known limits: on the CPU every tensor is a host tensor, so a copy from the host to the device (a tensor built
without `device=` then moved) cannot be told from device-resident code; a CUDA run sees it.
"""
from __future__ import annotations

import os
import sys
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from quantwm.core.syncs import HostSyncs

MATMULS = {"mm", "bmm", "addmm", "baddbmm", "addbmm", "_int_mm"}
SDPA = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"}
DECOMPOSITIONS = {"_linalg_eigh": 9, "_linalg_svd": 12, "linalg_eig": 25, "linalg_qr": 4, "linalg_cholesky_ex": 1,
                  "linalg_inv_ex": 2, "_linalg_solve_ex": 2, "linalg_lu_factor_ex": 1, "linalg_lstsq": 4}  # x n³
LOOPED = {"_linalg_eigh", "_linalg_svd", "linalg_eig"}  # cuSOLVER runs these matrix by matrix (Kernel.matrices)
METADATA = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "_unsafe_view", "set_",
            "resize_", "resize_as_", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "size", "stride",
            "numel", "dim", "is_same_size", "record_stream"}
SYNC_OPS = {"_local_scalar_dense", "nonzero", "_unique", "_unique2", "unique_dim", "unique_consecutive",
            "unique_dim_consecutive", "masked_select", "equal", "bincount", "histc", "_linalg_check_errors",
            "_linalg_eigh", "_linalg_svd", "linalg_lstsq", "linalg_eig"}


def _sources() -> tuple[str, ...]:
    import importlib.util

    import quantwm
    kernels = importlib.util.find_spec("quantwm.kernels")
    dirs = [os.path.dirname(quantwm.__file__)] + list(kernels.submodule_search_locations if kernels else [])
    return tuple(os.path.realpath(d) + os.sep for d in dirs) + tuple(d + os.sep for d in dirs)


_SOURCES = _sources()
_COUNTER = os.path.join("core", "syncs.py")  # HostSyncs' own frame is not a source


def where() -> str:
    """The innermost frame in quantwm/ or kernels/: 'quantwm/core/quant.py:120 quantize'."""
    f = sys._getframe(1)
    while f is not None:
        path = f.f_code.co_filename
        for root in _SOURCES:
            if path.startswith(root) and not path.endswith(_COUNTER):
                return f"{os.path.relpath(path, os.path.dirname(root.rstrip(os.sep)))}:{f.f_lineno} {f.f_code.co_name}"
        f = f.f_back
    return "outside quantwm"


def touched(t: torch.Tensor) -> int:
    """Bytes of a tensor's distinct elements (an expanded dimension is read once)."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        n *= size if stride else 1
    return n * t.element_size()


def op_flops(name: str, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> float:
    """Approximate FLOPs of one ATen op from its tensors (the module docstring's rule)."""
    if name in MATMULS:
        a, b = ins[-2], ins[-1]  # addmm/baddbmm: (bias, a, b)
        return 2.0 * a.numel() * b.shape[-1]
    if name in SDPA:
        q, k = ins[0], ins[1]
        return 4.0 * q.numel() * k.shape[-2]
    if name in DECOMPOSITIONS:
        n = ins[0].shape[-1]
        return float(DECOMPOSITIONS[name] * n ** 3 * (ins[0].numel() // max(1, ins[0].shape[-2] * n)))
    return float(max((t.numel() for t in ins + outs), default=0))


@dataclass(frozen=True)
class Kernel:
    """One launching op: its name, bytes, FLOPs, dtype, whether tensor cores take it (a matmul), the matrices
    a decomposition that runs matrix by matrix works through (0 for any other op), and the source line that ran it
    (`where`)."""

    name: str
    nbytes: float
    flops: float
    dtype: torch.dtype
    matmul: bool = False
    matrices: int = 0
    source: str = field(default_factory=lambda: where())


@dataclass
class Tally:
    """What a counted block ran: op counts, its launching ops (`kernels`) and its syncs [(name, where)]."""

    ops: int = 0
    launches: int = 0
    views: int = 0
    metadata: int = 0
    host_ops: int = 0
    triton: int = 0
    kernels: list = field(default_factory=list)
    syncs: list = field(default_factory=list)

    @property
    def bytes(self) -> float:
        return sum(k.nbytes for k in self.kernels)

    @property
    def flops(self) -> float:
        return sum(k.flops for k in self.kernels)

    @property
    def by_op(self) -> Counter:
        return Counter(k.name for k in self.kernels)

    def launch(self, kernel: Kernel) -> None:
        self.ops += 1
        self.launches += 1
        self.kernels.append(kernel)


class OpCounter(TorchDispatchMode):
    """Counts every ATen op into `tally` (the module docstring's rule); `cuda`: the run's device is a GPU, so
    CPU-only ops are host ops and blocking host<->device copies are syncs."""

    def __init__(self, cuda: bool = False):
        super().__init__()
        self.tally, self.cuda, self.paused = Tally(), cuda, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.paused:
            self.record(func, args, kwargs, out)
        return out

    def record(self, func, args, kwargs, out) -> None:
        t, name = self.tally, func._overloadpacket.__name__
        ins = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        outs = [x for x in tree_leaves(out) if isinstance(x, torch.Tensor)]
        if self.is_sync(name, args, kwargs, ins, outs):
            t.syncs.append((f"aten.{name}", where()))
        if func.is_view:
            t.ops, t.views = t.ops + 1, t.views + 1
        elif name in METADATA or not any(x.numel() for x in ins + outs):
            t.ops, t.metadata = t.ops + 1, t.metadata + 1
        elif self.cuda and not any(x.is_cuda for x in ins + outs):
            t.ops, t.host_ops = t.ops + 1, t.host_ops + 1
        else:
            first = (ins or outs)[0]
            matrices = first.numel() // max(1, first.shape[-1] ** 2) if name in LOOPED else 0
            t.launch(Kernel(name, sum(map(touched, ins + outs)), op_flops(name, ins, outs), first.dtype,
                            name in MATMULS or name in SDPA, matrices))

    def is_sync(self, name: str, args, kwargs, ins: list, outs: list) -> bool:
        if name in SYNC_OPS:
            return True
        if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
            index = args[1] if len(args) > 1 else kwargs.get("indices", ())
            return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in index or ())
        if name == "repeat_interleave":
            return kwargs.get("output_size") is None and isinstance(args[0], torch.Tensor) and \
                (len(args) < 2 or isinstance(args[1], torch.Tensor)) and (len(args) < 4 or args[3] is None)
        if self.cuda and name in ("_to_copy", "copy_", "_copy_from"):  # a blocking copy between host and device
            blocking = not (kwargs.get("non_blocking") or (name != "_to_copy" and len(args) > 2 and args[2]))
            return blocking and len({x.is_cuda for x in ins + outs}) == 2
        return False


def _on_gpu(x) -> bool:
    if isinstance(x, torch.Tensor):
        return x.is_cuda
    return (isinstance(x, torch.device) and x.type == "cuda") or (isinstance(x, str) and x.startswith("cuda"))


class SyncCalls(HostSyncs):
    """HostSyncs folded into an OpCounter's syncs: a call it names and the dispatch-level syncs inside it are one
    event each (see the module docstring)."""

    def __init__(self, counter: OpCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.counter.paused:
            return func(*args, **(kwargs or {}))
        syncs, n = self.counter.tally.syncs, len(self.calls)
        mark = len(syncs)
        out = super().__torch_function__(func, types, args, kwargs)
        if len(self.calls) > n and self.waits(self.calls[-1], args, kwargs or {}):
            inner = syncs[mark:]
            syncs[mark:] = [(f"{self.calls[-1]} ({name})", w) for name, w in inner] or [(self.calls[-1], where())]
        return out

    def waits(self, call: str, args: tuple, kwargs: dict) -> bool:
        """Whether a call HostSyncs names waits on a GPU: on a CUDA run, one that meets a CUDA tensor or device;
        on the CPU, every one but a .to(device object) (device-resident code: `x.to(y.device)` reads "cpu" here
        and stays on the GPU there; `.to("cpu")` is a host read)."""
        if self.counter.cuda:
            return any(map(_on_gpu, tree_leaves((args, kwargs))))
        return call != "to" or any(isinstance(x, str) and x.startswith("cpu") for x in tree_leaves((args[1:], kwargs)))


class TritonLaunches:
    """While active, every call of a kernels/ launcher (each launches one Triton kernel) is counted once into the
    innermost active OpCounter. `reference=False` (CUDA): the launcher runs, its own ATen ops counted too.
    `reference=True` (CPU): its PyTorch twin `<name>_ref` runs instead, uncounted (the kernel's output, not its
    cost; the launcher's own few ops are missed), and span_attention, whose twin reads the layouts rather than the
    kernel's arguments, is counted, not run (its output is not read by anything counted)."""

    def __init__(self, reference: bool = False):
        self.reference, self.counters, self.saved = reference, [], []

    def __enter__(self):
        import importlib
        import pkgutil

        try:
            package = importlib.import_module("quantwm.kernels")
            modules = [importlib.import_module(f"quantwm.kernels.{m.name}") for m in pkgutil.iter_modules(package.__path__)]
        except ImportError:  # no Triton here: nothing launches
            return self
        for module in modules:
            name = module.__name__.rsplit(".", 1)[1]
            launcher = getattr(module, name, None)
            if callable(launcher):
                self.saved.append((module, name, launcher))
                setattr(module, name, self._wrap(name, launcher))
        return self

    def __exit__(self, *exc):
        for module, name, launcher in self.saved:
            setattr(module, name, launcher)
        self.saved = []

    def _wrap(self, name: str, launcher):
        twin = _twin(name) if self.reference else None

        def counted(*args, **kwargs):
            counter = self.counters[-1] if self.counters else None
            if self.reference and twin is None:
                out = None  # span_attention: counted, not run
            elif twin is not None:
                if counter is not None:
                    counter.paused += 1
                try:
                    out = twin(*args, **kwargs)
                finally:
                    if counter is not None:
                        counter.paused -= 1
            else:
                out = launcher(*args, **kwargs)
            if counter is not None and not counter.paused:
                tensors = [x for x in tree_leaves((args, kwargs, out)) if isinstance(x, torch.Tensor)]
                counter.paused += 1  # the rule's own arithmetic is not the commit's
                try:
                    flops = launch_flops(name, tensors)
                finally:
                    counter.paused -= 1
                counter.tally.triton += 1
                dtype = torch.bfloat16 if name in TENSOR_CORE else torch.float32  # BF16 dots on tensor cores
                counter.tally.launch(Kernel(f"triton:{name}", sum(map(touched, tensors)), flops, dtype,
                                            matmul=name in TENSOR_CORE))
            return out
        return counted


VITERBI_OPS, VITERBI_STEP_OPS = 6.0, 384.0  # lane operations of kernels/trellis_viterbi.py a sample: 6 a state update
# (its error and sum, the least of its predecessors, the cost exchanged) and 384 (12 warp instructions) a step and row
# whatever its trellis's size (the sample's load and normalisation, the loop, the backpointers' address), so that a
# 256-state step is some 60 warp instructions on its one warp (each lane's 8 states) and a 32-state one some 18; an
# estimate from the kernel's code, not a measurement (docs/results.md, "Trellis codes")


TENSOR_CORE = {"key_rotate": 3, "key_covariance_sums": 6}  # kernels of BF16 dots, and how many a product takes (FP32's
# accuracy from BF16 parts): priced at the tensor cores' rate


def launch_flops(name: str, tensors: list[torch.Tensor]) -> float:
    """FLOPs of one kernels/ launch from its tensors (arguments, then outputs): the module docstring's rule."""
    if name.endswith("_assign"):
        return 2.0 * tensors[0].numel() * tensors[1].shape[-2]
    if name in TENSOR_CORE:  # x (S, N, D) first: each product 2 S N D² FLOPs
        S, N, D = tensors[0].shape
        return TENSOR_CORE[name] * 2.0 * S * N * D * D
    if name == "trellis_viterbi":  # x (M, N) or a span (S, N, D), widths (M,): every state of a coded row's trellis
        from quantwm.core.trellis import TABLE_BITS  # (2^TABLE_BITS[width]) updated at every sample, and its step

        x, widths = tensors[:2]
        if widths.device.type == "cpu":  # a 0-width row is skipped; on a GPU's run every row counts as 256 states
            states = torch.tensor([0] + [1 << b for b in TABLE_BITS[1:]], device="cpu")[widths.long().cpu()]
            updates, steps = float(states.sum()), float((widths > 0).sum())
        else:
            updates, steps = 256.0 * widths.numel(), float(widths.numel())
        return x.shape[1] * (VITERBI_OPS * updates + VITERBI_STEP_OPS * steps)
    return float(max((x.numel() for x in tensors), default=0))


def _twin(name: str):
    """The PyTorch twin of kernels/<name>.py under the kernel's own rule, or None (span_attention)."""
    from quantwm.core import allocate, kmeans, qsac, quant, query_basis, trellis
    from quantwm.core.layouts import channels
    from quantwm.core.layouts import trellis as trellis_layout

    if name == "qsac_assign":  # the kernel's rule is the exact one: J on every centroid
        return lambda *a, **k: qsac.qsac_assign_ref(*a, **k, candidates=None)
    for module in (quant, kmeans, allocate, channels, trellis, trellis_layout, query_basis):
        if hasattr(module, f"{name}_ref"):
            return getattr(module, f"{name}_ref")
    return None


class counting:
    """`with counting(launches, cuda) as tally:` counts what the block runs (ATen ops, kernel launches, syncs)."""

    def __init__(self, launches: TritonLaunches | None = None, cuda: bool = False):
        self.counter = OpCounter(cuda)
        self.calls, self.launches = SyncCalls(self.counter), launches

    def __enter__(self) -> Tally:
        if self.launches is not None:
            self.launches.counters.append(self.counter)
        self.calls.__enter__()
        self.counter.__enter__()
        return self.counter.tally

    def __exit__(self, *exc):
        self.counter.__exit__(*exc)
        self.calls.__exit__(*exc)
        if self.launches is not None:
            self.launches.counters.pop()
