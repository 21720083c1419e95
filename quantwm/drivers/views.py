"""The app's views of one run, built-in or opened: `RunView` over a run file's contents (`runfile.Run`).

An opened run file (`quantwm record`, any model's generation) is viewed as read; a built-in run's pair of records
is made into the same `Run` (`RunView.of_records`), with its float frames, its cached reference flow and logits
computed on demand for any layer and head. Every view returns plain values (numpy arrays, lists, floats, dicts)
for the app's handlers. Frames are output frames; probes, sources and logits live on latent frames (`RunFacts`
maps between them; the built-in model has one output frame per latent frame). `make_run` writes a built-in run
down as a run file, with the numbers its view shows.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..evaluation import diagnostics as D
from ..evaluation import metrics as M
from ..evaluation import vbench as V
from ..evaluation.runfile import Run, run_memory
from ..world.evaluate import shift_rate
from ..world.generate import ChunkProbe
from .runs import Record, RunKey, builtin_run, probe_logits

# summary keys of run files written before the memory figures were named (`CacheMemory.FIGURES` replace them)
OLD_MEMORY_KEYS = ("bits_per_element", "compression", "memory_bf16_mb", "memory_mb")


class RunView:
    """The views (compare, summary, frame_view, pixel_trace, energy) of one run: a BF16 generation and a method's
    from the same noise (`run`, a `runfile.Run`).

    frames:   (BF16, method) float frames in [0, 1] (a built-in run's, before they were stored as uint8); default
              the run's uint8 frames / 255
    flow:     the BF16 frames' optical flow when already computed
    coverage: per frame, the share of its view the context frames saw (built-in runs), shown in the series
    logits:   (chunk, layer, head, query) -> (exact, stored) logits of one query over the cache; default: the
              run's stored logits (the layers and heads it names)
    """

    def __init__(self, run: Run, run_id: str, frames: tuple | None = None, flow: torch.Tensor | None = None,
                 coverage: list | None = None, logits: Callable | None = None):
        self.run, self.id, self.facts = run, run_id, run.facts
        f = run.facts
        self.frames_bf16, self.frames_method = frames or (run.bf16.float() / 255, run.method.float() / 255)
        self.probes = [ChunkProbe(c, top1_exact=list(e), top1_quant=list(q)) for c, (e, q) in sorted(run.top1.items())]
        self.flow = flow if flow is not None else M.reference_flow(self.frames_bf16)
        self.coverage = coverage
        self._logits = logits or self._stored_logits
        self.memory = run_memory(run.meta)  # a `CacheMemory`: the figures every status line prints
        self.context_frames = f.first_output_frame(f.context_frames) if f.context_frames else 0

    @classmethod
    def of_records(cls, cfg, ref: Record, rec: Record) -> RunView:
        """The view of a built-in run: method record `rec` against its BF16 record `ref` (model config `cfg`)."""
        chunk_tokens = cfg.chunk_frames * cfg.tokens_per_frame
        probes = {p.chunk: p for p in rec.probes}

        def logits(chunk: int, layer: int, head: int, query: int):
            exact, stored = probe_logits(rec, probes[chunk], layer, head, chunk_tokens, queries=[query])
            return exact[0], stored[0]

        return cls(builtin_run(cfg, ref, rec), rec.key.id, (ref.frames, rec.frames), ref.reference_flow(),
                   rec.coverage, logits)

    # ---- facts ------------------------------------------------------------------------------------
    def model_facts(self) -> dict:
        f = self.facts
        return {"layers": f.layers, "heads": f.heads, "head_dim": f.head_dim, "frame_size": self.run.bf16.shape[1],
                "grid": f.latent_grid, "chunk_frames": f.chunk_frames, "context_frames": self.context_frames}

    def frame_size(self) -> tuple[int, int]:
        """(H, W) of the run's output frames."""
        return tuple(self.run.bf16.shape[1:3])

    def check_frame(self, frame: int) -> int:
        T = self.run.bf16.shape[0]
        if not 0 <= int(frame) < T:
            raise ValueError(f"frame {frame} out of range: the run has frames 0..{T - 1}")
        return int(frame)

    # ---- the comparison ---------------------------------------------------------------------------
    def series(self) -> dict:
        """Per-frame series of the method against BF16 (flicker, PSNR, ..., the top-1 shift rate)."""
        series = D.frame_series(self.frames_method, self.frames_bf16, self.context_frames, self.flow)
        series["shift_rate"] = [None if (j := self._latent_jumps(t, None, None)) is None else float(j.mean())
                                for t in range(self.run.bf16.shape[0])]
        if self.coverage is not None:
            series["seen_by_context"] = list(self.coverage)
        return series

    def summary(self, lpips: bool = False) -> dict:
        """Clip-level numbers of the generated frames against BF16, and the cache's memory figures by name."""
        ctx = self.context_frames
        out = {**D.clip_metrics(self.frames_method, self.frames_bf16, ctx, self.flow), "shift_rate": shift_rate(self),
               **self.memory.figures()}
        if lpips:
            out["lpips"] = float(M.lpips(self.frames_method[ctx:], self.frames_bf16[ctx:]).mean())
        return out

    def compare(self) -> dict:
        """The Generate tab's numbers: as recorded when the run file carries them (`summary`, `series`: computed
        from the frames before they were stored as uint8, so they match the app's own run), else computed here;
        the memory figures always from the run's `CacheMemory` (`memory`: its one-line summary)."""
        T, meta = self.run.bf16.shape[0], self.run.meta
        if isinstance(meta.get("summary"), dict) and isinstance(meta.get("series"), dict) and all(
                isinstance(v, list) and len(v) == T for v in meta["series"].values()):
            series = meta["series"]
            summary = {**{k: v for k, v in meta["summary"].items() if k not in OLD_MEMORY_KEYS},
                       **self.memory.figures()}
        else:
            series, summary = self.series(), self.summary()
        return {"key": self.id, "bf16": self.run.bf16.numpy(), "method": self.run.method.numpy(), "series": series,
                "summary": summary, "memory": self.memory.summary(), "vbench_flicker": self.vbench_flicker(),
                "worst": D.worst_frames(series["tdiff"][self.context_frames:], 3), "seconds": 0.0}

    def vbench_flicker(self) -> dict:
        """VBench's temporal-flickering score (`evaluation.vbench.temporal_flickering`) of each side's own frames from
        the last context frame on, as `quantwm eval` scores a run: {"bf16": ..., "method": ...}, each in [0, 1],
        higher is steadier."""
        first = max(self.context_frames - 1, 0)
        return {side: V.temporal_flickering(frames[first:]) for side, frames in (("bf16", self.run.bf16),
                                                                                   ("method", self.run.method))}

    def same_reference(self, other: RunView) -> bool:
        """Whether `other` is a method's run against the same BF16 generation (two methods shown side by side)."""
        a, b = self.run.bf16, other.run.bf16
        return a.shape == b.shape and bool(torch.equal(a, b))

    # ---- one frame, one pixel ---------------------------------------------------------------------
    def _latent_jumps(self, t: int, layer, head):
        f = self.facts
        lat = f.latent_frame(t)
        if f.chunk_of(lat) is None:
            return None  # a sink frame: never generated
        return D.frame_jumps(self.probes, lat - f.chunk_start, f.chunk_frames, f.tokens_per_frame, layer, head)

    def frame_view(self, frame: int, layer: int | None = None, head: int | None = None) -> dict:
        """Both frames (uint8), the flicker and warping-error maps (H, W) and the top-1 jump map (h, w) or None
        (context)."""
        t = self.check_frame(frame)
        flick, warp = D.frame_maps(self.frames_method, self.frames_bf16, self.flow, t)
        jumps = self._latent_jumps(t, layer, head)
        return {"frame": t, "bf16": self.run.bf16[t].numpy(), "method": self.run.method[t].numpy(),
                "flicker": flick.numpy(), "warp": warp.numpy(),
                "jumps": None if jumps is None else jumps.reshape(*self.facts.latent_grid).numpy(),
                "context": t < self.context_frames}

    def frame(self, frame: int):
        """The method's frame `frame` (H, W, 3) uint8, as shown."""
        return self.run.method[self.check_frame(frame)].numpy()

    def _no_logits(self) -> ValueError:
        """The error for a (layer, head) the run file holds no logits of, naming those it holds."""
        meta = self.run.meta
        return ValueError(f"the run holds attention logits for layers {meta['logit_layers']} and heads "
                          f"{meta['logit_heads']} only (record with --logit-layers / --logit-heads)")

    def _stored_logits(self, chunk: int, layer: int, head: int, query: int):
        meta = self.run.meta
        if layer not in meta["logit_layers"] or head not in meta["logit_heads"]:
            raise self._no_logits()
        li, hi = meta["logit_layers"].index(layer), meta["logit_heads"].index(head)
        exact, stored = self.run.logits[chunk]
        return exact[li, hi, query], stored[li, hi, query]

    def _cached(self, chunk: int, logits: torch.Tensor, src: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """One query's logits over the cache as (cached frames, tokens per frame), and a source's (frame, row,
        col). A cache with positions (a sink plus a window) is laid out by latent frame, NaN where it held none."""
        f = self.facts
        pos = self.run.positions.get(chunk)
        if pos is None:
            return logits.reshape(-1, f.tokens_per_frame), D.token_coords(src, f.latent_grid)
        grid = torch.full(((int(pos.max()) // f.tokens_per_frame + 1) * f.tokens_per_frame,), float("nan"))
        grid[pos] = logits.float()
        return grid.reshape(-1, f.tokens_per_frame), D.token_coords(int(pos[src]), f.latent_grid)

    def traceable(self) -> list[tuple[int, int]]:
        """The (layer, head) pairs whose logits a trace can show: every pair of a built-in run, the recorded layers
        and heads of a run file."""
        f, meta = self.facts, self.run.meta
        if self._logits != self._stored_logits:
            return [(layer, head) for layer in range(f.layers) for head in range(f.heads)]
        return [(layer, head) for layer in meta["logit_layers"] for head in meta["logit_heads"]]

    def pixel_trace(self, frame: int, x: int, y: int, layer: int | None = 0, head: int | None = 0) -> dict:
        """Trace pixel (x, y) of `frame` to its Query's top-1 cached source, exact vs stored keys. `layer` or
        `head` None ("all" on the page's one layer/head picker): the first traceable pair that fits the other
        whose top-1 moved at this Query, or the first traceable one when none moved; "picked" says which rule."""
        f = self.facts
        t = self.check_frame(frame)
        for name, v, n in (("layer", layer, f.layers), ("head", head, f.heads)):
            if v is not None and not 0 <= v < n:
                raise ValueError(f"{name} {v} out of range: {f.layers} layers, {f.heads} heads")
        row, col = f.pixel_to_token(int(x), int(y))
        lat = f.latent_frame(t)
        chunk = f.chunk_of(lat)
        if chunk not in self.run.top1:
            raise ValueError(f"frame {t} (latent frame {lat}) is a context frame or was not generated with probes: "
                             f"its queries were not probed; probed chunks: {sorted(self.run.top1)}")
        qi = (lat - f.chunk_start - chunk * f.chunk_frames) * f.tokens_per_frame + row * f.latent_grid[1] + col
        e, q = self.run.top1[chunk]
        picked = None
        if layer is None or head is None:
            pairs = [(lay, h) for lay, h in self.traceable() if layer in (None, lay) and head in (None, h)]
            if not pairs:
                raise self._no_logits()
            moved = [(lay, h) for lay, h in pairs if int(e[lay, h, qi]) != int(q[lay, h, qi])]
            layer, head = (moved or pairs)[0]
            picked = ("the first layer and head whose top-1 moved at this Query" if moved else
                      "no top-1 moved at this Query: the first layer and head with logits")
        src_e, src_q = int(e[layer, head, qi]), int(q[layer, head, qi])
        le, lq = self._logits(chunk, layer, head, qi)
        exact, source_e = self._cached(chunk, le, src_e)
        stored, source_q = self._cached(chunk, lq, src_q)
        n_lat = f.latent_frame(self.run.method.shape[0] - 1) + 1
        thumbs = self.run.method[[f.first_output_frame(i) for i in range(n_lat)]].numpy()
        return {"query": (lat, row, col), "layer": layer, "head": head, "picked": picked,
                "method": self.run.meta["method"], "source_bf16": source_e, "source_method": source_q,
                "jumped": src_e != src_q, "logits_bf16": exact.numpy(), "logits_method": stored.numpy(),
                "frames": thumbs, "grid": f.latent_grid}

    def energy(self, rank: int = 8) -> list[dict]:
        """Per layer: the history-Query spectrum the method's cache accumulated (energy_spectrum as numpy)."""
        return [{k: v.numpy() for k, v in D.energy_spectrum(S, rank).items()} for S in self.run.stats]


def make_run(wb, key: RunKey, logit_layers=(1,), logit_heads=(0,), source: dict | None = None,
             progress: Callable | None = None) -> Run:
    """The run file contents (`runfile.Run`) of `key` against BF16, from the same rollouts the Workbench `wb`
    shows and with the numbers its view shows (the built-in model's `quantwm record`)."""
    c = wb.cfg
    for name, vals, n in (("logit layer", logit_layers, c.layers), ("logit head", logit_heads, c.heads)):
        bad = [v for v in vals if not 0 <= v < n]
        if bad:
            raise ValueError(f"{name} {bad[0]} out of range: the model has {n}")
    ref, rec = wb.pair(key, progress)
    view = RunView.of_records(c, ref, rec)
    shown = {"summary": view.summary(), "series": view.series(),
             "source": {"seed": key.seed, "trajectory": key.trajectory, "frames": key.frames, "world": key.world,
                        **(source or {})}}
    return builtin_run(c, ref, rec, logit_layers, logit_heads, shown)
