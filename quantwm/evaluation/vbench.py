"""VBench's temporal-flickering score (Huang et al., "VBench", CVPR 2024), computed as VBench computes it.

Source: github.com/Vchitect/VBench, `vbench/temporal_flickering.py` (read at commit 45e79ec). VBench reads each
video with OpenCV (8-bit BGR frames as decoded), takes for every pair of consecutive frames the mean absolute
difference of the float32 pixel values over all pixels and channels (`cv2.absdiff`, then `np.mean`), averages
those over the video's pairs, and reports per video

    score = (255 - mean_t mean_pixels |x_{t+1} - x_t|) / 255          x in 8-bit levels 0..255

and for a set of videos the plain mean of the per-video scores. 1.0 is a video without change; higher is better.
VBench's leaderboard then rescales the dimension by fixed bounds, (score - 0.6293) / (1 - 0.6293)
(`scripts/constant.py`, `NORMALIZE_DIC`), before weighting it into its total; that rescale is not applied here.

Here the frames are the project's (T, H, W, 3) floats in [0, 1], brought to 8-bit values the way the project
writes its frames (`round(255 x)`, as `Record.frames_uint8`); uint8 frames are taken as they are. Channel order
does not change the mean. What is not reproduced: the video codec a decoded file went through (the score is of the
frames before any encoding). VBench meant the score for static videos (its `static_filter.py` drops moving ones with
RAFT optical flow first); on a moving camera every frame difference, motion included, lowers it.
"""
from __future__ import annotations

import torch

from ..core.quant import check_finite


def to_uint8(frames: torch.Tensor) -> torch.Tensor:
    """(T, H, W, 3) float in [0, 1] or uint8 -> uint8, 8-bit levels as the project writes frames; checked."""
    if not isinstance(frames, torch.Tensor):
        raise ValueError(f"frames must be a torch.Tensor, got {type(frames).__name__}")
    if frames.dim() != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be (T, H, W, 3), got shape {tuple(frames.shape)}")
    if frames.shape[0] < 2:
        raise ValueError(f"temporal flickering needs at least 2 frames, got {frames.shape[0]}")
    if frames.dtype == torch.uint8:
        return frames
    check_finite(frames, "frames")
    lo, hi = torch.stack(torch.aminmax(frames.float())).tolist()  # one host read per video
    if lo < 0 or hi > 1:
        raise ValueError(f"frames must lie in [0, 1], got range [{lo:.3g}, {hi:.3g}]")
    return (frames.float() * 255).round().to(torch.uint8)


PAIRS_AT_ONCE = 16  # frame pairs differenced at a time: 512 frames of 480x832 at once would take 1.2 GB as int16


def pair_mae(frames: torch.Tensor) -> torch.Tensor:
    """VBench's per-pair measure (T-1,) float64, in 8-bit levels: mean |x_{t+1} - x_t| over pixels and channels,
    PAIRS_AT_ONCE pairs at a time (a long run's differences never sit in memory whole)."""
    x = to_uint8(frames)
    # (T, H, W, 3) -> (T-1,): integer sums are exact; VBench's float32 mean differs by float32 rounding only
    blocks = (x[i:i + PAIRS_AT_ONCE + 1].to(torch.int16) for i in range(0, x.shape[0] - 1, PAIRS_AT_ONCE))
    total = torch.cat([(y[1:] - y[:-1]).abs().sum((1, 2, 3), dtype=torch.int64) for y in blocks])
    return total.double() / x[0].numel()


def temporal_flickering(frames: torch.Tensor) -> float:
    """VBench's temporal-flickering score of one video (T, H, W, 3): (255 - mean of `pair_mae`) / 255, in [0, 1]."""
    return (255.0 - pair_mae(frames).mean().item()) / 255.0
