"""The numbers behind the diagnostics app: where and why a quantized rollout departs from BF16.

Per frame: PSNR against the BF16 rollout, tdiff-L1 flicker, the motion-compensated warping error, the top-1
shift rate of the frame's queries; per pixel: the flicker and warping-error maps; per token: the top-1 jump
map (fraction of layers/heads whose argmax over the cached keys moved under quantization). Per query: the
attention logits over the cache, exact vs stored keys, as the query saw the cache (chunks still inside
the full-precision recent window at that time are exact), reshaped to (cached frames, positions). Per
(layer, head): the eigen spectrum of the history-Query second moment S and its cumulative energy. Logits
are what the method compares: q·k, plus the `+jensen` read-path bias on the stored keys when the method
applies it (as in the probes behind every shift rate).

Tokens run frame by frame, row-major in a frame: token j of a frame grid (h, w) is
(frame j // (h*w), row (j % (h*w)) // w, col j % w), as in trace files.
"""
from __future__ import annotations

import math

import torch

from . import metrics as M


def token_coords(j: int, grid: tuple[int, int]) -> tuple[int, int, int]:
    """Cached token index -> (frame, row, col)."""
    h, w = grid
    return j // (h * w), (j % (h * w)) // w, j % w


def pixel_to_patch(x: int, y: int, size: tuple[int, int], grid: tuple[int, int]) -> tuple[int, int]:
    """Pixel (x, y) of a frame of `size` (height, width) -> the (row, col) of its patch token.

    Raises ValueError for a pixel outside the frame.
    """
    H, W = size
    if not (0 <= x < W and 0 <= y < H):
        raise ValueError(f"pixel (x={x}, y={y}) lies outside the {W}x{H} frame")
    h, w = grid
    return int(y) * h // H, int(x) * w // W


# ---- per frame ----------------------------------------------------------------------------------

def frame_series(frames: torch.Tensor, ref: torch.Tensor, context_frames: int,
                 flow: torch.Tensor | None = None) -> dict[str, list]:
    """Per-frame PSNR (dB), tdiff-L1 and motion-compensated warping error of `frames` against `ref`
    (T, H, W, 3) in [0, 1], and which frames are identical to the reference.

    PSNR is None for frames identical to the reference (the context, and generated frames before anything
    was quantized): they have no finite PSNR, and a cap would squeeze the axis; `identical` marks them.
    tdiff and the warping error of frame 0 are None. `flow` is the reference's (`metrics.reference_flow`)
    when the caller has it already.
    """
    p = M.psnr(frames, ref).tolist()
    same = [bool(torch.equal(a, b)) or t < context_frames for t, (a, b) in enumerate(zip(frames, ref))]
    multi = len(frames) > 1
    td = [None] + M.tdiff(frames, ref).tolist() if multi else [None]
    warp = [None] + M.warp_error(frames, ref, flow).tolist() if multi else [None]
    return {"psnr": [None if same[t] else v for t, v in enumerate(p)], "tdiff": td, "warp_error": warp,
            "identical": same}


def flicker_maps(frames: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per-pixel flicker (T, H, W): |(x_t - x_{t-1}) - (r_t - r_{t-1})|, zeros for frame 0."""
    f = M.flicker_map(frames, ref)
    return torch.cat([torch.zeros_like(f[:1]), f])


def warp_maps(frames: torch.Tensor, ref: torch.Tensor, flow: torch.Tensor | None = None) -> torch.Tensor:
    """Per-pixel motion-compensated warping error (T, H, W) (`metrics.warp_error_map`), zeros for frame 0."""
    w = M.warp_error_map(frames, ref, flow)
    return torch.cat([torch.zeros_like(w[:1]), w])


def frame_maps(frames: torch.Tensor, ref: torch.Tensor, flow: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The flicker and warping-error maps (H, W) of frame `t` against `ref` (zeros at frame 0, which has no
    previous frame); `flow` is the reference's whole optical flow (T-1, H, W, 2)."""
    if t == 0:
        zero = torch.zeros(frames.shape[1:3])
        return zero, zero
    pair = frames[t - 1:t + 1], ref[t - 1:t + 1]
    return flicker_maps(*pair)[-1], warp_maps(*pair, flow[t - 1:t])[-1]


def clip_metrics(frames: torch.Tensor, ref: torch.Tensor, context_frames: int, flow: torch.Tensor) -> dict:
    """PSNR (from the mean MSE, capped at 100 dB), SSIM, tdiff and warping error of the generated frames
    (from `context_frames` on; the temporal ones from the frame before) against `ref`."""
    x, r = frames[context_frames:], ref[context_frames:]
    mse = float((x - r).square().mean()) if len(x) else 0.0
    lo = max(context_frames - 1, 0)
    return {"psnr": min(100.0, -10 * math.log10(max(mse, 1e-10))), "ssim": float(M.ssim(x, r).mean()),
            "tdiff": float(M.tdiff(frames[lo:], ref[lo:]).mean()),
            "warp_error": float(M.warp_error(frames[lo:], ref[lo:], flow[lo:]).mean())}


def _probe_of(probes, frame: int, chunk_frames: int):
    c = frame // chunk_frames
    for p in probes:
        if p.chunk == c:
            return p
    return None


def frame_jumps(probes, frame: int, chunk_frames: int, tokens_per_frame: int,
                layer: int | None = None, head: int | None = None) -> torch.Tensor | None:
    """(N,) fraction of the chosen layers/heads in which each token of `frame` changed its top-1 source.

    layer/head None aggregate over all. None when the frame has no probe (a context frame).
    """
    p = _probe_of(probes, frame, chunk_frames)
    if p is None:
        return None
    n_layers, n_heads = len(p.top1_exact), p.top1_exact[0].shape[0]
    if layer is not None and not 0 <= layer < n_layers:
        raise ValueError(f"layer {layer} out of range: the model has {n_layers} layers")
    if head is not None and not 0 <= head < n_heads:
        raise ValueError(f"head {head} out of range: the model has {n_heads} heads")
    s = (frame - p.chunk * chunk_frames) * tokens_per_frame
    sl = slice(s, s + tokens_per_frame)
    layers = range(n_layers) if layer is None else [layer]
    heads = slice(None) if head is None else slice(head, head + 1)
    moved = torch.stack([(p.top1_exact[l][heads, sl] != p.top1_quant[l][heads, sl]).float() for l in layers])
    return moved.mean((0, 1))  # (L, h, N) -> (N,)


def shift_rate_per_frame(probes, n_frames: int, chunk_frames: int, tokens_per_frame: int) -> list:
    """Top-1 shift rate of each frame's queries over all layers and heads; None for unprobed frames."""
    out = []
    for t in range(n_frames):
        j = frame_jumps(probes, t, chunk_frames, tokens_per_frame)
        out.append(None if j is None else float(j.mean()))
    return out


def worst_frames(values: list, k: int = 3, largest: bool = True) -> list[int]:
    """Indices of the k worst entries (None and nan skipped), worst first."""
    valid = [(v, t) for t, v in enumerate(values) if v is not None and not math.isnan(v)]
    valid.sort(key=lambda vt: -vt[0] if largest else vt[0])
    return [t for _, t in valid[:k]]


# ---- per query ----------------------------------------------------------------------------------

def seen_by_chunk(exact: torch.Tensor, stored: torch.Tensor, chunk: int, chunk_tokens: int,
                  recent_chunks: int) -> torch.Tensor:
    """The cached keys (or values) chunk `chunk`'s queries saw: (H, L, D) -> (H, chunk*chunk_tokens, D).

    Spans are quantized once, when they leave the recent window, and never re-quantized; so the stored
    tensors of the final cache are what every later chunk saw, except the `recent_chunks` chunks just
    before `chunk`, which were still exact then.
    """
    n = chunk * chunk_tokens
    if n > exact.shape[1]:
        raise ValueError(f"chunk {chunk} saw {n} cached tokens but the cache holds {exact.shape[1]}")
    out = stored[:, :n].clone()
    lo = max(0, chunk - recent_chunks) * chunk_tokens
    out[:, lo:n] = exact[:, lo:n]
    return out


def query_logits(q: torch.Tensor, k_exact: torch.Tensor, k_stored: torch.Tensor, scale: float = 1.0,
                 tokens_per_frame: int | None = None, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of one query q (D,) over cached keys (L, D), exact and stored, each (L,) or
    (L // tokens_per_frame, tokens_per_frame) when tokens_per_frame is given (frames x positions).
    `bias` (L,) is added to the stored keys' logits (the +jensen term)."""
    if q.dim() != 1 or k_exact.shape != k_stored.shape or k_exact.shape[-1] != q.shape[0]:
        raise ValueError(f"expected q (D,) and keys (L, D); got {tuple(q.shape)}, {tuple(k_exact.shape)}, "
                         f"{tuple(k_stored.shape)}")
    a, b = (k.float() @ q.float() * scale for k in (k_exact, k_stored))
    if bias is not None:
        b = b + bias.float()
    if tokens_per_frame:
        if a.shape[0] % tokens_per_frame:
            raise ValueError(f"{a.shape[0]} cached tokens are not whole frames of {tokens_per_frame}")
        a, b = a.reshape(-1, tokens_per_frame), b.reshape(-1, tokens_per_frame)
    return a, b


def attention_output_error(q: torch.Tensor, k: torch.Tensor, k_hat: torch.Tensor, v: torch.Tensor,
                           v_hat: torch.Tensor, scale: float = 1.0) -> tuple[float, float]:
    """(squared error, squared norm) of softmax(q kᵀ) v with stored vs exact K/V; q (H, N, D), k/v (H, L, D)."""
    ref = torch.softmax(q @ k.transpose(1, 2) * scale, -1) @ v
    out = torch.softmax(q @ k_hat.transpose(1, 2) * scale, -1) @ v_hat
    return float((out - ref).square().sum()), float(ref.square().sum())


def probed_attention_error(probes, k_exact: list, k_stored: list, v_exact: list, v_stored: list,
                           chunk_tokens: int, recent_chunks: int = 1) -> float:
    """Relative error of the attention output over the cache, stored vs exact K/V (per layer (H, L, D) lists),
    summed over every probed chunk and layer, each chunk seeing the cache as it was then."""
    num = den = 0.0
    for p in probes:
        n = p.chunk * chunk_tokens
        for l in range(len(k_exact)):
            k_hat = seen_by_chunk(k_exact[l], k_stored[l], p.chunk, chunk_tokens, recent_chunks)
            v_hat = seen_by_chunk(v_exact[l], v_stored[l], p.chunk, chunk_tokens, recent_chunks)
            a, b = attention_output_error(p.q[l].cpu(), k_exact[l][:, :n], k_hat, v_exact[l][:, :n], v_hat)
            num, den = num + a, den + b
    return num / den if den else float("nan")


# ---- query energy -------------------------------------------------------------------------------

def energy_spectrum(stats: torch.Tensor, rank: int = 8) -> dict[str, torch.Tensor]:
    """S (H, D, D) -> eigenvalues (H, D) descending, cumulative energy fraction (H, D), top-`rank` fraction (H,)."""
    ev, frac = M.query_energy(stats, rank=rank)
    total = ev.sum(-1, keepdim=True).clamp_min(1e-30)
    return {"eigenvalues": ev, "cumulative": ev.cumsum(-1) / total, "top_fraction": frac}


def trace_margins(logits_bf16, logits_method, source_bf16: tuple, grid: tuple[int, int]) -> dict:
    """How firmly one traced Query picks its source: the logit margin (top-1 minus runner-up) under exact keys
    and under the method's stored keys, and the rank the BF16 source takes under the stored keys (1: still the
    top-1). Logits are (cached frames, tokens per frame) arrays, NaN where the cache held no token; the source is
    (frame, row, col) on a `grid` (rows, cols) of tokens."""
    e = torch.as_tensor(logits_bf16, dtype=torch.float64).flatten()
    m = torch.as_tensor(logits_method, dtype=torch.float64).flatten()
    held = torch.isfinite(e) & torch.isfinite(m)
    if int(held.sum()) < 2:
        raise ValueError("a margin needs at least two cached tokens")

    def margin(x: torch.Tensor) -> float:
        top = x[held].topk(2).values
        return float(top[0] - top[1])

    f, r, c = source_bf16
    src = (f * grid[0] + r) * grid[1] + c
    rank = int((m[held] > m[src]).sum()) + 1
    return {"margin_bf16": margin(e), "margin_method": margin(m), "bf16_source_rank": rank}


# ---- trace files --------------------------------------------------------------------------------

def trace_keys(trace, layer: int, method: str, target: str = "k", bits: int = 2) -> dict[str, torch.Tensor]:
    """A traced layer's queries and its keys exact and as `method` stores them (as `quantwm analyze` builds
    the cache: chunk by chunk, sink and recent chunk full precision), plus each query's top-1 under both.

    Returns q (H, Nq, D) scaled by the softmax scale, k, k_hat (H, Nk, D), bias (H, Nq, Nk) the +jensen term
    or None, top1_exact, top1_quant (H, Nq) (the latter on the biased logits).
    """
    from ..core.cache import CacheConfig
    from .analyze import layer_cache

    if layer not in trace.layers:
        raise ValueError(f"layer {layer} is not in the trace (layers: {', '.join(map(str, trace.layers))})")
    config = CacheConfig(method=method, target=target, k_bits=bits, v_bits=bits)
    chunk_tokens = int(trace.meta.get("chunk_frames", 1)) * trace.tokens_per_frame
    cache, rope = layer_cache(trace, layer, config, chunk_tokens)
    t = trace.layers[layer]
    q, k = t["q"].float() * trace.softmax_scale, t["k"].float()
    if rope is not None:
        k = rope(k[None], torch.arange(k.shape[1]))[0]
    k_hat = cache.keys(0)[0]
    bias = cache.logit_bias(0, q[None], 1.0)  # q carries the softmax scale already
    bias = None if bias is None else bias[0]
    exact, quant = M.probe_logits(q, k, k_hat, 1.0, bias)
    return {"q": q, "k": k, "k_hat": k_hat, "bias": bias, "top1_exact": exact.argmax(-1), "top1_quant": quant.argmax(-1)}


# ---- trace files ------------------------------------------------------------------------------------

def trace_query_view(path: str, method: str, target: str, bits: int, layer: int, head: int, query: int) -> dict:
    """One traced query under exact and `method`'s stored keys: logits (frames x positions), top-1 sources,
    the jump map of every query of the layer, and the trace's frames (uint8) when it holds them."""
    from .trace import read_trace

    trace = read_trace(path)
    r = trace_keys(trace, int(layer), method, target, int(bits))
    H, Nq, _ = r["q"].shape
    if not 0 <= head < H:
        raise ValueError(f"head {head} out of range: the trace has {H} heads")
    if not 0 <= query < Nq:
        raise ValueError(f"query {query} out of range: layer {layer} has {Nq} queries")
    tpf, grid = trace.tokens_per_frame, trace.frame_grid
    whole = r["k"].shape[1] % tpf == 0
    exact, stored = query_logits(r["q"][head, query], r["k"][head], r["k_hat"][head],
                                   tokens_per_frame=tpf if whole else None,
                                   bias=None if r["bias"] is None else r["bias"][head, query])
    if not whole:
        exact, stored = exact[None], stored[None]
    moved = (r["top1_exact"] != r["top1_quant"]).float()  # (H, Nq)
    e, q = int(r["top1_exact"][head, query]), int(r["top1_quant"][head, query])
    return {"logits_bf16": exact.numpy(), "logits_method": stored.numpy(),
            "source_bf16": token_coords(e, grid), "source_method": token_coords(q, grid), "jumped": e != q,
            "query_coords": token_coords(r["k"].shape[1] + query, grid),
            "jumps": moved.mean(0).numpy(), "shift_rate": float(moved.mean()), "heads": H, "queries": Nq,
            "layers": list(trace.layers), "grid": grid, "tokens_per_frame": tpf,
            "frames": None if trace.frames is None else trace.frames.numpy()}


def trace_energy(path: str, rank: int = 8) -> list[dict]:
    """Per traced layer: the spectrum of S from its history queries (q_hist, else q)."""
    from .trace import read_trace

    trace = read_trace(path)
    return [{k: v.numpy() for k, v in energy_spectrum(M.second_moment(t.get("q_hist", t["q"]).float()), rank).items()}
            for t in trace.layers.values()]
