"""Every metric of docs/method.md §4, computed against the BF16 reference with the same inputs.

Attention (one layer, same cache state, exact vs quantized keys/values): top-1 shift rate, top-k overlap,
KL(p_exact || p_quant), logit RMSE, attention mass on the current chunk, relative reconstruction errors
and the attention-output error they cause. Frames (T, H, W, 3) in [0, 1]: PSNR, SSIM (Gaussian σ=1.5,
11x11 window, per channel, constants of Wang et al. 2004 for data range 1), LPIPS-Alex
(quantwm.evaluation.lpips), tdiff-L1 with its per-pixel flicker map, tLP (TecoGAN's temporal LPIPS), and
the motion-compensated warping error (frames warped by the BF16 reference's OpenCV optical flow, so camera
motion is not flicker). Query energy: eigenvalues of S = E[q qᵀ] and the fraction of the trace held by
the top R.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..core.quant import check_finite


def rel_err(x_hat: torch.Tensor, x: torch.Tensor) -> float:
    """Relative MSE ||x̂ - x||² / ||x||² (0 when both are zero)."""
    if x_hat.shape != x.shape:
        raise ValueError(f"shapes differ: {tuple(x_hat.shape)} vs {tuple(x.shape)}")
    den = x.float().square().sum().item()
    num = (x_hat.float() - x.float()).square().sum().item()
    return num / den if den > 0 else (0.0 if num == 0 else float("inf"))


def probe_logits(q: torch.Tensor, k_exact: torch.Tensor, k_stored: torch.Tensor, scale: float = 1.0,
                 bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-1 probe, the one definition every recorder, analysis and view uses (docs/method.md §4): the
    logits of queries q (..., Nq, D) over the cached keys, exact (..., Nk, D) and as stored, in float32,
    scaled by `scale`; `bias` (..., Nq, Nk), the +jensen term, is added to the stored logits, since those are
    the logits the method attends with. Their argmax over the last axis is each query's top-1 source."""
    q = q.float() * scale
    exact = q @ k_exact.float().transpose(-1, -2)
    stored = q @ k_stored.float().transpose(-1, -2)
    return exact, stored if bias is None else stored + bias.float()


def attention_metrics(q: torch.Tensor, k: torch.Tensor, k_hat: torch.Tensor, scale: float,
                      bias: torch.Tensor | None = None, topk: int = 8, current: slice | None = None,
                      block: int = 1024) -> dict[str, torch.Tensor]:
    """Per-head attention fidelity of quantized keys: q (H, Nq, D), k/k_hat (H, Nk, D) -> {name: (H,)}.

    shift_rate: fraction of queries whose argmax over cached keys changes; topk_overlap: |top-k ∩|/k;
    attn_kl: mean KL(p_exact || p_quant) in nats; logit_rmse: RMS of the scaled logit error;
    current_mass: mean exact attention mass on the keys in `current` (a slice of the Nk axis), if given.
    `bias` (H, Nq, Nk) is added to the quantized logits (the +jensen correction).
    """
    if q.dim() != 3 or k.shape != k_hat.shape or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"expected q (H, Nq, D) and k, k_hat (H, Nk, D); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(k_hat.shape)}")
    if k.shape[1] == 0 or q.shape[1] == 0:
        raise ValueError("attention metrics need at least one query and one cached key")
    H, Nq, _ = q.shape
    kk = min(topk, k.shape[1])
    sums = {n: torch.zeros(H, dtype=torch.float64) for n in ("shift", "overlap", "kl", "sq", "mass")}
    for s in range(0, Nq, block):
        a, b = probe_logits(q[:, s:s + block], k, k_hat, scale, None if bias is None else bias[:, s:s + block])
        sums["shift"] += (a.argmax(-1) != b.argmax(-1)).double().sum(-1).cpu()
        ta, tb = a.topk(kk, -1).indices, b.topk(kk, -1).indices
        sums["overlap"] += ((ta[..., :, None] == tb[..., None, :]).any(-1).double().sum(-1) / kk).sum(-1).cpu()
        la, lb = a.log_softmax(-1), b.log_softmax(-1)
        sums["kl"] += (la.exp() * (la - lb)).sum(-1).double().sum(-1).cpu()
        sums["sq"] += (a - b).square().double().mean(-1).sum(-1).cpu()
        if current is not None:
            sums["mass"] += la.exp()[..., current].sum(-1).double().sum(-1).cpu()
    out = {"shift_rate": sums["shift"] / Nq, "topk_overlap": sums["overlap"] / Nq,
           "attn_kl": sums["kl"] / Nq, "logit_rmse": (sums["sq"] / Nq).sqrt()}
    if current is not None:
        out["current_mass"] = sums["mass"] / Nq
    return out


# ---- frames -------------------------------------------------------------------------------------

def as_frames(x, name: str = "frames") -> torch.Tensor:
    """(T, H, W, 3) uint8 or float in [0, 1] (tensor or numpy) -> float32 tensor (T, H, W, 3)."""
    t = torch.as_tensor(x)
    if t.dim() == 3:
        t = t[None]
    if t.dim() != 4 or t.shape[-1] != 3:
        raise ValueError(f"{name} must be (T, H, W, 3), got shape {tuple(t.shape)}")
    if t.dtype == torch.uint8:
        return t.float() / 255
    check_finite(t, name)
    t = t.float()
    if t.numel() and (t.min() < -1e-6 or t.max() > 1 + 1e-6):
        raise ValueError(f"{name} must lie in [0, 1], got range [{t.min().item():.3g}, {t.max().item():.3g}]")
    return t.clamp(0, 1)


def _pair(x, ref) -> tuple[torch.Tensor, torch.Tensor]:
    x, ref = as_frames(x, "frames"), as_frames(ref, "reference frames")
    if x.shape != ref.shape:
        raise ValueError(f"frames {tuple(x.shape)} and reference {tuple(ref.shape)} differ in shape")
    return x, ref


def psnr(x, ref, max_db: float = 100.0) -> torch.Tensor:
    """Per-frame PSNR in dB for data range 1: (T,); identical frames give `max_db`."""
    x, ref = _pair(x, ref)
    mse = (x - ref).square().mean((1, 2, 3))
    return torch.where(mse > 0, -10 * torch.log10(mse.clamp_min(1e-30)), torch.full_like(mse, max_db)).clamp(max=max_db)


def _gaussian_band(n: int, size: int = 11, sigma: float = 1.5) -> torch.Tensor:
    """(n - size + 1, n) float64: row i holds the 1-D Gaussian at columns i..i+size-1, so `band @ x` filters
    x's rows over the valid region. SSIM's 11x11 window is this filter along H and then along W."""
    g = torch.exp(-((torch.arange(size) - size // 2).double() ** 2) / (2 * sigma ** 2))
    g = g / g.sum()
    band = torch.zeros(n - size + 1, n, dtype=torch.float64)
    for i in range(size):
        band.diagonal(i)[:] = g[i]
    return band


def ssim(x, ref, frames_per_pass: int = 8) -> torch.Tensor:
    """Per-frame SSIM (T,): Gaussian σ=1.5 11x11 window, valid region, mean over channels and pixels.
    `frames_per_pass` bounds the float64 working memory (15 planes per frame), not the result."""
    x, ref = _pair(x, ref)
    if min(x.shape[1:3]) < 11:
        raise ValueError(f"SSIM needs frames of at least 11x11 pixels, got {tuple(x.shape[1:3])}")
    rows, cols = _gaussian_band(x.shape[1]), _gaussian_band(x.shape[2]).T
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    out = []
    for t in range(0, x.shape[0], frames_per_pass):
        # float64: var = E[x²] - μ² cancels. The five local means in one pass, the separable window as two
        # matrix products (float64 BLAS, fast where a float64 convolution is not): (t, 5·3, H, W) -> (t, 5·3, H-10, W-10)
        a, b = (v[t:t + frames_per_pass].permute(0, 3, 1, 2).double() for v in (x, ref))
        mu_a, mu_b, aa, bb, ab = (rows @ torch.cat([a, b, a * a, b * b, a * b], dim=1) @ cols).chunk(5, dim=1)
        var_a, var_b, cov = aa - mu_a ** 2, bb - mu_b ** 2, ab - mu_a * mu_b
        s = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a ** 2 + mu_b ** 2 + c1) * (var_a + var_b + c2))
        out.append(s.mean((1, 2, 3)).float())
    return torch.cat(out)


def lpips_unavailable() -> str | None:
    """None when LPIPS can be computed, else one line saying why and how to install its weights."""
    from .lpips import weights_path

    try:
        weights_path()
    except (ModuleNotFoundError, FileNotFoundError) as e:
        return f"LPIPS not computed: {str(e).splitlines()[0]}"
    return None


def lpips(x, ref, batch: int = 16) -> torch.Tensor:
    """Per-frame LPIPS-Alex (T,) with the real weights (see quantwm.evaluation.lpips)."""
    from .lpips import lpips_alex

    x, ref = _pair(x, ref)
    net = lpips_alex()
    with torch.no_grad():
        return torch.cat([net(x[i:i + batch].permute(0, 3, 1, 2), ref[i:i + batch].permute(0, 3, 1, 2))
                          for i in range(0, x.shape[0], batch)])


def flicker_map(x, ref) -> torch.Tensor:
    """Per-pixel flicker (T-1, H, W): |(x_t - x_{t-1}) - (r_t - r_{t-1})| averaged over channels."""
    x, ref = _pair(x, ref)
    if x.shape[0] < 2:
        raise ValueError("flicker needs at least 2 frames")
    return ((x[1:] - x[:-1]) - (ref[1:] - ref[:-1])).abs().mean(-1)


def tdiff(x, ref) -> torch.Tensor:
    """Per-frame tdiff-L1 (T-1,) for frames 1..T-1: the mean of the flicker map."""
    return flicker_map(x, ref).mean((1, 2))


def tlp(x, ref) -> torch.Tensor:
    """Per-frame tLP (T-1,): |LPIPS(x_t, x_{t-1}) - LPIPS(r_t, r_{t-1})| (TecoGAN)."""
    x, ref = _pair(x, ref)
    if x.shape[0] < 2:
        raise ValueError("tLP needs at least 2 frames")
    return (lpips(x[1:], x[:-1]) - lpips(ref[1:], ref[:-1])).abs()


def reference_flow(ref) -> torch.Tensor:
    """Backward dense optical flow of the reference (T-1, H, W, 2): frame t's pixel (x, y) came from
    (x + fx, y + fy) of frame t-1 (OpenCV's Farnebäck on grey levels of r_t against r_{t-1})."""
    import cv2

    ref = as_frames(ref, "reference frames")
    if ref.shape[0] < 2:
        raise ValueError("optical flow needs at least 2 frames")
    grey = (ref.numpy() @ np.array([0.299, 0.587, 0.114], np.float32) * 255).round().astype(np.uint8)
    flows = [cv2.calcOpticalFlowFarneback(grey[t], grey[t - 1], None, pyr_scale=0.5, levels=3, winsize=15,
                                          iterations=5, poly_n=5, poly_sigma=1.2, flags=0)
             for t in range(1, len(grey))]
    return torch.from_numpy(np.stack(flows))


def _warp_residual(frames: torch.Tensor, flow: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """|x_t - W(x_{t-1})| averaged over channels (T-1, H, W) and the mask of pixels whose source lies
    inside frame t-1 (occluded borders excluded); W warps frame t-1 onto t with `flow`."""
    import cv2

    T, H, W, _ = frames.shape
    yy, xx = np.mgrid[0:H, 0:W].astype(np.float32)
    x = frames.numpy()
    res, masks = [], []
    for t in range(1, T):
        mx, my = xx + flow[t - 1, ..., 0].numpy(), yy + flow[t - 1, ..., 1].numpy()
        warped = cv2.remap(x[t - 1], mx, my, interpolation=cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)
        res.append(np.abs(x[t] - warped).mean(-1))
        masks.append((mx >= 0) & (mx <= W - 1) & (my >= 0) & (my <= H - 1))
    return torch.from_numpy(np.stack(res)), torch.from_numpy(np.stack(masks))


def _warp_terms(x, ref, flow: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(max(0, |x_t - W(x_{t-1})| - |r_t - W(r_{t-1})|), mask of pixels whose flow stays inside the frame)."""
    x, ref = _pair(x, ref)
    if x.shape[0] < 2:
        raise ValueError("the warping error needs at least 2 frames")
    flow = reference_flow(ref) if flow is None else flow
    if tuple(flow.shape) != (x.shape[0] - 1, *x.shape[1:3], 2):
        raise ValueError(f"flow must be (T-1, H, W, 2) = {(x.shape[0] - 1, *x.shape[1:3], 2)}, got {tuple(flow.shape)}")
    ex, mask = _warp_residual(x, flow)
    er, _ = _warp_residual(ref, flow)
    return torch.where(mask, (ex - er).clamp_min(0), torch.zeros_like(ex)), mask  # BF16's own residual: the floor


def warp_error_map(x, ref, flow: torch.Tensor | None = None) -> torch.Tensor:
    """Per-pixel motion-compensated flicker (T-1, H, W): max(0, |x_t - W(x_{t-1})| - |r_t - W(r_{t-1})|), with
    W the warp by the reference's optical flow (`reference_flow`, or `flow` when given); 0 where the flow leaves
    the frame. Lower is better and BF16 is the floor (0): only what the method's frame changes beyond the
    reference's own residual counts, so a smoothed (degraded) run, whose residual falls below BF16's, scores 0
    there, never below (docs/method.md §4)."""
    return _warp_terms(x, ref, flow)[0]


def warp_error(x, ref, flow: torch.Tensor | None = None) -> torch.Tensor:
    """Per-frame motion-compensated warping error (T-1,) for frames 1..T-1: the mean of `warp_error_map`
    over the pixels the flow keeps inside the frame (docs/method.md §4)."""
    diff, mask = _warp_terms(x, ref, flow)
    return diff.sum((1, 2)) / mask.sum((1, 2)).clamp_min(1)


# ---- query energy -------------------------------------------------------------------------------

def query_energy(stats: torch.Tensor, rank: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues of S (..., D, D), descending, and the fraction of the trace in the top `rank`."""
    if stats.dim() < 2 or stats.shape[-1] != stats.shape[-2]:
        raise ValueError(f"stats must be (..., D, D), got {tuple(stats.shape)}")
    check_finite(stats, "query statistics")
    ev = torch.linalg.eigvalsh(stats.double()).flip(-1).clamp_min(0)
    total = ev.sum(-1)
    frac = torch.where(total > 0, ev[..., :rank].sum(-1) / total.clamp_min(1e-300), torch.full_like(total, math.nan))
    return ev.float(), frac.float()


def second_moment(q: torch.Tensor) -> torch.Tensor:
    """S = E[q qᵀ] per head: q (H, N, D) -> (H, D, D)."""
    if q.dim() != 3 or q.shape[1] == 0:
        raise ValueError(f"queries must be a non-empty (H, N, D) tensor, got {tuple(q.shape)}")
    qd = q.double()
    return (qd.transpose(1, 2) @ qd / q.shape[1]).float()
