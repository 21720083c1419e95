"""VBench's temporal-flickering score (quantwm/evaluation/vbench.py) and its place in `quantwm eval`'s report."""
import numpy as np
import pytest
import torch
from tiny_world import tiny_world_model

from quantwm.evaluation import vbench
from quantwm.world import evaluate as E


def vbench_literal(frames_uint8: np.ndarray) -> float:
    """VBench's steps as written in vbench/temporal_flickering.py, in numpy (absdiff of float32 frames as cv2 does)."""
    maes = [np.mean(np.abs(np.array(a, dtype=np.float32) - np.array(b, dtype=np.float32)))
            for a, b in zip(frames_uint8[:-1], frames_uint8[1:])]
    return (255.0 - np.mean(np.array(maes)).item()) / 255.0


def test_temporal_flickering_of_a_constant_video_is_one():
    assert vbench.temporal_flickering(torch.full((5, 8, 9, 3), 0.37)) == 1.0


def test_temporal_flickering_of_a_uniform_step_is_exact():
    # 8-bit levels 100 then 151: every pixel differs by 51 in the one pair -> (255 - 51) / 255 = 0.8
    frames = torch.stack([torch.full((6, 7, 3), 100 / 255), torch.full((6, 7, 3), 151 / 255)])
    assert vbench.temporal_flickering(frames) == pytest.approx(0.8, abs=1e-12)
    # three frames, pairs of 51 and 0 levels: mean 25.5 -> (255 - 25.5) / 255 = 0.9
    frames = torch.cat([frames, frames[1:]])
    assert vbench.temporal_flickering(frames) == pytest.approx(0.9, abs=1e-12)
    assert vbench.pair_mae(frames).tolist() == [51.0, 0.0]


def test_temporal_flickering_quantizes_to_8_bit_levels_first():
    # 0.4 of a level apart: both round to level 0, so no flicker is seen
    frames = torch.stack([torch.zeros(4, 4, 3), torch.full((4, 4, 3), 0.4 / 255)])
    assert vbench.temporal_flickering(frames) == 1.0
    assert vbench.temporal_flickering((frames * 255).round().to(torch.uint8)) == 1.0


def test_temporal_flickering_matches_vbench_steps_on_a_random_clip():
    g = torch.Generator().manual_seed(0)
    frames = torch.rand(9, 23, 31, 3, generator=g)
    frames[4] = frames[3]  # one still pair among the moving ones
    literal = vbench_literal((frames.numpy() * 255).round().astype(np.uint8))
    assert 0.5 < literal < 0.9
    assert vbench.temporal_flickering(frames) == pytest.approx(literal, abs=1e-6)  # VBench's float32 mean
    assert vbench.temporal_flickering((frames * 255).round().to(torch.uint8)) == pytest.approx(literal, abs=1e-6)


@pytest.mark.parametrize("frames, match", [
    (torch.zeros(1, 4, 4, 3), "at least 2 frames"),
    (torch.zeros(4, 4, 3), r"\(T, H, W, 3\)"),
    (torch.zeros(2, 3, 4, 4), r"\(T, H, W, 3\)"),
    (torch.full((2, 4, 4, 3), float("nan")), "NaN/Inf"),
    (torch.full((2, 4, 4, 3), float("inf")), "NaN/Inf"),
    (torch.full((2, 4, 4, 3), 1.5), r"\[0, 1\]"),
    (torch.full((2, 4, 4, 3), -0.1), r"\[0, 1\]"),
    (torch.zeros(2, 4, 4, 3, dtype=torch.int32), "floating-point"),
    (np.zeros((2, 4, 4, 3)), "torch.Tensor"),
])
def test_temporal_flickering_rejects_bad_frames(frames, match):
    with pytest.raises(ValueError, match=match):
        vbench.temporal_flickering(frames)


def test_eval_report_carries_vbench_flicker_of_each_run(monkeypatch):
    """The report's score, per seed and mean, for BF16 and each method, is the score of that run's own frames."""
    model = tiny_world_model()
    runs = []

    def recording_generate(*args, **kwargs):
        run = generate(*args, **kwargs)
        runs.append(run.frames[model.cfg.context_frames - 1:])
        return run

    generate = E.generate
    monkeypatch.setattr(E, "generate", recording_generate)
    r = E.evaluate(model, ["rtn", "quantwm"], seeds=[0, 1], n_frames=6, steps=1)
    # per seed: BF16 first, then the methods in order
    scores = [vbench.temporal_flickering(f) for f in runs]
    names = ["bf16", "rtn", "quantwm"]
    want = {n: scores[i::len(names)] for i, n in enumerate(names)}
    assert r["bf16"]["vbench_flicker_per_seed"] == want["bf16"]
    assert r["bf16"]["vbench_flicker"] == pytest.approx(sum(want["bf16"]) / 2)
    for m in ("rtn", "quantwm"):
        assert r["methods"][m]["vbench_flicker_per_seed"] == want[m]
        assert r["methods"][m]["mean"]["vbench_flicker"] == pytest.approx(sum(want[m]) / 2)
    assert all(0 < s < 1 for s in scores)
