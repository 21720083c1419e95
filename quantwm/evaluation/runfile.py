"""Run files v1: a BF16 generation and a method's generation from the same noise, with what the app shows.

One safetensors file (`write_run` / `read_run`). Tensors:

* `frames.bf16`, `frames.method`: (T, H, W, 3) uint8, the decoded output frames of both runs;
* `stats`: (layers, heads, D, D) float32, the history-Query second moment S the method's cache held;
* per probed (generated) chunk c: `probe.{c}.top1_exact`, `probe.{c}.top1_quant`: (layers, heads, N) int32,
  the cached token each of the chunk's N query tokens attends to most under exact and under stored keys
  (cached tokens only, in cache order: frame by frame, row-major);
* per probed chunk, for the layers and heads named in `logit_layers` / `logit_heads` only (bounded so:
  `quantwm record --logit-layers/--logit-heads`): `probe.{c}.logits_exact`, `probe.{c}.logits_method`:
  (n_layers, n_heads, N, n_cached) float16, each query's attention logits over the cache;
* optional, per probed chunk: `probe.{c}.positions` (n_cached,) int32, the latent token (frame * h * w + row * w
  + col) each cached key holds, in cache order, for caches that do not hold every earlier token in order (a
  sink plus a sliding window: SANA-WM's refiner). Without it the cache holds the chunk's predecessors in order.

Metadata (strings): `quantwm_run_version`="1" and `run` (JSON): `model` (name), `layers`, `heads`, `head_dim`,
`latent_grid` [h, w], `chunk_frames` and `context_frames` (latent frames), optional `chunk_start` (the latent
frame where chunk 0 begins; 0 unless the first frames are a sink, as SANA-WM's), `vae_spatial`, `patch`,
`vae_temporal`, `method`, `target`, `bits`, `bits_per_element` (of the quantized spans), `memory_mb` {bf16, stored}
(stored: the whole cache, full-precision chunks counted as BF16), optional `memory` (the cache's
`CacheMemory.to_dict()`: exact byte counts and the named figures), `logit_layers`, `logit_heads`, `probed_chunks`,
and free-form `source` (seed, prompt, command). `memory_meta` writes the memory keys, `run_memory` reads them back.

How tokens map to pixels (`RunFacts`): a latent token is `vae_spatial * patch` output pixels square; latent
frame 0 decodes to output frame 0 and latent frame f > 0 to output frames 1 + vae_temporal (f - 1) ...
vae_temporal f (Wan's causal VAE: 4; the built-in model has no VAE: 1, one frame per latent frame).

    run = read_run("run.safetensors")   # ValueError naming the problem for a file that is not a valid run

`RunWriter` writes the same file as a rollout makes it, chunk by chunk (`quantwm record --window`): frames and
probes go to scratch files beside the output as they come, and `close` writes the header and copies them in, so
the writer holds one chunk, never the video.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..core.cache_types import CacheMemory
from .trace import read_safetensors

RUN_VERSION = "1"


@dataclass(frozen=True)
class RunFacts:
    model: str
    layers: int
    heads: int
    head_dim: int
    latent_grid: tuple[int, int]
    chunk_frames: int
    context_frames: int
    vae_spatial: int = 1
    patch: int = 1
    vae_temporal: int = 1
    chunk_start: int = 0  # latent frame where chunk 0 begins (a sink before it: SANA-WM)

    @property
    def tokens_per_frame(self) -> int:
        return self.latent_grid[0] * self.latent_grid[1]

    @property
    def pixels_per_token(self) -> int:
        return self.vae_spatial * self.patch

    def output_frames(self, latent_frames: int) -> int:
        return 1 + self.vae_temporal * (latent_frames - 1) if latent_frames else 0

    def latent_frame(self, t: int) -> int:
        """The latent frame output frame `t` decodes from."""
        return 0 if t == 0 else 1 + (t - 1) // self.vae_temporal

    def first_output_frame(self, f: int) -> int:
        return 0 if f == 0 else 1 + self.vae_temporal * (f - 1)

    def chunk_of(self, f: int) -> int | None:
        """The chunk latent frame `f` was generated in (None before chunk 0: a sink)."""
        return None if f < self.chunk_start else (f - self.chunk_start) // self.chunk_frames

    def pixel_to_token(self, x: int, y: int) -> tuple[int, int]:
        """Output pixel (x, y) -> (row, col) of its latent token; ValueError outside the frame."""
        h, w = self.latent_grid
        p = self.pixels_per_token
        if not (0 <= x < w * p and 0 <= y < h * p):
            raise ValueError(f"pixel ({x}, {y}) lies outside the {w * p}x{h * p} frame")
        return y // p, x // p


@dataclass
class Run:
    facts: RunFacts
    meta: dict  # method, target, bits, bits_per_element, memory_mb, source, logit_layers, logit_heads
    bf16: torch.Tensor  # (T, H, W, 3) uint8
    method: torch.Tensor
    stats: torch.Tensor  # (layers, heads, D, D)
    top1: dict[int, tuple[torch.Tensor, torch.Tensor]]  # chunk -> (exact, stored), (layers, heads, N)
    logits: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # chunk -> (nl, nh, N, L)
    positions: dict[int, torch.Tensor] = field(default_factory=dict)  # chunk -> (L,) latent token of each key

    def nbytes(self) -> int:
        ts = [self.bf16, self.method, self.stats, *sum(map(list, self.top1.values()), []),
              *sum(map(list, self.logits.values()), []), *self.positions.values()]
        return sum(t.numel() * t.element_size() for t in ts)


def memory_meta(memory: CacheMemory) -> dict:
    """A cache's memory as run-file metadata: `bits_per_element`, `memory_mb` and `memory` (see the module)."""
    return {"bits_per_element": memory.span_bits_per_element,
            "memory_mb": {"bf16": memory.bf16_mb, "stored": memory.cache_mb}, "memory": memory.to_dict()}


def run_memory(meta: dict) -> CacheMemory:
    """The memory report a run file holds: its `memory`, or for a file without one, the same figures from
    `bits_per_element` and `memory_mb` (exact: MB are bytes / 2**20)."""
    if "memory" in meta:
        return CacheMemory.from_dict(meta["memory"])
    bf16, cache = (int(round(float(meta["memory_mb"][k]) * 2 ** 20)) for k in ("bf16", "stored"))
    return CacheMemory(cache, bf16, {}, float(meta["bits_per_element"]), 8 * cache / (bf16 / 2) if bf16 else float("nan"),
                       {}, cache)


def write_run(path: str | Path, run: Run) -> None:
    tensors = {"frames.bf16": run.bf16.contiguous(), "frames.method": run.method.contiguous(),
               "stats": run.stats.float().contiguous()}
    for c, (e, q) in run.top1.items():
        tensors[f"probe.{c}.top1_exact"], tensors[f"probe.{c}.top1_quant"] = e.int().contiguous(), q.int().contiguous()
    for c, (e, q) in run.logits.items():
        tensors[f"probe.{c}.logits_exact"] = e.half().contiguous()
        tensors[f"probe.{c}.logits_method"] = q.half().contiguous()
    for c, pos in run.positions.items():
        tensors[f"probe.{c}.positions"] = pos.int().contiguous()
    meta = {**run.meta, **asdict(run.facts), "probed_chunks": sorted(run.top1)}
    save_file(tensors, str(path), metadata={"quantwm_run_version": RUN_VERSION, "run": json.dumps(meta)})


_DTYPES = {torch.uint8: "U8", torch.int32: "I32", torch.float16: "F16", torch.float32: "F32"}


class RunWriter:
    """A run file written as it is made (see the module): `add_frames` per chunk, `add_probe` per probed chunk, then
    `close(stats, meta)`; `abort()` (or an exception inside `with`) removes the scratch files and writes nothing.

        with RunWriter(path, facts) as w:
            for chunk ...: w.add_frames(bf16_uint8, method_uint8); w.add_probe(c, exact, quant, logits, positions)
            w.close(stats, meta)
    """

    def __init__(self, path: str | Path, facts: RunFacts):
        self.path, self.facts = Path(path), facts
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._parts = {k: open(f"{self.path}.{k}.part", "wb") for k in ("bf16", "method", "probes")}
        self._frames, self._frame_shape = 0, None
        self._probes: list[tuple[str, str, list[int], int]] = []  # name, dtype, shape, bytes (in write order)
        self._probed: list[int] = []

    def __enter__(self):
        return self

    def __exit__(self, kind, *_):
        if kind is not None or any(not f.closed for f in self._parts.values()):
            self.abort()

    def add_frames(self, bf16: torch.Tensor, method: torch.Tensor) -> None:
        """The next frames of both runs: (F, H, W, 3) uint8 each."""
        if bf16.dtype != torch.uint8 or method.dtype != torch.uint8 or bf16.shape != method.shape or bf16.dim() != 4:
            raise ValueError(f"frames must be two (F, H, W, 3) uint8 tensors of one shape, got {tuple(bf16.shape)} "
                             f"{bf16.dtype} and {tuple(method.shape)} {method.dtype}")
        if self._frame_shape not in (None, tuple(bf16.shape[1:])):
            raise ValueError(f"frames of shape {tuple(bf16.shape[1:])} after {self._frame_shape}")
        self._frame_shape = tuple(bf16.shape[1:])
        self._parts["bf16"].write(bf16.contiguous().numpy().data)  # the tensor's own bytes, no copy
        self._parts["method"].write(method.contiguous().numpy().data)
        self._frames += bf16.shape[0]

    def _tensor(self, name: str, t: torch.Tensor) -> None:
        data = t.contiguous().cpu().numpy()
        self._parts["probes"].write(data.data)
        self._probes.append((name, _DTYPES[t.dtype], list(t.shape), data.nbytes))

    def add_probe(self, chunk: int, top1_exact: torch.Tensor, top1_quant: torch.Tensor,
                  logits: tuple | None = None, positions: torch.Tensor | None = None) -> None:
        """Chunk `chunk`'s probe, in the shapes of the module docstring: top-1s (layers, heads, N), optional logits
        (exact, method) (n_layers, n_heads, N, n_cached) and positions (n_cached,)."""
        if chunk in self._probed:
            raise ValueError(f"chunk {chunk} is probed twice")
        self._probed.append(chunk)
        self._tensor(f"probe.{chunk}.top1_exact", top1_exact.int())
        self._tensor(f"probe.{chunk}.top1_quant", top1_quant.int())
        if logits is not None:
            self._tensor(f"probe.{chunk}.logits_exact", logits[0].half())
            self._tensor(f"probe.{chunk}.logits_method", logits[1].half())
        if positions is not None:
            self._tensor(f"probe.{chunk}.positions", positions.int())

    def close(self, stats: torch.Tensor, meta: dict) -> None:
        """Write the file: header (`meta` as `write_run` writes a `Run`'s), the frames, `stats` (layers, heads, D, D)
        and the probes; the scratch files are removed."""
        for f in self._parts.values():
            f.close()
        stats = stats.float().contiguous()
        frame_bytes = self._frames * int(torch.tensor(self._frame_shape or (0,)).prod())
        header, offset = {}, 0
        entries = [("frames.bf16", "U8", [self._frames, *(self._frame_shape or ())], frame_bytes),
                   ("frames.method", "U8", [self._frames, *(self._frame_shape or ())], frame_bytes),
                   ("stats", "F32", list(stats.shape), stats.numel() * 4), *self._probes]
        for name, dtype, shape, n in entries:
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
            offset += n
        full = {**meta, **asdict(self.facts), "probed_chunks": sorted(self._probed)}
        header["__metadata__"] = {"quantwm_run_version": RUN_VERSION, "run": json.dumps(full)}
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # safetensors pads its header to 8 bytes
        with open(f"{self.path}.part", "wb") as out:  # renamed into place once complete
            out.write(len(text).to_bytes(8, "little") + text)
            for k in ("bf16", "method"):
                with open(f"{self.path}.{k}.part", "rb") as f:
                    shutil.copyfileobj(f, out, 2 ** 20)
            out.write(stats.numpy().data)
            with open(f"{self.path}.probes.part", "rb") as f:
                shutil.copyfileobj(f, out, 2 ** 20)
        os.replace(f"{self.path}.part", self.path)
        self._remove_parts()

    def abort(self) -> None:
        for f in self._parts.values():
            f.close()
        self._remove_parts()

    def _remove_parts(self) -> None:
        for name in [f"{self.path}.{k}.part" for k in self._parts] + [f"{self.path}.part"]:
            if os.path.exists(name):
                os.remove(name)


def _invalid(path, why: str) -> ValueError:
    return ValueError(f"{path}: not a valid QuantWM run: {why}")


FACT_KEYS = ("model", "layers", "heads", "head_dim", "latent_grid", "chunk_frames", "context_frames", "vae_spatial",
             "patch", "vae_temporal")
META_KEYS = ("method", "target", "bits", "bits_per_element", "memory_mb", "logit_layers", "logit_heads",
             "probed_chunks")


def read_run(path: str | Path) -> Run:
    """Load and validate a run file; ValueError naming the first problem."""
    raw, tensors = read_safetensors(path, "run")
    if raw.get("quantwm_run_version") != RUN_VERSION:
        raise _invalid(path, f"quantwm_run_version is {raw.get('quantwm_run_version')!r}, expected {RUN_VERSION!r}")
    try:
        meta = json.loads(raw["run"])
        missing = [k for k in (*FACT_KEYS, *META_KEYS) if k not in meta]
        if missing:
            raise _invalid(path, f"metadata lacks {', '.join(missing)}")
        facts = RunFacts(**{k: meta[k] for k in (*FACT_KEYS, "chunk_start") if k in meta})
        facts = RunFacts(**{**asdict(facts), "latent_grid": tuple(int(v) for v in facts.latent_grid)})
        ints = [facts.layers, facts.heads, facts.head_dim, *facts.latent_grid, facts.chunk_frames, facts.vae_spatial,
                facts.patch, facts.vae_temporal]
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in ints) or any(
                isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in (facts.context_frames, facts.chunk_start)):
            raise _invalid(path, "model facts must be positive integers (context_frames, chunk_start >= 0)")
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise _invalid(path, f"bad metadata ({e})") from None
    try:
        run_memory(meta)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise _invalid(path, f"bad memory figures ({e!r})") from None
    for name in ("frames.bf16", "frames.method", "stats"):
        if name not in tensors:
            raise _invalid(path, f"missing tensor {name!r}")
    bf16, method, stats = tensors["frames.bf16"], tensors["frames.method"], tensors["stats"]
    if bf16.dtype != torch.uint8 or bf16.dim() != 4 or bf16.shape[-1] != 3 or bf16.shape != method.shape \
            or method.dtype != torch.uint8:
        raise _invalid(path, f"frames must be two (T, H, W, 3) uint8 tensors of one shape, got {tuple(bf16.shape)} "
                             f"{bf16.dtype} and {tuple(method.shape)} {method.dtype}")
    h, w = facts.latent_grid
    px = facts.pixels_per_token
    if tuple(bf16.shape[1:3]) != (h * px, w * px):
        raise _invalid(path, f"frames are {bf16.shape[2]}x{bf16.shape[1]} but the latent grid {h}x{w} at "
                             f"{px} pixels per token gives {w * px}x{h * px}")
    L, H, D = facts.layers, facts.heads, facts.head_dim
    if tuple(stats.shape) != (L, H, D, D) or not torch.isfinite(stats).all():
        raise _invalid(path, f"stats must be finite ({L}, {H}, {D}, {D}), got {tuple(stats.shape)}")
    latent = facts.latent_frame(bf16.shape[0] - 1) + 1
    if facts.chunk_start >= latent:
        raise _invalid(path, f"chunk_start {facts.chunk_start} leaves no chunk in {latent} latent frames")
    strays = sorted({k.split(".")[1] for k in tensors if k.startswith("probe.")} -
                    {str(c) for c in meta["probed_chunks"]})
    if strays:
        raise _invalid(path, f"probe tensors for chunk {strays[0]}, which probed_chunks does not list")
    top1, logits, positions = {}, {}, {}
    nl, nh = len(meta["logit_layers"]), len(meta["logit_heads"])
    first = -(-max(0, facts.context_frames - facts.chunk_start) // facts.chunk_frames)  # context chunks: no probes
    for c in meta["probed_chunks"]:
        if not isinstance(c, int) or not first <= c < -(-(latent - facts.chunk_start) // facts.chunk_frames):
            raise _invalid(path, f"probed chunk {c!r} is not a generated chunk of this run")
        first_frame = facts.chunk_start + c * facts.chunk_frames
        start = first_frame * facts.tokens_per_frame  # the chunk's first token
        n = min(facts.chunk_frames, latent - first_frame) * facts.tokens_per_frame  # the last chunk may be short
        pos = tensors.get(f"probe.{c}.positions")
        if pos is not None:
            if pos.dim() != 1 or pos.dtype != torch.int32 or not len(pos) or pos.min() < 0 or pos.max() >= start \
                    or (len(pos) > 1 and bool((pos[1:] <= pos[:-1]).any())):
                raise _invalid(path, f"probe.{c}.positions must be (n_cached,) int32 latent tokens in increasing order, "
                                     f"before the chunk's first ({start})")
            positions[c] = pos.long()
        cached = len(pos) if pos is not None else start
        pair = []
        for side in ("exact", "quant"):
            t = tensors.get(f"probe.{c}.top1_{side}")
            if t is None or tuple(t.shape) != (L, H, n) or t.dtype != torch.int32:
                raise _invalid(path, f"probe.{c}.top1_{side} must be ({L}, {H}, {n}) int32")
            if t.min() < 0 or t.max() >= cached:
                raise _invalid(path, f"probe.{c}.top1_{side} points outside the {cached} cached tokens")
            pair.append(t.long())
        top1[c] = tuple(pair)
        if nl and nh:
            lg = [tensors.get(f"probe.{c}.logits_{s}") for s in ("exact", "method")]
            if any(t is None or tuple(t.shape) != (nl, nh, n, cached) for t in lg):
                raise _invalid(path, f"probe.{c}.logits_exact/_method must be ({nl}, {nh}, {n}, {cached})")
            if any(not torch.isfinite(t).all() for t in lg):
                raise _invalid(path, f"probe.{c}.logits hold NaN or Inf")
            logits[c] = (lg[0].float(), lg[1].float())
    return Run(facts, {k: meta[k] for k in meta if k not in (*FACT_KEYS, "chunk_start")}, bf16, method, stats.float(),
               top1, logits, positions)
