"""Trace files v1: Q/K/V captured from a real model, the bridge between a GPU run and the analysis.

One safetensors file. Per captured layer l: `L{l}.q` (H, Nq, D) the queries of the chunk being generated,
`L{l}.k`, `L{l}.v` (H, Nk, D) the cached keys and values they attend to, optionally `L{l}.q_hist`
(H, Nh, D) earlier queries for the statistics and, with it, `L{l}.q_hist_chunk` (Nh,) int64: the chunk
that issued each history query (a backward-compatible v1 extension: with it `quantwm analyze` builds S
causally, as a run does). Optionally `frames` (T, height, width, 3) uint8.
Metadata (strings): quantwm_trace_version="1", tokens_per_frame, frame_grid="h,w", softmax_scale,
rope="post"|"pre", model; optional extras such as chunk_frames (frames per committed chunk) and kind (a
synthetic trace's kind, `quantwm synth-trace --kind`). Cached tokens run frame by frame, row-major inside a
frame: token j is (frame j // (h*w), row (j % (h*w)) // w, col j % w).

    w = TraceWriter(tokens_per_frame=64, frame_grid=(8, 8), softmax_scale=0.125, model="mine")
    w.record(layer, q, k, v)          # from inside any attention function; (H, N, D) or (1, H, N, D)
    w.save("run.safetensors")
    t = read_trace("run.safetensors") # ValueError naming the problem for a file that is not a valid trace
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

TRACE_VERSION = "1"
REQUIRED_META = ("quantwm_trace_version", "tokens_per_frame", "frame_grid", "softmax_scale", "rope", "model")
_NAME = re.compile(r"^L(\d+)\.(q|k|v|q_hist|q_hist_chunk)$")


@dataclass
class Trace:
    layers: dict[int, dict[str, torch.Tensor]]
    meta: dict[str, str]
    frames: torch.Tensor | None = None

    @property
    def tokens_per_frame(self) -> int:
        return int(self.meta["tokens_per_frame"])

    @property
    def frame_grid(self) -> tuple[int, int]:
        h, w = self.meta["frame_grid"].split(",")
        return int(h), int(w)

    @property
    def softmax_scale(self) -> float:
        return float(self.meta["softmax_scale"])

    def token_coords(self, j: int) -> tuple[int, int, int]:
        """Cached token index -> (frame, row, col)."""
        h, w = self.frame_grid
        return j // (h * w), (j % (h * w)) // w, j % w


def _invalid(path, why: str) -> ValueError:
    return ValueError(f"{path}: not a valid QuantWM trace: {why}")


def _check_meta(meta: dict[str, str], where) -> None:
    missing = [k for k in REQUIRED_META if k not in meta]
    if missing:
        raise _invalid(where, f"missing metadata {', '.join(missing)}")
    if meta["quantwm_trace_version"] != TRACE_VERSION:
        raise _invalid(where, f"version {meta['quantwm_trace_version']!r}, this reader knows {TRACE_VERSION!r}")
    try:
        h, w = (int(s) for s in meta["frame_grid"].split(","))
        tpf, scale = int(meta["tokens_per_frame"]), float(meta["softmax_scale"])
    except ValueError:
        raise _invalid(where, "tokens_per_frame, frame_grid ('h,w') or softmax_scale is malformed") from None
    if h < 1 or w < 1 or tpf != h * w:
        raise _invalid(where, f"frame_grid {h},{w} does not hold tokens_per_frame={tpf}")
    if not scale > 0:
        raise _invalid(where, f"softmax_scale must be positive, got {scale}")
    if meta["rope"] not in ("post", "pre"):
        raise _invalid(where, f"rope must be 'post' or 'pre', got {meta['rope']!r}")


def _check_layers(layers: dict[int, dict[str, torch.Tensor]], where) -> None:
    if not layers:
        raise _invalid(where, "it holds no layer tensors (L{l}.q, L{l}.k, L{l}.v)")
    for l, t in layers.items():
        for need in ("q", "k", "v"):
            if need not in t:
                raise _invalid(where, f"layer {l} lacks L{l}.{need}")
        for name, x in t.items():
            if name == "q_hist_chunk":
                continue
            if x.dim() != 3 or not torch.is_floating_point(x):
                raise _invalid(where, f"L{l}.{name} must be a float (H, N, D) tensor, got {x.dtype} {tuple(x.shape)}")
            if not torch.isfinite(x).all():
                raise _invalid(where, f"L{l}.{name} contains NaN/Inf")
        H, _, D = t["q"].shape
        if t["k"].shape != t["v"].shape or t["k"].shape[0] != H or t["k"].shape[2] != D or t["k"].shape[1] == 0:
            raise _invalid(where, f"layer {l}: q {tuple(t['q'].shape)}, k {tuple(t['k'].shape)}, "
                                  f"v {tuple(t['v'].shape)} do not agree on (H, ., D)")
        if "q_hist" in t and (t["q_hist"].shape[0] != H or t["q_hist"].shape[2] != D):
            raise _invalid(where, f"layer {l}: q_hist {tuple(t['q_hist'].shape)} does not match q's (H, ., D)")
        if "q_hist_chunk" in t:
            c = t["q_hist_chunk"]
            if "q_hist" not in t or c.dtype != torch.int64 or c.shape != (t["q_hist"].shape[1],) or (c < 0).any():
                raise _invalid(where, f"layer {l}: q_hist_chunk must be int64 (Nh,) chunk indices >= 0 beside q_hist, "
                                      f"got {c.dtype} {tuple(c.shape)}")


def read_safetensors(path: str | Path, kind: str) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(metadata, tensors) of a QuantWM safetensors file (`kind`: "trace", "run"), read once; ValueError naming
    the problem for a missing or unreadable file."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{path}: no such {kind} file")
    try:
        with safe_open(str(p), "pt") as f:
            return dict(f.metadata() or {}), {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise ValueError(f"{path}: not a valid QuantWM {kind}: unreadable safetensors "
                         f"({str(e).splitlines()[0][:120]})") from None


def read_trace(path: str | Path) -> Trace:
    """Load and validate a trace file; any problem raises ValueError naming it."""
    path = Path(path)
    meta, tensors = read_safetensors(path, "trace")
    _check_meta(meta, path)
    layers: dict[int, dict[str, torch.Tensor]] = {}
    frames = tensors.pop("frames", None)
    for name, x in tensors.items():
        m = _NAME.match(name)
        if not m:
            raise _invalid(path, f"unexpected tensor {name!r}")
        layers.setdefault(int(m.group(1)), {})[m.group(2)] = x
    _check_layers(layers, path)
    if frames is not None and (frames.dtype != torch.uint8 or frames.dim() != 4 or frames.shape[-1] != 3):
        raise _invalid(path, f"frames must be uint8 (T, height, width, 3), got {frames.dtype} {tuple(frames.shape)}")
    return Trace(dict(sorted(layers.items())), meta, frames)


@dataclass
class TraceWriter:
    """Collects Q/K/V per layer and writes a v1 trace. `max_bytes` bounds what is recorded."""

    tokens_per_frame: int
    frame_grid: tuple[int, int]
    softmax_scale: float
    rope: str = "post"
    model: str = "unknown"
    max_bytes: int | None = None
    layers: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    frames: torch.Tensor | None = None
    skipped: list[int] = field(default_factory=list)
    extra_meta: dict[str, str] = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for t in self.layers.values() for x in t.values())

    def record(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               q_hist: torch.Tensor | None = None, q_hist_chunk: torch.Tensor | None = None) -> bool:
        """Record one layer ((H, N, D) or (1, H, N, D) tensors, kept as fp16 unless fp32 is given);
        `q_hist_chunk` (Nh,) names the chunk that issued each history query.

        Returns False (and records nothing) when it would exceed `max_bytes`; the layer is listed in
        `skipped`.
        """
        def prep(x):
            x = x.detach()
            if x.dim() == 4:
                if x.shape[0] != 1:
                    raise ValueError(f"trace capture takes batch size 1, got {tuple(x.shape)}")
                x = x[0]
            if x.dtype not in (torch.float16, torch.float32):
                x = x.to(torch.float16)
            return x.contiguous().cpu()

        t = {"q": prep(q), "k": prep(k), "v": prep(v)}
        if q_hist is not None:
            t["q_hist"] = prep(q_hist)
        if q_hist_chunk is not None:
            t["q_hist_chunk"] = torch.as_tensor(q_hist_chunk).to(torch.int64).flatten().contiguous().cpu()
        _check_layers({layer: t}, "trace capture")
        size = sum(x.numel() * x.element_size() for x in t.values())
        if self.max_bytes is not None and self.nbytes() + size > self.max_bytes:
            self.skipped.append(layer)
            return False
        self.layers[layer] = t
        return True

    def set_frames(self, frames: torch.Tensor) -> None:
        """Decoded frames (T, height, width, 3), uint8 or float in [0, 1]."""
        f = torch.as_tensor(frames)
        if f.dtype != torch.uint8:
            f = (f.float().clamp(0, 1) * 255).round().to(torch.uint8)
        if f.dim() != 4 or f.shape[-1] != 3:
            raise ValueError(f"frames must be (T, height, width, 3), got {tuple(f.shape)}")
        self.frames = f.contiguous()

    def save(self, path: str | Path) -> None:
        meta = {**{k: str(v) for k, v in self.extra_meta.items()}, "quantwm_trace_version": TRACE_VERSION,
                "tokens_per_frame": str(self.tokens_per_frame),
                "frame_grid": f"{self.frame_grid[0]},{self.frame_grid[1]}", "softmax_scale": repr(float(self.softmax_scale)),
                "rope": self.rope, "model": self.model}
        _check_meta(meta, "trace capture")
        _check_layers(self.layers, "trace capture")
        tensors = {f"L{l}.{n}": x for l, t in self.layers.items() for n, x in t.items()}
        if self.frames is not None:
            tensors["frames"] = self.frames
        save_file(tensors, str(path), metadata=meta)
