"""A synthetic trace that models how a video world model's attention retrieves memory.

The world is a 2-D map of locations, each with a random content vector. A camera sees an h x w window
of it, pans away along a trajectory and comes back, so the chunk being generated looks at places that
earlier (now cached) frames saw. Each head of each layer:

* Keys: the content of the token's location projected into the head (living, as in trained video
  models, on the slowly rotating RoPE pairs so that the same place matches across frames), a per-frame
  perturbation (lighting, moving things), isotropic detail noise, a few large outlier channels (as in
  real K caches), and a temporal component so recent frames win ties; then 3-D RoPE at the token's
  (frame, row, col), i.e. post-RoPE storage.
* Queries: the same projection of the location the query looks for, scaled so attention is sharp, plus
  the temporal component and a little noise: query energy sits in `content_dim` directions (the query
  subspace's dimension; `--query-dims`). Measured top-8 energy of S: 8 dims ~97%, 12 dims ~71% (one
  LingBot-World-v2 layer in the paper), 22 dims ~44%; `QUERY_DIMS_FOR_TOP8` names these settings.
* Values: another projection of the content plus noise.

`kind` (`--kind`) chooses how the heads' channels carry this world; every kind has the same world, camera
and noise for a seed (the kinds' own draws come from a second generator), and the parameters below are fixed
from what they model, not tuned on any reported seed or to any method's result:

* `aligned` (default): as above; the 24 slow-pair channels hold ~98% of diag(S).
* `flat`: the content projection is dense over all head_dim channels (W_q/W_k arbitrary with respect to
  RoPE's pairs) with the same P^T P, so the same pre-RoPE logits. RoPE turns the share on fast pairs with
  position, so S spreads over channels and, less, over eigen-directions: top-24 of diag(S) ~33%, top-8
  eigen-energy ~82% (aligned: ~98%, ~98%; seed 100001, 8x8 grid, 8 query dims).
* `rotated`: the aligned trace in a random orthogonal basis of the head space (one per head, applied to the
  stored post-RoPE q and k): attention and S's eigen-spectrum are exactly aligned's, only channels and query
  subspace no longer line up (top-24 of diag(S) ~34%). This isolates the channel assumption; a rotation
  before RoPE would move content onto fast pairs, which is `flat`.
* `norope`: aligned without RoPE, to separate RoPE's part.
* `outliers`: aligned with 1% of the cached tokens' keys louder by a factor drawn from 5..20 (the same tokens
  and factors in every layer and head, as massive activations live in the residual stream), placed uniformly
  at random: the token-norm imbalance that breaks per-channel INT2 (OScaR, arXiv 2605.19660). A loud key
  scales its logits too, so loud tokens take most of the attention (~93% above), as attention sinks do.
  Sinks whose keys are unusually *small* are not modelled.

Known not to fit: pre-RoPE methods (`kivi-pre`) un-rotate with the trace's 3-D RoPE, which is wrong for
`norope` and `rotated` traces.

Nothing here knows about any quantization method; the parameters are fixed, not tuned to a result.
"""
from __future__ import annotations

import math

import torch

from ..core.rope import Rope3D
from .trace import TraceWriter


def camera_path(n_frames: int, world: tuple[int, int], grid: tuple[int, int], g: torch.Generator) -> torch.Tensor:
    """Integer camera offsets (n_frames, 2): out along a random direction, then back past the start."""
    (H, W), (h, w) = world, grid
    span = torch.tensor([H - h, W - w], dtype=torch.float64)
    start = span * torch.rand(2, generator=g, dtype=torch.float64) * 0.25
    end = span * (0.75 + 0.25 * torch.rand(2, generator=g, dtype=torch.float64))
    t = torch.linspace(0, 1, n_frames, dtype=torch.float64)
    phase = torch.sin(math.pi * t)[:, None] * 1.05  # out and back (a loop that revisits)
    return (start + (end - start) * phase).round().long().clamp(torch.zeros(2, dtype=torch.long), span.long())


QUERY_DIMS_FOR_TOP8 = {"97%": 8, "71%": 12, "45%": 22}  # query-subspace dims -> measured top-8 energy of S
KINDS = ("aligned", "flat", "rotated", "norope", "outliers")
KIND_SEED = 1 << 40  # the kinds' own draws come from seed + KIND_SEED, apart from the aligned stream
LOUD_FRACTION, LOUD_GAIN = 0.01, (5.0, 20.0)  # outliers: share of cached tokens with loud keys, their norm factor


def loud_tokens(n_cached: int) -> int:
    """How many cached tokens the `outliers` kind makes loud."""
    return max(1, round(LOUD_FRACTION * n_cached))


def make_synthetic_trace(seed: int = 0, n_layers: int = 4, n_heads: int = 8, head_dim: int = 128,
                         grid: tuple[int, int] = (12, 16), cached_frames: int = 24, chunk_frames: int = 3,
                         world: tuple[int, int] | None = None, content_dim: int = 8,
                         kind: str = "aligned") -> TraceWriter:
    """Build the trace in memory; `.save(path)` writes it. A frame is `grid` tokens, a cached chunk (a span of
    the cache) `chunk_frames` frames; the world defaults to 2.5 x 3 frames (30 x 48 for the default grid);
    `kind` is one of KINDS (module docstring)."""
    if kind not in KINDS:
        raise ValueError(f"unknown synthetic trace kind {kind!r}; valid kinds: {', '.join(KINDS)}")
    if min(grid) < 1 or cached_frames < chunk_frames or chunk_frames < 1 or cached_frames % chunk_frames:
        raise ValueError(f"need a positive grid and cached frames a multiple of chunk frames, got grid {grid}, "
                         f"{cached_frames} cached frames, {chunk_frames} per chunk")
    world = world or (math.ceil(2.5 * grid[0]), 3 * grid[1])
    rope = Rope3D(head_dim, grid)
    n_slow = 3 * 4 * 2  # 4 slow rotary pairs in each of the t/row/col groups carry content
    if not 1 <= content_dim <= n_slow:
        raise ValueError(f"content_dim (the query subspace's dimension) must lie in 1..{n_slow}, got {content_dim}")
    g = torch.Generator().manual_seed(seed)
    gk = torch.Generator().manual_seed(seed + KIND_SEED)
    h, w = grid
    tpf = h * w
    total = cached_frames + chunk_frames
    content = torch.randn(world[0], world[1], content_dim, generator=g)
    path = camera_path(total, world, grid, g)
    rows = torch.arange(h)[:, None] + path[:, None, None, 0]  # (T, h, 1)
    cols = torch.arange(w)[None, :] + path[:, None, None, 1]  # (T, 1, w)
    loc = content[rows.expand(total, h, w), cols.expand(total, h, w)].reshape(total, tpf, content_dim)
    frame_noise = 0.3 * torch.randn(total, tpf, content_dim, generator=g)
    seen = loc + frame_noise  # what each frame's tokens carry
    positions = torch.arange(total * tpf)

    # Slow RoPE pairs (the last pairs of each of the t/row/col groups) carry content.
    pairs_t, pairs_r, _ = (s // 2 for s in rope.split)
    slow = [p for start, n in ((0, pairs_t), (pairs_t, pairs_r), (pairs_t + pairs_r, pairs_r))
            for p in range(start + n - 4, start + n)]
    slow_ch = torch.tensor([c for p in slow for c in (2 * p, 2 * p + 1)])
    gauge = math.sqrt(len(slow_ch) / content_dim)  # P^T P = gauge^2 I
    recency_pair = pairs_t // 2  # a temporal pair of middling frequency: cos(ω Δt) favours recent frames
    writer = TraceWriter(tpf, grid, head_dim ** -0.5, rope="post", model=f"synthetic-world(seed={seed})")
    writer.extra_meta["chunk_frames"] = chunk_frames
    writer.extra_meta["kind"] = kind
    if kind not in ("norope", "rotated"):  # the stored channels carry Wan-style 3-D RoPE pairs (FrameShift)
        writer.extra_meta["rope_theta"] = rope.theta
    n_cached = cached_frames * tpf
    n_loud = loud_tokens(n_cached)
    loud = torch.randperm(n_cached, generator=gk)[:n_loud]  # drawn for every kind, used by outliers
    gain = LOUD_GAIN[0] + (LOUD_GAIN[1] - LOUD_GAIN[0]) * torch.rand(n_loud, generator=gk)
    for layer in range(n_layers):
        qs, ks, vs, qh = [], [], [], []
        for _ in range(n_heads):
            basis = torch.linalg.qr(torch.randn(len(slow_ch), content_dim, generator=g))[0]
            P = torch.zeros(head_dim, content_dim)
            P[slow_ch] = basis * gauge  # content -> slow channels
            if kind == "flat":  # content -> every channel, with the same P^T P (so the same pre-RoPE logits)
                P = torch.linalg.qr(torch.randn(head_dim, content_dim, generator=gk))[0] * gauge
            sharp = 3.0 + 2.0 * torch.rand(1, generator=g).item()
            outlier_ch = torch.randperm(head_dim, generator=g)[:4]
            k = seen @ P.T + 0.5 * torch.randn(total, tpf, head_dim, generator=g)
            k[..., outlier_ch] += 6.0 * torch.randn(4, generator=g).sign() * (1 + torch.rand(4, generator=g))
            k[..., 2 * recency_pair] += 2.0
            q = sharp * (loc + 0.1 * torch.randn(total, tpf, content_dim, generator=g)) @ P.T
            q = q + 0.2 * torch.randn(total, tpf, head_dim, generator=g)
            q[..., 2 * recency_pair] += 2.0
            v = seen @ torch.randn(content_dim, head_dim, generator=g) / math.sqrt(content_dim)
            v = v + 0.3 * torch.randn(total, tpf, head_dim, generator=g)
            k, q = k.reshape(-1, head_dim), q.reshape(-1, head_dim)  # (T, tpf, D) -> (T*tpf, D)
            if kind != "norope":
                k = rope(k[None, None], positions)[0, 0]
                q = rope(q[None, None], positions)[0, 0]
            if kind == "rotated":  # the stored basis turned: q k^T unchanged
                R = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=gk))[0]
                k, q = k @ R.T, q @ R.T
            if kind == "outliers":
                k[loud] *= gain[:, None]
            ks.append(k[:n_cached]), vs.append(v.reshape(-1, head_dim)[:n_cached])
            qs.append(q[n_cached:]), qh.append(q[tpf:n_cached])
        chunk_of = torch.arange(tpf, cached_frames * tpf) // (chunk_frames * tpf)  # the chunk of each history query
        writer.record(layer, torch.stack(qs), torch.stack(ks), torch.stack(vs), q_hist=torch.stack(qh),
                      q_hist_chunk=chunk_of)
    return writer
