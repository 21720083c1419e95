"""Run files (`quantwm record`, any model's generation) opened in the app: `LoadedRun` gives them the same
views as the Workbench gives built-in runs."""
from __future__ import annotations

import torch

from . import diagnostics as D
from . import metrics as M


class LoadedRun:
    """The app's views (compare, frame_view, pixel_trace, energy) of a run file (`runfile.Run`), with the
    same return values as the Workbench's for a built-in run. Frames are output frames; probes, sources and
    logits live on latent frames (`RunFacts` maps between them)."""

    def __init__(self, run, run_id: str):
        from ..world.generate import ChunkProbe

        self.run, self.id, f = run, run_id, run.facts
        self.facts = f
        self.frames_bf16 = run.bf16.float() / 255
        self.frames_method = run.method.float() / 255
        self.probes = [ChunkProbe(c, top1_exact=list(e), top1_quant=list(q)) for c, (e, q) in sorted(run.top1.items())]
        self.flow = M.reference_flow(self.frames_bf16)
        self.context_frames = f.first_output_frame(f.context_frames) if f.context_frames else 0

    def model_facts(self) -> dict:
        f = self.facts
        return {"layers": f.layers, "heads": f.heads, "head_dim": f.head_dim, "frame_size": self.run.bf16.shape[1],
                "grid": f.latent_grid, "chunk_frames": f.chunk_frames, "context_frames": self.context_frames}

    def _latent_jumps(self, t: int, layer, head):
        f = self.facts
        lat = f.latent_frame(t)
        if f.chunk_of(lat) is None:
            return None  # a sink frame: never generated
        return D.frame_jumps(self.probes, lat - f.chunk_start, f.chunk_frames, f.tokens_per_frame, layer, head)

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

    def compare(self) -> dict:
        """The Generate tab's numbers: as recorded when the file carries them (`summary`, `series`: computed
        from the frames before they were stored as uint8, so they match the app's own run), else from the
        stored frames."""
        ctx, T = self.context_frames, self.run.bf16.shape[0]
        meta = self.run.meta
        if isinstance(meta.get("summary"), dict) and isinstance(meta.get("series"), dict) and all(
                isinstance(v, list) and len(v) == T for v in meta["series"].values()):
            series, summary = meta["series"], meta["summary"]
        else:
            series = D.frame_series(self.frames_method, self.frames_bf16, ctx, self.flow)
            series["shift_rate"] = [None if (j := self._latent_jumps(t, None, None)) is None else float(j.mean())
                                    for t in range(T)]
            moved = [(e != q).float().mean() for e, q in self.run.top1.values()]
            bpe, mem = meta["bits_per_element"], meta["memory_mb"]
            summary = {**D.clip_metrics(self.frames_method, self.frames_bf16, ctx, self.flow),
                       "shift_rate": float(torch.stack(moved).mean()) if moved else float("nan"),
                       "bits_per_element": bpe, "compression": 16 / bpe if bpe == bpe and bpe else 1.0,
                       "memory_bf16_mb": mem["bf16"], "memory_mb": mem["stored"]}
        return {"key": self.id, "bf16": self.run.bf16.numpy(), "method": self.run.method.numpy(), "series": series,
                "summary": summary, "worst": D.worst_frames(series["tdiff"][ctx:], 3), "seconds": 0.0}

    def check_frame(self, frame: int) -> int:
        T = self.run.bf16.shape[0]
        if not 0 <= int(frame) < T:
            raise ValueError(f"frame {frame} out of range: the run has frames 0..{T - 1}")
        return int(frame)

    def frame_view(self, frame: int, layer: int | None = None, head: int | None = None) -> dict:
        t = self.check_frame(frame)
        flick, warp = D.frame_maps(self.frames_method, self.frames_bf16, self.flow, t)
        jumps = self._latent_jumps(t, layer, head)
        return {"frame": t, "bf16": self.run.bf16[t].numpy(), "method": self.run.method[t].numpy(),
                "flicker": flick.numpy(), "warp": warp.numpy(),
                "jumps": None if jumps is None else jumps.reshape(*self.facts.latent_grid).numpy(),
                "context": t < self.context_frames}

    def pixel_trace(self, frame: int, x: int, y: int, layer: int = 0, head: int = 0) -> dict:
        f, meta = self.facts, self.run.meta
        t = self.check_frame(frame)
        if not 0 <= layer < f.layers or not 0 <= head < f.heads:
            raise ValueError(f"layer/head ({layer}, {head}) out of range: {f.layers} layers, {f.heads} heads")
        row, col = f.pixel_to_token(int(x), int(y))
        lat = f.latent_frame(t)
        chunk = f.chunk_of(lat)
        if chunk not in self.run.top1:
            raise ValueError(f"frame {t} (latent frame {lat}) was not generated with probes (context or unprobed); "
                             f"probed chunks: {sorted(self.run.top1)}")
        if layer not in meta["logit_layers"] or head not in meta["logit_heads"]:
            raise ValueError(f"the run holds attention logits for layers {meta['logit_layers']} and heads "
                             f"{meta['logit_heads']} only (record with --logit-layers / --logit-heads)")
        qi = (lat - f.chunk_start - chunk * f.chunk_frames) * f.tokens_per_frame + row * f.latent_grid[1] + col
        e, q = self.run.top1[chunk]
        le, lq = self.run.logits[chunk]
        li, hi = meta["logit_layers"].index(layer), meta["logit_heads"].index(head)
        src_e, src_q = int(e[layer, head, qi]), int(q[layer, head, qi])
        exact, source_e = self._cached(chunk, le[li, hi, qi], src_e)
        stored, source_q = self._cached(chunk, lq[li, hi, qi], src_q)
        n_lat = f.latent_frame(self.run.method.shape[0] - 1) + 1
        thumbs = self.run.method[[f.first_output_frame(i) for i in range(n_lat)]].numpy()
        return {"query": (lat, row, col), "layer": layer, "head": head, "method": meta["method"],
                "source_bf16": source_e, "source_method": source_q,
                "jumped": src_e != src_q, "logits_bf16": exact.numpy(), "logits_method": stored.numpy(),
                "frames": thumbs, "grid": f.latent_grid}

    def energy(self, rank: int = 8) -> list[dict]:
        return [{k: v.numpy() for k, v in D.energy_spectrum(S, rank).items()} for S in self.run.stats]
