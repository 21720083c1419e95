import math

import pytest
import torch

from quantwm.core.cache import CacheConfig
from quantwm.evaluation import diagnostics as D
from quantwm.world.generate import generate, load_world_model


@pytest.fixture(scope="module")
def run():
    """A short quantized rollout: 10 frames, chunks 2..4 generated and probed."""
    return generate(load_world_model(), 1, "loop", 10, CacheConfig("rtn"), steps=2)


def test_pixel_to_patch_maps_pixels_and_rejects_outside():
    assert D.pixel_to_patch(0, 0, (64, 64), (8, 8)) == (0, 0)
    assert D.pixel_to_patch(63, 8, (64, 64), (8, 8)) == (1, 7)
    for x, y in ((64, 0), (-1, 3), (5, 64)):
        with pytest.raises(ValueError, match="outside"):
            D.pixel_to_patch(x, y, (64, 64), (8, 8))


def test_token_coords_row_major_frames():
    assert D.token_coords(0, (8, 8)) == (0, 0, 0)
    assert D.token_coords(64 * 3 + 8 * 2 + 5, (8, 8)) == (3, 2, 5)


def test_seen_by_chunk_reproduces_the_probed_top1_under_stored_keys(run):
    """Logits recomputed from the final cache (recent chunk exact) pick what generation picked."""
    tokens = run.config.chunk_frames * run.config.tokens_per_frame
    moved = 0
    for p in run.probes:
        for layer in range(run.config.layers):
            exact, stored = run.cache.keys(layer, exact=True)[0], run.cache.keys(layer)[0]
            k_seen = D.seen_by_chunk(exact, stored, p.chunk, tokens, recent_chunks=1)
            assert torch.equal((p.q[layer] @ k_seen.transpose(1, 2)).argmax(-1), p.top1_quant[layer])
            assert torch.equal((p.q[layer] @ exact[:, :p.n_cached].transpose(1, 2)).argmax(-1), p.top1_exact[layer])
            moved += int((p.top1_quant[layer] != p.top1_exact[layer]).sum())
    assert moved > 0  # rtn at 2 bits does move some queries, so the check above is not vacuous


def test_frame_jumps_and_per_frame_shift_rate_agree_with_the_probes(run):
    cfg = run.config
    rates = D.shift_rate_per_frame(run.probes, 10, cfg.chunk_frames, cfg.tokens_per_frame)
    assert rates[:cfg.context_frames] == [None] * cfg.context_frames
    p = run.probes[-1]
    t = p.chunk * cfg.chunk_frames + 1  # second frame of the last chunk
    sl = slice(cfg.tokens_per_frame, 2 * cfg.tokens_per_frame)
    want = torch.stack([(e[:, sl] != q[:, sl]).float() for e, q in zip(p.top1_exact, p.top1_quant)]).mean()
    assert rates[t] == pytest.approx(float(want))
    one = D.frame_jumps(run.probes, t, cfg.chunk_frames, cfg.tokens_per_frame, layer=2, head=1)
    assert torch.equal(one, (p.top1_exact[2][1, sl] != p.top1_quant[2][1, sl]).float())
    assert D.frame_jumps(run.probes, 1, cfg.chunk_frames, cfg.tokens_per_frame) is None
    with pytest.raises(ValueError, match="layer 9"):
        D.frame_jumps(run.probes, t, cfg.chunk_frames, cfg.tokens_per_frame, layer=9)


def test_frame_series_and_flicker_maps_against_reference():
    g = torch.Generator().manual_seed(0)
    ref = torch.rand(5, 16, 16, 3, generator=g)
    x = ref.clone()
    x[3] = (x[3] + 0.1).clamp(0, 1)
    s = D.frame_series(x, ref, context_frames=2)
    # frames identical to BF16 (the context, and frame 2 here) get no PSNR (no 100 dB cap on the axis)
    assert s["psnr"][:3] == [None, None, None] and s["psnr"][3] < 30 and s["psnr"][4] is None
    assert s["identical"] == [True, True, True, False, True]
    assert s["tdiff"][0] is None and s["tdiff"][2] == 0 and s["tdiff"][3] > 0 and s["tdiff"][4] > 0
    assert s["warp_error"][0] is None and s["warp_error"][2] == 0 and s["warp_error"][3] > 0
    f = D.flicker_maps(x, ref)
    assert f.shape == (5, 16, 16) and f[0].abs().sum() == 0 and f[3].mean() == pytest.approx(s["tdiff"][3])
    assert D.worst_frames(s["tdiff"], 2) in ([3, 4], [4, 3])


def test_worst_frames_skips_missing_values():
    assert D.worst_frames([None, 0.1, float("nan"), 0.5, 0.2], 2) == [3, 4]
    assert D.worst_frames([None, 30.0, 20.0], 1, largest=False) == [2]


def test_query_logits_shape_frames_by_positions():
    k = torch.randn(3 * 4, 8)
    q = torch.randn(8)
    a, b = D.query_logits(q, k, k + 0.1, tokens_per_frame=4)
    assert a.shape == b.shape == (3, 4) and torch.allclose(a.flatten(), k @ q)
    with pytest.raises(ValueError, match="whole frames"):
        D.query_logits(q, k[:5], k[:5], tokens_per_frame=4)


def test_energy_spectrum_cumulative_reaches_one_and_top_fraction_matches():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 500, 16, generator=g) * torch.linspace(3, 0.1, 16)
    S = q.transpose(1, 2) @ q / 500
    e = D.energy_spectrum(S, rank=4)
    assert e["eigenvalues"].shape == (2, 16) and torch.all(e["eigenvalues"][:, :-1] >= e["eigenvalues"][:, 1:])
    assert torch.allclose(e["cumulative"][:, -1], torch.ones(2), atol=1e-5)
    assert torch.allclose(e["cumulative"][:, 3], e["top_fraction"], atol=1e-5)


def test_attention_output_error_is_zero_for_exact_and_grows_with_noise():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 6, 8, generator=g) for _ in range(3))
    assert D.attention_output_error(q, k, k, v, v)[0] == 0
    err, norm = D.attention_output_error(q, k, k, v, v + 0.1)
    assert err > 0 and norm > 0 and not math.isnan(err)


@pytest.mark.parametrize("method", ["qvg", "rtn+jensen"])
def test_trace_keys_shift_rate_matches_analyze(small_trace_path, method):
    from quantwm.evaluation.analyze import analyze_trace
    from quantwm.evaluation.trace import read_trace

    trace = read_trace(small_trace_path)
    r = D.trace_keys(trace, 1, method, "k", 2)
    report = analyze_trace(trace, [method], "k", 2)  # analyze compares biased logits for +jensen
    assert float((r["top1_exact"] != r["top1_quant"]).float().mean()) == pytest.approx(
        report["methods"][method]["layers"][1]["shift_rate"])
    assert (r["bias"] is None) == (method == "qvg")
    with pytest.raises(ValueError, match="layer 7"):
        D.trace_keys(trace, 7, "qvg")


def test_trace_margins_read_the_margins_and_where_the_bf16_source_falls():
    from quantwm.evaluation.diagnostics import trace_margins

    exact = torch.tensor([[0.0, 5.0, 1.0], [2.0, float("nan"), 4.5]])  # 2 cached frames of 3 tokens (1 x 3 grid)
    stored = torch.tensor([[0.0, 4.0, 1.0], [2.0, float("nan"), 4.6]])  # the method prefers frame 1, col 2
    m = trace_margins(exact, stored, (0, 0, 1), (1, 3))
    assert m == pytest.approx({"margin_bf16": 0.5, "margin_method": 0.6, "bf16_source_rank": 2})
    with pytest.raises(ValueError, match="at least two cached tokens"):
        trace_margins(torch.tensor([[1.0]]), torch.tensor([[1.0]]), (0, 0, 0), (1, 1))
