"""Where the bits go: quantwm's distance above the Gaussian rate-distortion bound, Keys only, decomposed (issue 44).

For each trace layer the Keys are committed into a quantwm cache at a Key budget (2.5 bits per element by default)
as `quantwm analyze` commits them (`layer_cache`), and every quantized span of every head (a stream) is metered
by quantwm.evaluation.rate_distortion with two S: the history queries the coder could know at that span's commit
(q_hist of the chunks written so far) and the queries that read the span (the trace's q). Under each S the
distance above the bound, B − R(D)/D, is then walked to zero by swapping in one ideal part at a time; each step
is metered the same way, so the steps' differences add up to the total:

  0 quantwm          the stored span, every stored byte counted
  1 side free        minus its side information: the basis, the per-coordinate tables and centroids, the loud
                     tokens' BF16, the code buffer's unused bytes (the code bits alone remain: B₁)
  2 textbook         a transform coder in quantwm's stored basis (identity where it kept the channels): the
                     span's mean free, λ_i = u_iᵀ S u_i, integer widths by quantwm's allocator (allocate.py) over
                     uniform grids with its clip search, B₁ bits. 1→2 is what quantwm does apart from the
                     textbook: centroids, re-aimed S, loud tokens kept exact, and what it cannot know (S)
  3 exact basis      the meter's own transform: the eigenvectors of W = S^½ C S^½, coordinates z = Vᵀ S^½ k
  4 Lloyd-Max        each coordinate's grid the Lloyd-Max quantizer of its empirical distribution at its width
  5 Gaussian source  the keys replaced by a Gaussian with exactly the span's covariance (the same σ²)
  6 D(R) per coord   each coordinate at the Gaussian D(R) = σ² 2^(-2b) of its integer width b: what block codes
                     (lattices, trellises) approach and no scalar grid reaches
  7 fractional       reverse water-filling's fractional rates: the bound itself (0 by construction)

Known limits: the order matters (a part's share is measured with the ones before it swapped in); empirical
Lloyd-Max at 6-8 bits on a span of ~1700 tokens is optimistic (its levels are not counted); the Gaussian D(R)
assumes independent coordinates, exact for the Gaussian source in W's eigenbasis.

Sources that differ from the tuned ones: other query ranks (`--query-dims`, at most 24 in the synthetic world),
a flatter query spectrum (isotropic noise added to every query: `qnoise`), and the keys' spectrum re-shaped per
head (their covariance eigenvalues raised to a power: `kpow`). Scaling the queries (sharper or flatter attention)
leaves the meter unchanged (S → c²S scales D and every σ² alike) and quantwm's choices too, so it is not a
source here.

    python benchmarks/bits_above_bound.py --kinds aligned flat rotated norope outliers --seeds 11 12 \\
        --variants qdims=4 qdims=24 qnoise=1 kpow=0.5 kpow=2 --out bits_above_bound.json
    python benchmarks/bits_above_bound.py --method quantwm-trellis --kinds aligned flat rotated norope outliers \\
        --seeds 11 12 --out trellis_bits_above_bound.json
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from quantwm.core.allocate import CLIPS, allocate, channel_errors_ref
from quantwm.core.cache import CacheConfig
from quantwm.core.layouts.channels import channel_bytes, channel_grid
from quantwm.core.lloyd_max import LLOYD_MAX_BITS, lloyd_max
from quantwm.core.query_basis import coordinate_weights
from quantwm.evaluation.analyze import key_bits_per_element, layer_cache
from quantwm.evaluation.metrics import second_moment
from quantwm.evaluation.rate_distortion import distortion_at, rate_at, weighted_spectrum
from quantwm.evaluation.synthetic import make_synthetic_trace
from quantwm.evaluation.trace import Trace, read_trace

WIDTHS = tuple(range(9))  # the integer widths every textbook step may give a coordinate (quantwm's LEVELS)
LLOYD_ITERS = 15
STEPS = ("quantwm", "side free", "textbook", "exact basis", "Lloyd-Max", "Gaussian source", "D(R) per coord",
         "fractional")
PARTS = ("side information", "quantwm vs textbook", "basis", "grid shape", "source", "scalar vs block code",
         "integer widths")  # PARTS[i] = STEPS[i] − STEPS[i + 1]
SIDE = ("basis", "tables", "loud", "slack")


# ---- what quantwm stored ----------------------------------------------------------------------------------------
def coded_of(layout) -> tuple[torch.Tensor | None, object]:
    """(U (S, D, D) the orthogonal basis a span's coordinates were coded in, None for the model's channels; the
    layout of the coded tokens): a TokenSplit codes its other tokens in `rest`."""
    return getattr(layout, "rest", layout).coded()


# ---- textbook coders on coordinates (S, N, D) ------------------------------------------------------------------
def uniform_tables(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E (S, D, L) squared error of every coordinate at every width on uniform grids with quantwm's clip search,
    alpha (S, D, L) the clip) on every token (allocate.channel_errors_ref, unsampled)."""
    qmax = torch.tensor([2.0 ** b - 1 for b in WIDTHS])
    E, A = channel_errors_ref(y.float(), y.float().amin(1), y.float().amax(1), qmax, torch.tensor(CLIPS), 1.0)
    return E.permute(1, 2, 0).double(), A.permute(1, 2, 0)


def uniform_decode(y: torch.Tensor, widths: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """y (S, N, D) through its uniform grids of `widths` (S, D) and clips `alpha` (S, D); 0 at width 0."""
    low, step = channel_grid(y.amin(1), y.amax(1), widths.float(), alpha)
    top = (2.0 ** widths.float() - 1)[:, None]
    codes = torch.round((y - low[:, None]) / step[:, None]).clamp(min=0).minimum(top)
    return torch.where(widths[:, None] > 0, low[:, None] + codes * step[:, None], 0.0)


def lloyd_tables(z: torch.Tensor) -> torch.Tensor:
    """E (S, D, L): each coordinate's squared error under a Lloyd-Max quantizer of its own samples at every width:
    Lloyd's iteration (which never raises the error) from the best uniform grid with quantwm's clips and, up to 4
    bits, from the Gaussian Lloyd-Max levels of quantwm.core.lloyd_max scaled to the coordinate; the lower kept.
    So each entry is at most the uniform grid's."""
    S, N, D = z.shape
    x = z.double().permute(0, 2, 1).reshape(S * D, N).sort(-1).values.contiguous()  # (M, N) sorted rows
    mean, std = x.mean(-1, keepdim=True), x.std(-1, keepdim=True).clamp_min(1e-30)
    _, A = uniform_tables(z)
    alpha = A.reshape(S * D, -1).float()
    out = [x.square().sum(-1)]
    for b in WIDTHS[1:]:
        L = 2 ** b
        low, step = channel_grid(x[:, 0].float(), x[:, -1].float(), torch.tensor(float(b)), alpha[:, b])
        starts = [low.double()[:, None] + step.double()[:, None] * torch.arange(L, dtype=torch.float64)]
        if b in LLOYD_MAX_BITS:
            starts.append(lloyd_max(b).levels.double()[None] * std + mean)
        out.append(torch.stack([lloyd_error(x, levels) for levels in starts]).amin(0))
    return torch.stack(out, -1).reshape(S, D, len(WIDTHS))


def lloyd_error(x: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Σ (x − Q(x))² per row of x (M, N) sorted, after LLOYD_ITERS steps of Lloyd's iteration from `levels` (M, L)."""
    for step in range(LLOYD_ITERS + 1):
        cell = torch.searchsorted(((levels[:, 1:] + levels[:, :-1]) / 2).contiguous(), x)
        if step == LLOYD_ITERS:
            return (x - levels.gather(1, cell)).square().sum(-1)
        total = torch.zeros_like(levels).scatter_add_(1, cell, x)
        count = torch.zeros_like(levels).scatter_add_(1, cell, torch.ones_like(x))
        levels = torch.where(count > 0, total / count.clamp_min(1), levels).sort(-1).values


def allocated(weighted: torch.Tensor, n_tokens: int, bits: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(widths (S, D), total weighted error (S,)) of quantwm's allocator over error tables (S, D, L), every width
    costing exactly N·b bits, within `bits` per element per stream."""
    S, D, L = weighted.shape
    cost = torch.tensor([float(n_tokens * b) for b in WIDTHS], dtype=torch.float64)
    levels = allocate(weighted, cost, torch.full((S,), bits * n_tokens * D, dtype=torch.float64))
    return levels, weighted.gather(2, levels[..., None])[..., 0].sum(-1)


def weighted_transform(keys: torch.Tensor, S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(z (S, N, D) = (k − k̄) S^½ V, σ² (S, D)): the span's keys in the meter's coordinates, V the eigenvectors of
    W = S^½ C S^½ (the meter's weighted_spectrum, with its vectors), so that eᵀ S e = |ε_z|²."""
    c = keys.double() - keys.double().mean(1, keepdim=True)
    lam, vec = torch.linalg.eigh(S.double())
    half = vec @ torch.diag_embed(lam.clamp_min(0).sqrt()) @ vec.transpose(1, 2)
    w = half @ (c.transpose(1, 2) @ c / c.shape[1]) @ half
    sigma2, V = torch.linalg.eigh((w + w.transpose(1, 2)) / 2)
    return c @ half @ V, sigma2.clamp_min(0)


def gaussian_like(sigma2: torch.Tensor, n_tokens: int, seed: int) -> torch.Tensor:
    """(S, N, D) Gaussian samples with exactly the sample covariance diag(σ²) about a zero mean."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sigma2.shape[0], n_tokens, sigma2.shape[1], generator=g, dtype=torch.float64)
    x = x - x.mean(1, keepdim=True)
    lam, vec = torch.linalg.eigh(x.transpose(1, 2) @ x / n_tokens)
    x = x @ vec @ torch.diag_embed(lam.rsqrt()) @ vec.transpose(1, 2)  # sample covariance exactly I
    return x * sigma2.sqrt()[:, None]


# ---- the decomposition --------------------------------------------------------------------------------------
def above(bits: float, sigma2: torch.Tensor, distortion: torch.Tensor, head_dim: int) -> torch.Tensor:
    """B − R(D)/D per stream (the meter's bits above the bound)."""
    return bits - rate_at(sigma2, distortion) / head_dim


def span_steps(keys: torch.Tensor, decoded: torch.Tensor, U: torch.Tensor | None, S: torch.Tensor, b0: float,
               b1: float, seed: int) -> torch.Tensor:
    """Bits above the bound (len(STEPS), streams) of one span: keys and quantwm's decoded keys (S, N, D), its basis
    U (or None), the meter's S (S, D, D), quantwm's stored bits b0 and its code bits b1 per element."""
    H, N, D = keys.shape
    z, _ = weighted_transform(keys, S)
    sigma2 = weighted_spectrum(keys, S)  # the meter's own σ² (the same eigenvalues, rounding-level ones zeroed)
    e = decoded.double() - keys.double()
    d0 = torch.einsum("sni,sij,snj->s", e, S.double(), e) / N
    steps = [above(b0, sigma2, d0, D), above(b1, sigma2, d0, D)]
    # 2: the textbook coder in quantwm's basis, decoded and metered exactly (cross terms included)
    U = torch.eye(D, dtype=torch.float64).expand(H, D, D) if U is None else U.double()
    c = keys.double() - keys.double().mean(1, keepdim=True)
    y = (c @ U).float()
    lam = coordinate_weights(U, S).double()
    E, A = uniform_tables(y)
    widths, _ = allocated(lam[..., None] * E, N, b1)
    alpha = A.gather(2, widths[..., None])[..., 0]
    e2 = uniform_decode(y, widths, alpha).double() @ U.transpose(1, 2) - c
    steps.append(above(b1, sigma2, torch.einsum("sni,sij,snj->s", e2, S.double(), e2) / N, D))
    # 3-4: the meter's coordinates, uniform grids then Lloyd-Max
    steps.append(above(b1, sigma2, allocated(uniform_tables(z)[0], N, b1)[1] / N, D))
    steps.append(above(b1, sigma2, allocated(lloyd_tables(z), N, b1)[1] / N, D))
    # 5: a Gaussian source of the same covariance, Lloyd-Max
    steps.append(above(b1, sigma2, allocated(lloyd_tables(gaussian_like(sigma2, N, seed)), N, b1)[1] / N, D))
    # 6: the Gaussian D(R) of each coordinate at integer widths; 7: at reverse water-filling's fractional rates
    rd = N * sigma2[..., None] * torch.tensor([2.0 ** (-2 * b) for b in WIDTHS], dtype=torch.float64)
    steps.append(above(b1, sigma2, allocated(rd, N, b1)[1] / N, D))
    steps.append(above(b1, sigma2, distortion_at(sigma2, b1 * D), D))
    keep = sigma2.sum(-1) > 0
    return torch.stack(steps)[:, keep]


def decompose_layer(trace: Trace, layer: int, budget: float = 2.5, seed: int = 0, method: str = "quantwm") -> dict:
    """The decomposition of one traced layer (module docstring): {"bits", "side", "history", "reading"}, each meter
    {"steps": {step: mean bits above}, "parts": {part: the drop it closes}, "streams"}."""
    t = trace.layers[layer]
    chunk_tokens = int(trace.meta.get("chunk_frames", 1)) * trace.tokens_per_frame
    config = CacheConfig(method=method, target="k", k_bits=2, v_bits=2, budget_k=budget)
    cache, rope = layer_cache(trace, layer, config, chunk_tokens)
    if rope is not None:
        raise ValueError("pre-RoPE traces are not supported here")
    k = t["k"].float()[:, cache.positions(0)]  # (H, L, D) in cache order
    k_hat = cache.keys(0)[0]
    hist, chunk_of = t.get("q_hist"), t.get("q_hist_chunk")
    if hist is None or chunk_of is None:
        raise ValueError("the history meter needs q_hist and q_hist_chunk in the trace")
    S_read = second_moment(t["q"].float())
    H, _, D = k.shape
    spans, side, seen, elems, start, codes = [], dict.fromkeys(SIDE, 0.0), set(), 0, 0, 0.0
    for chunk in cache.inspect(0):  # the stored layouts: the decomposition reads each span's basis and widths
        n, layout = chunk.n_tokens, chunk.k_enc
        if layout is not None and layout.quantized:
            shared, roles = layout.shared(), layout.roles()
            for name, tensor in {**layout.components(), **shared}.items():
                if name in shared and tensor.data_ptr() in seen:
                    continue  # a shared basis is counted once, where stored
                seen.add(tensor.data_ptr())
                role, size = roles[name], 8.0 * tensor.numel() * tensor.element_size()
                if role == "payload":  # the code buffer: the widths' bits, the rest of it slack
                    m = coded_of(layout)[1].shape[1]  # the coded tokens (the loud ones apart)
                    used = sum(8.0 * channel_bytes(m, b) for b in layout.channel_bits().flatten().tolist())
                    codes, side["slack"] = codes + used, side["slack"] + size - used
                else:
                    side[role] += size
            spans.append((slice(start, start + n), chunk.index, coded_of(layout)[0]))
            elems += H * n * D
        start += n
    per = {name: bits / elems for name, bits in side.items()}
    b1 = codes / elems
    b0 = b1 + sum(per.values())
    out = {"bits": b0, "bits_cache": key_bits_per_element(cache), "code_bits": b1, "side": per, "spans": len(spans)}
    for meter in ("history", "reading"):
        rows = []
        for where, index, U in spans:
            S = S_read if meter == "reading" else second_moment(hist[:, chunk_of <= index].float())
            rows.append(span_steps(k[:, where], k_hat[:, where], U, S, b0, b1, seed + index))
        steps = torch.cat(rows, 1).mean(1).tolist()
        out[meter] = {"steps": dict(zip(STEPS, steps)),
                      "parts": {p: steps[i] - steps[i + 1] for i, p in enumerate(PARTS)},
                      "streams": int(torch.cat(rows, 1).shape[1])}
    return out


# ---- sources ----------------------------------------------------------------------------------------------------
def make_trace(kind: str, seed: int, workdir: Path, query_dims: int = 16, heads: int = 4, head_dim: int = 128,
               grid: tuple[int, int] = (24, 24), cached_frames: int = 12, chunk_frames: int = 3) -> Trace:
    """A one-layer synthetic trace (quantwm.evaluation.synthetic), written to `workdir` and read back."""
    path = workdir / f"{kind}-{seed}-q{query_dims}.pt"
    make_synthetic_trace(seed=seed, n_layers=1, n_heads=heads, head_dim=head_dim, grid=grid,
                         cached_frames=cached_frames, chunk_frames=chunk_frames, content_dim=query_dims,
                         kind=kind).save(path)
    return read_trace(path)


def add_query_noise(trace: Trace, share: float, seed: int) -> Trace:
    """Every query (q and q_hist) plus isotropic noise holding `share` times the queries' mean energy per head:
    a flatter S spectrum."""
    g = torch.Generator().manual_seed(seed)
    for t in trace.layers.values():
        energy = t["q_hist"].float().square().sum(-1).mean(-1)  # (H,)
        sd = (share * energy / t["q"].shape[-1]).sqrt()[:, None, None]
        for name in ("q", "q_hist"):
            t[name] = (t[name].float() + sd * torch.randn(t[name].shape, generator=g)).to(t[name].dtype)
    return trace


def reshape_key_spectrum(trace: Trace, power: float) -> Trace:
    """Each head's keys with their covariance eigenvalues raised to `power` (about their mean, trace kept):
    power < 1 flattens the spectrum, > 1 steepens it."""
    for t in trace.layers.values():
        k = t["k"].double()
        mean = k.mean(1, keepdim=True)
        c = k - mean
        lam, vec = torch.linalg.eigh(c.transpose(1, 2) @ c / c.shape[1])
        lam = lam.clamp_min(1e-12)
        new = lam ** power
        new = new * lam.sum(-1, keepdim=True) / new.sum(-1, keepdim=True)
        gain = vec @ torch.diag_embed((new / lam).sqrt()) @ vec.transpose(1, 2)
        t["k"] = (mean + c @ gain).to(t["k"].dtype)
    return trace


def source(kind: str, seed: int, variant: str, workdir: Path) -> Trace:
    """The trace of a (kind, seed) under a variant: '' (as generated), 'qdims=R', 'qnoise=X' or 'kpow=P'."""
    name, _, value = variant.partition("=")
    if name == "qdims":
        return make_trace(kind, seed, workdir, query_dims=int(value))
    trace = make_trace(kind, seed, workdir)
    if name == "qnoise":
        return add_query_noise(trace, float(value), seed)
    if name == "kpow":
        return reshape_key_spectrum(trace, float(value))
    if name:
        raise ValueError(f"unknown variant {variant!r}: qdims=R, qnoise=X or kpow=P")
    return trace


# ---- report -----------------------------------------------------------------------------------------------------
def table(rows: list[dict]) -> str:
    """A markdown table: per source, bits, the totals by both meters and the history meter's parts."""
    head = ["source", "seed", "bits", "above (hist S)", "above (read S)", *PARTS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        h = r["history"]
        cells = [r["source"], str(r["seed"]), f"{r['bits']:.3f}", f"{h['steps']['quantwm']:.3f}",
                 f"{r['reading']['steps']['quantwm']:.3f}", *(f"{h['parts'][p]:+.3f}" for p in PARTS)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", help="a trace file (else synthetic traces of --kinds x --seeds)")
    ap.add_argument("--kinds", nargs="+", default=["aligned"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[11, 12])
    ap.add_argument("--variants", nargs="*", default=[], help="qdims=R, qnoise=X, kpow=P (on the first kind)")
    ap.add_argument("--budget", type=float, default=2.5)
    ap.add_argument("--method", default="quantwm", help="the method decomposed (quantwm, or quantwm-trellis)")
    ap.add_argument("--out", help="JSON path")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        jobs = ([("file", 0, "")] if args.trace else
                [(k, s, "") for k in args.kinds for s in args.seeds] +
                [(args.kinds[0], s, v) for v in args.variants for s in args.seeds])
        for kind, seed, variant in jobs:
            trace = read_trace(args.trace) if args.trace else source(kind, seed, variant, Path(tmp))
            for layer in trace.layers:
                row = decompose_layer(trace, layer, args.budget, seed=seed, method=args.method)
                row.update(source=args.trace or (f"{kind} {variant}".strip()), seed=seed, layer=layer)
                rows.append(row)
                print(f"{row['source']} seed {seed} layer {layer}: {row['bits']:.3f} bits, "
                      f"{row['history']['steps']['quantwm']:.3f} / {row['reading']['steps']['quantwm']:.3f} above",
                      flush=True)
                if args.out:  # rewritten after every row: a long run leaves what it has
                    Path(args.out).write_text(json.dumps({"budget": args.budget, "method": args.method, "steps": STEPS, "parts": PARTS,
                                                          "rows": rows}, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
