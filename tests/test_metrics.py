import math

import pytest
import torch
import torch.nn.functional as F

from quantwm.evaluation import metrics as M


def test_attention_metrics_constant_logit_shift_changes_nothing_but_rmse():
    torch.manual_seed(0)
    H, Nq, Nk, D = 2, 5, 7, 8
    q = torch.zeros(H, Nq, D)
    q[..., 0] = 1.0
    q[..., 1:] = torch.randn(H, Nq, D - 1)
    k = torch.randn(H, Nk, D)
    k_hat = k.clone()
    k_hat[..., 0] += 0.5  # every logit moves by scale * 0.5: softmax and argmax unchanged
    m = M.attention_metrics(q, k, k_hat, scale=0.25)
    assert torch.allclose(m["shift_rate"], torch.zeros(H, dtype=torch.float64))
    assert torch.allclose(m["topk_overlap"], torch.ones(H, dtype=torch.float64))
    assert m["attn_kl"].abs().max() < 1e-6
    assert torch.allclose(m["logit_rmse"], torch.full((H,), 0.125, dtype=torch.float64), atol=1e-6)


def test_attention_metrics_shift_rate_counts_swapped_top1():
    D = 4
    k = torch.eye(D)[None]  # 4 keys, one per axis
    q = torch.eye(D)[None] * 5  # query i selects key i
    k_hat = k.clone()
    k_hat[0, [0, 1]] = k[0, [1, 0]]  # swap keys 0 and 1: queries 0 and 1 now pick the other
    m = M.attention_metrics(q, k, k_hat, scale=1.0, topk=1, current=slice(2, 4))
    assert m["shift_rate"].item() == pytest.approx(0.5)
    assert m["topk_overlap"].item() == pytest.approx(0.5)
    assert m["attn_kl"].item() > 0.5
    p = torch.softmax(q[0] @ k[0].T, -1)[:, 2:].sum(-1).mean()
    assert m["current_mass"].item() == pytest.approx(p.item(), rel=1e-5)


def test_attention_metrics_bias_enters_the_quantized_logits():
    q = torch.ones(1, 1, 2)
    k = torch.tensor([[[1.0, 0.0], [0.0, 0.9]]])
    bias = torch.tensor([[[-1.0, 0.0]]])
    assert M.attention_metrics(q, k, k, 1.0, bias=bias)["shift_rate"].item() == 1.0


def test_attention_metrics_rejects_bad_shapes_and_empty_cache():
    with pytest.raises(ValueError, match="expected q"):
        M.attention_metrics(torch.zeros(2, 3, 4), torch.zeros(2, 5, 4), torch.zeros(2, 6, 4), 1.0)
    with pytest.raises(ValueError, match="at least one"):
        M.attention_metrics(torch.zeros(2, 3, 4), torch.zeros(2, 0, 4), torch.zeros(2, 0, 4), 1.0)


def test_rel_err_known_value_and_shape_check():
    x = torch.tensor([3.0, 4.0])
    assert M.rel_err(x + torch.tensor([0.0, 1.0]), x) == pytest.approx(1 / 25)
    assert M.rel_err(torch.zeros(2), torch.zeros(2)) == 0.0
    with pytest.raises(ValueError, match="shapes differ"):
        M.rel_err(torch.zeros(2), torch.zeros(3))


def test_psnr_of_constant_offset_is_20db():
    ref = torch.full((3, 16, 16, 3), 0.5)
    assert torch.allclose(M.psnr(ref + 0.1, ref), torch.full((3,), 20.0), atol=1e-4)
    assert M.psnr(ref, ref)[0].item() == 100.0


def test_psnr_accepts_uint8_and_checks_range_and_finiteness():
    a = torch.zeros(1, 8, 8, 3, dtype=torch.uint8)
    b = torch.full((1, 8, 8, 3), 255, dtype=torch.uint8)
    assert M.psnr(a, b)[0].item() == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        M.psnr(torch.full((1, 8, 8, 3), 2.0), torch.zeros(1, 8, 8, 3))
    with pytest.raises(ValueError, match="NaN"):
        M.psnr(torch.full((1, 8, 8, 3), float("nan")), torch.zeros(1, 8, 8, 3))
    with pytest.raises(ValueError, match="differ in shape"):
        M.psnr(torch.zeros(1, 8, 8, 3), torch.zeros(2, 8, 8, 3))
    with pytest.raises(ValueError, match=r"\(T, H, W, 3\)"):
        M.psnr(torch.zeros(1, 8, 8), torch.zeros(1, 8, 8))


def test_ssim_identity_and_constant_images_match_the_formula():
    x = torch.rand(2, 24, 24, 3, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(M.ssim(x, x), torch.ones(2), atol=1e-5)
    a, b = torch.full((1, 16, 16, 3), 0.5), torch.full((1, 16, 16, 3), 0.6)
    c1 = 0.01 ** 2
    expect = (2 * 0.5 * 0.6 + c1) / (0.5 ** 2 + 0.6 ** 2 + c1)
    assert M.ssim(a, b)[0].item() == pytest.approx(expect, rel=1e-4)
    noisy = (x + 0.2 * torch.randn(x.shape, generator=torch.Generator().manual_seed(1))).clamp(0, 1)
    assert M.ssim(noisy, x).max() < 0.9
    with pytest.raises(ValueError, match="11x11"):
        M.ssim(torch.zeros(1, 8, 8, 3), torch.zeros(1, 8, 8, 3))


def test_flicker_map_and_tdiff_on_known_flicker():
    ref = torch.full((4, 8, 8, 3), 0.5)
    x = ref.clone()
    x[1, 2, 3] += 0.2  # one pixel brightens in frame 1 only
    fmap = M.flicker_map(x, ref)
    assert fmap.shape == (3, 8, 8)
    assert fmap[0, 2, 3].item() == pytest.approx(0.2, abs=1e-6)
    assert fmap[1, 2, 3].item() == pytest.approx(0.2, abs=1e-6)
    assert fmap[2].abs().max().item() == 0.0
    assert M.tdiff(x, ref)[0].item() == pytest.approx(0.2 / 64, rel=1e-5)
    static_offset = ref + 0.1  # constant error is not flicker
    assert M.tdiff(static_offset, ref).abs().max().item() < 1e-6
    with pytest.raises(ValueError, match="2 frames"):
        M.tdiff(ref[:1], ref[:1])


def test_lpips_and_tlp_zero_for_identical_and_positive_for_flicker():
    g = torch.Generator().manual_seed(0)
    ref = torch.rand(1, 32, 32, 3, generator=g).repeat(3, 1, 1, 1)  # a static scene
    assert M.lpips(ref, ref).abs().max().item() < 1e-6
    assert M.tlp(ref, ref).abs().max().item() < 1e-6
    x = ref.clone()
    x[1] = torch.rand(32, 32, 3, generator=g)
    assert M.lpips(x, ref)[1] > 0.05
    assert M.tlp(x, ref)[0] > 0.01


def test_query_energy_top_fraction_of_a_known_spectrum():
    ev = torch.tensor([8.0, 4.0, 2.0, 1.0, 1.0])
    S = torch.diag(ev)[None]
    vals, frac = M.query_energy(S, rank=2)
    assert torch.allclose(vals[0], ev)
    assert frac.item() == pytest.approx(12 / 16)
    assert math.isnan(M.query_energy(torch.zeros(1, 3, 3))[1].item())
    with pytest.raises(ValueError):
        M.query_energy(torch.zeros(3, 2))


def test_second_moment_is_mean_outer_product():
    q = torch.tensor([[[1.0, 0.0], [0.0, 2.0]]])
    assert torch.allclose(M.second_moment(q), torch.tensor([[[0.5, 0.0], [0.0, 2.0]]]))
    with pytest.raises(ValueError):
        M.second_moment(torch.zeros(1, 0, 2))


# ---- SSIM against pytorch-msssim, the motion-compensated warping error -----------------------------

@pytest.mark.parametrize("kind", ["random", "smooth"])
def test_ssim_matches_pytorch_msssim(kind):
    from pytorch_msssim import ssim as ssim_ref

    g = torch.Generator().manual_seed(0)
    if kind == "random":
        ref = torch.rand(3, 48, 40, 3, generator=g)
        x = (ref + 0.1 * torch.randn(ref.shape, generator=g)).clamp(0, 1)
    else:  # smooth frames: a low-frequency field and a slightly shifted, dimmer copy
        yy, xx = torch.meshgrid(torch.linspace(0, 3, 48), torch.linspace(0, 3, 40), indexing="ij")
        ref = torch.stack([0.5 + 0.4 * torch.sin(xx + c + t * 0.3) * torch.cos(yy) for t in range(3) for c in range(3)])
        ref = ref.reshape(3, 3, 48, 40).permute(0, 2, 3, 1)
        x = (0.9 * ref.roll(1, 2) + 0.02).clamp(0, 1)
    want = ssim_ref(x.permute(0, 3, 1, 2).double(), ref.permute(0, 3, 1, 2).double(), data_range=1.0,
                    size_average=False, win_size=11, win_sigma=1.5, K=(0.01, 0.03))
    assert torch.allclose(M.ssim(x, ref).double(), want, atol=1e-6, rtol=0)


def _pan(world_seed: int = 11, frames: int = 8):
    from quantwm.world import scene

    world = scene.make_world(world_seed)  # seed 11: one gravel tile, texture everywhere (a flow is defined)
    assert scene.mosaic(world_seed)[1] == ["gravel"]
    poses = torch.tensor([[4, 4 + t] for t in range(frames)])  # one patch (8 px) to the right per frame
    return world, poses, scene.render(world, poses)


def test_reference_flow_recovers_a_camera_pan():
    _, _, ref = _pan()
    flow = M.reference_flow(ref)
    assert flow.shape == (7, 64, 64, 2)
    assert flow[..., 0].median().item() == pytest.approx(8.0, abs=0.25)  # frame t's pixel x came from x + 8
    assert flow[..., 1].median().abs().item() < 0.25


def test_warp_error_is_zero_on_a_pan_and_not_fooled_by_camera_motion():
    from quantwm.world import scene

    world, poses, ref = _pan()
    assert M.warp_error(ref, ref).abs().max().item() == 0.0  # no quantization: exactly zero
    # An error that moves with the world (the map itself blurred) is not flicker: tdiff, which compares
    # temporal differences without motion compensation, sees it; the warping error does not.
    blurred = scene.render(F.avg_pool2d(world[None], 3, 1, 1, count_include_pad=False)[0], poses)
    warp, td = M.warp_error(blurred, ref).mean().item(), M.tdiff(blurred, ref).mean().item()
    assert abs(warp) < 0.05 * td and td > 0.01


def test_warp_error_ranks_a_flickering_sequence_worse():
    world, poses, ref = _pan()
    from quantwm.world import scene

    steady = scene.render(F.avg_pool2d(world[None], 3, 1, 1, count_include_pad=False)[0], poses)
    sign = torch.tensor([(-1.0) ** t for t in range(len(ref))]).view(-1, 1, 1, 1)
    flicker = (ref + 0.05 * sign).clamp(0, 1)  # brightness alternating frame to frame
    per_frame = M.warp_error(flicker, ref)
    assert per_frame.shape == (len(ref) - 1,)
    assert per_frame.min().item() > 0.05
    assert per_frame.mean() > 10 * M.warp_error(steady, ref).abs().mean()
    m = M.warp_error_map(flicker, ref)
    assert m.shape == (len(ref) - 1, 64, 64) and m.mean() > 0.05


def test_warp_error_cannot_reward_a_smoothed_run_bf16_is_its_floor():
    """A blurred run (degraded, and smoother than BF16: its warping residual falls below BF16's) scores at least
    BF16's 0 on every pixel and frame, never below (docs/method.md §4)."""
    world, poses, ref = _pan()
    from quantwm.world import scene

    blurred = scene.render(F.avg_pool2d(world[None], 5, 1, 2, count_include_pad=False)[0], poses)
    assert M.warp_error_map(blurred, ref).min().item() >= 0 and M.warp_error(blurred, ref).min().item() >= 0
    assert M.warp_error(ref, ref).max().item() == 0.0


def test_warp_error_rejects_a_flow_of_the_wrong_shape():
    _, _, ref = _pan(frames=3)
    with pytest.raises(ValueError, match="flow must be"):
        M.warp_error(ref, ref, flow=torch.zeros(1, 64, 64, 2))
    with pytest.raises(ValueError, match="at least 2 frames"):
        M.warp_error(ref[:1], ref[:1])
