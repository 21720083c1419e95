"""Trace analysis: how much each method moves attention, on the same cache state (docs/method.md §4).

For every traced layer the cached K/V are written into a `KVCache` chunk by chunk and committed, exactly
as during generation (sink and most recent chunk stay full precision unless configured otherwise). The
history-Query statistics S are built causally, as in a run: with `L{l}.q_hist_chunk`, each chunk's history
queries enter S when that chunk is written, before it is committed, so a span is quantized with the
queries issued up to that point. A trace with `q_hist` but no chunk indices (written before the extension)
seeds S with all of q_hist for every span, and a trace without q_hist is analysed with S = identity; the
report's `config.stats` says which. The traced (measured) queries never enter S. They then attend to
exact and to quantized keys/values.

With Keys quantized, each layer also gets the rate-distortion meter of quantwm.evaluation.rate_distortion on its
quantized spans, weighted by the second moment of the traced (measured) queries, the same queries the shift
metric reads: `k_bits_above_bound` (the Keys' stored bits per element minus the Gaussian bound's rate at the
distortion reached), `k_distortion` and `k_bound_distortion` (that distortion and the bound's at the Keys'
bits, as fractions of the weighted variance) and `k_bits_per_element` (the Keys' stored bits alone).

Pre-RoPE traces are read with the standard 3-D RoPE of `quantwm.core.rope` over the trace's frame grid.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import torch

from ..core.budget import fit_methods
from ..core.cache import CacheConfig, KVCache
from ..core.methods import make_method, parse_method_name
from ..core.quant import BudgetError
from ..core.rope import FrameShift, Rope3D
from .metrics import attention_metrics, query_energy, rel_err, second_moment
from .rate_distortion import rate_distortion, summarise
from .trace import Trace

MEAN_KEYS = ("shift_rate", "topk_overlap", "attn_kl", "logit_rmse", "k_rel_err", "v_rel_err", "out_rel_err",
             "bits_per_element", "k_bits_per_element", "k_bits_above_bound", "k_distortion", "k_bound_distortion")


STATS_SOURCES = {"causal": "causal: each chunk's q_hist enters S when the chunk is written (q_hist_chunk)",
                 "all": "not causal: all of q_hist seeds S for every span (the trace has no q_hist_chunk)",
                 "identity": "S = identity (the trace has no q_hist)"}


def stats_source(trace: Trace) -> str:
    """How analyze builds S for this trace: a key of STATS_SOURCES (the same for every layer, or 'mixed')."""
    kinds = {"causal" if "q_hist_chunk" in t else "all" if "q_hist" in t else "identity" for t in trace.layers.values()}
    return kinds.pop() if len(kinds) == 1 else "mixed"


def layer_cache(trace: Trace, layer: int, config: CacheConfig, chunk_tokens: int) -> tuple[KVCache, Callable]:
    """The traced layer's keys and values committed into a one-layer cache; returns (cache, rope or None: the
    rope that turns the trace's stored keys into post-RoPE ones)."""
    t = trace.layers[layer]
    H, Nk, D = t["k"].shape
    rope = Rope3D(D, trace.frame_grid) if trace.meta["rope"] == "pre" else None
    keys = t["k"].float()
    if rope is None and make_method(config.method, config.k_bits, dict(config.method_options)).pre_rope:
        # a method defined on pre-RoPE keys, on a post-RoPE trace: un-rotate with the trace's 3-D RoPE
        keys = Rope3D(D, trace.frame_grid)(keys[None], torch.arange(Nk), inverse=True)[0]
        config = replace(config, rope="pre")
        cache = KVCache(config, 1, rope=Rope3D(D, trace.frame_grid))
    else:  # a trace whose channels carry 3-D RoPE pairs moves the Queries to the frames that read a span
        theta = trace.meta.get("rope_theta")
        shift = None if theta is None else FrameShift(D, trace.tokens_per_frame, float(theta))
        cache = KVCache(config, 1, rope=rope, frame_shift=shift)
    hist, chunk_of = t.get("q_hist"), t.get("q_hist_chunk")
    if hist is not None and chunk_of is None:
        cache.load_query_stats(0, second_moment(hist.float()), count=hist.shape[1])
    for i, s in enumerate(range(0, Nk, chunk_tokens)):
        cache.write(0, keys[None, :, s:s + chunk_tokens], t["v"][None, :, s:s + chunk_tokens].float(), i)
        if chunk_of is not None and (chunk_of == i).any():
            cache.observe(0, hist[None, :, chunk_of == i].float())
        cache.commit(0, i)
    return cache, rope


def key_bits_per_element(cache: KVCache) -> float:
    """Bits per element of the quantized Keys alone (codes plus their metadata); nan if no Key is quantized."""
    if not cache.quantize_k:
        return float("nan")
    nbytes = cache.quantized_bytes("k")
    elems = sum(s.n_tokens * s.bhd[0] * s.bhd[1] * s.bhd[2] for layer in range(cache.n_layers)
                for s in cache.inspect(layer) if s.quantized)
    return 8 * nbytes / elems if elems else float("nan")


def quantized_spans(cache: KVCache, layer: int = 0) -> list[slice]:
    """The token ranges (in cache order) of the layer's quantized spans."""
    ends = torch.tensor([s.n_tokens for s in cache.inspect(layer)]).cumsum(0).tolist()
    return [slice(end - s.n_tokens, end) for s, end in zip(cache.inspect(layer), ends) if s.quantized]


def keys_config(trace: Trace, method: str, budget: float) -> tuple[CacheConfig, int]:
    """(config, chunk tokens) with which `quantwm analyze --target k --budget B` commits a trace's Keys for `method`:
    the trace's chunks, its default one sink and one recent chunk kept exact."""
    chunk = int(trace.meta.get("chunk_frames", 1)) * trace.tokens_per_frame
    held = max(1, next(iter(trace.layers.values()))["k"].shape[1] // chunk - 2)  # the quantized chunks a layer holds
    return CacheConfig(method=method, target="k", sink_chunks=1, recent_chunks=1, budget_k=budget,
                       held_chunks=held), chunk


def key_rate_distortion(cache: KVCache, k: torch.Tensor, k_hat: torch.Tensor, q: torch.Tensor) -> dict:
    """The rate-distortion meter on layer 0's quantized Key spans: k, k_hat (H, L, D) in cache order, S from
    the queries q (H, Nq, D); the figures of rate_distortion.summarise, plus the Keys' bits per element."""
    bits = key_bits_per_element(cache)
    nan = {"k_bits_above_bound": math.nan, "k_distortion": math.nan, "k_bound_distortion": math.nan}
    if math.isnan(bits):
        return {"k_bits_per_element": bits, **nan}
    S = second_moment(q)  # (H, D, D), the measured queries'
    figures = summarise([rate_distortion(k[:, s], k_hat[:, s], S, bits) for s in quantized_spans(cache)])
    return {"k_bits_per_element": bits, "k_bits_above_bound": figures["bits_above_bound"],
            "k_distortion": figures["distortion"], "k_bound_distortion": figures["bound_distortion"]}


def layer_keys(trace: Trace, layer: int, config: CacheConfig,
               chunk_tokens: int) -> tuple[KVCache, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(cache, k, k_hat, bias): the traced layer committed as `layer_cache` commits it, its exact keys (H, L, D)
    (post-RoPE, as the cache reads them), the cache's keys, and the logit bias (H, Nq, L) the method adds for the
    trace's queries (None without one)."""
    t = trace.layers[layer]
    cache, rope = layer_cache(trace, layer, config, chunk_tokens)
    k = t["k"].float()
    if rope is not None:
        k = rope(k[None], torch.arange(k.shape[1]))[0]
    bias = cache.logit_bias(0, t["q"].float()[None], trace.softmax_scale)
    return cache, k, cache.keys(0)[0], None if bias is None else bias[0]


def analyze_layer(trace: Trace, layer: int, config: CacheConfig, chunk_tokens: int, topk: int = 8) -> dict:
    """Metrics of one method on one traced layer: means plus per-head lists."""
    t = trace.layers[layer]
    q, v = t["q"].float(), t["v"].float()
    scale = trace.softmax_scale
    cache, k, k_hat, bias = layer_keys(trace, layer, config, chunk_tokens)
    v_hat = cache.values(0)[0]
    heads = attention_metrics(q, k, k_hat, scale, bias, topk=topk)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
    out_hat = torch.nn.functional.scaled_dot_product_attention(q, k_hat, v_hat, scale=scale, attn_mask=bias)
    row = {name: float(x.mean()) for name, x in heads.items()}
    row.update(k_rel_err=rel_err(k_hat, k), v_rel_err=rel_err(v_hat, v), out_rel_err=rel_err(out_hat, out),
               bits_per_element=cache.bits_per_element())
    row.update(key_rate_distortion(cache, k[:, cache.positions(0)], k_hat, q))
    row["heads"] = {name: [float(a) for a in x] for name, x in heads.items()}
    row["budget_choice"] = cache.budget_choice
    return {"layer": layer, **row}


def analyze_trace(trace: Trace, methods: list[str], target: str = "k", bits: int = 2, chunk_frames: int | None = None,
                  sink_chunks: int = 1, recent_chunks: int = 1, progress: Callable | None = None,
                  method_options: tuple = (), budget: tuple = (None, None)) -> dict:
    """The `quantwm analyze` report: {"methods": {name: {"mean", "layers"}}, "query_energy_top8", "trace"}.
    `budget`: (Keys, Values) bits per element: each method configures itself within it (docs/method.md §3.1);
    one that cannot is left out, with its reason in `report["config"]["left_out"]`."""
    for m in methods:
        parse_method_name(m)
    if chunk_frames is None:
        chunk_frames = int(trace.meta.get("chunk_frames", 1))
    if chunk_frames < 1:
        raise ValueError(f"chunk_frames must be >= 1, got {chunk_frames}")
    chunk_tokens = chunk_frames * trace.tokens_per_frame
    first = next(iter(trace.layers.values()))["k"]  # (H, L, D)
    head_dim = first.shape[-1]
    # the quantized chunks a layer holds once the trace is committed: what a per-layer constant is counted over
    held = max(1, first.shape[1] // chunk_tokens - sink_chunks - recent_chunks)
    methods, left_out = fit_methods(methods, *budget, head_dim, chunk_tokens, target, dict(method_options),
                                    layer_elements=first.shape[0] * held * chunk_tokens * head_dim)
    report: dict = {"methods": {}, "trace": dict(trace.meta),
                    "config": {"target": target, "bits": bits, "chunk_frames": chunk_frames,
                               "stats": STATS_SOURCES.get(stats_source(trace), "mixed: differs by layer"),
                               "sink_chunks": sink_chunks, "recent_chunks": recent_chunks,
                               "method_options": dict(method_options), "grid": {},
                               "budget": {"k": budget[0], "v": budget[1]}, "left_out": left_out, "configuration": {}}}
    steps = [(m, l) for m in methods for l in trace.layers]
    for i, (m, layer) in enumerate(steps):
        if m in left_out:
            continue
        config = CacheConfig(method=m, target=target, k_bits=bits, v_bits=bits, sink_chunks=sink_chunks,
                             recent_chunks=recent_chunks, method_options=method_options, budget_k=budget[0],
                             budget_v=budget[1], held_chunks=held)
        try:
            row = analyze_layer(trace, layer, config, chunk_tokens)
        except BudgetError as e:  # a budget the method's configurations fit on a Gaussian span, not on this trace
            left_out[m] = str(e).splitlines()[0]
            report["methods"].pop(m, None)
            continue
        report["methods"].setdefault(m, {"mean": {}, "layers": []})["layers"].append(row)
        if progress:
            progress(i + 1, len(steps), f"{m} layer {layer}")
    for m, entry in report["methods"].items():
        entry["mean"] = {key: sum(r[key] for r in entry["layers"]) / len(entry["layers"]) for key in MEAN_KEYS}
        report["config"]["grid"][m] = make_method(m, bits, dict(method_options)).grid()
        if any(b is not None for b in budget):  # what the layers' caches chose on their first spans
            report["config"]["configuration"][m] = {
                kind: "; ".join(dict.fromkeys(r["budget_choice"][kind] for r in entry["layers"]))
                for kind, b in zip("kv", budget) if b is not None and kind in target and parse_method_name(m)[0] != "bf16"}
    energy = []
    for t in trace.layers.values():
        _, frac = query_energy(second_moment(t.get("q_hist", t["q"]).float()), rank=8)
        energy.append([float(x) for x in frac])
    report["query_energy_top8"] = energy
    return report


def report_rows(report: dict) -> tuple[list[str], list[list]]:
    """A report's per-method means as a table: (header, rows), rounded for display."""
    header = ["method", *MEAN_KEYS]
    rows = [[m, *(round(e["mean"][k], 4) if e["mean"][k] == e["mean"][k] else None for k in MEAN_KEYS)]
            for m, e in report["methods"].items()]
    return header, rows
