"""The built-in world model: scene, model/mask equivalence, generation through the cache, eval."""
import json

import pytest
import torch
from tiny_world import TINY, tiny_world_model

from quantwm.core.cache import CacheConfig, KVCache
from quantwm.evaluation.trace import read_trace
from quantwm.world import scene
from quantwm.world.evaluate import evaluate, place_shift_rate, shift_rate
from quantwm.world.generate import generate, load_world_model, revisited_frames, rollout_trace
from quantwm.world.model import training_mask
from quantwm.world.train import export


@pytest.fixture(scope="module")
def tiny_model():
    return tiny_world_model()


def test_world_is_deterministic_and_in_range():
    a, b = scene.make_world(3, 64), scene.make_world(3, 64)
    assert torch.equal(a, b) and a.shape == (3, 64, 64)
    assert a.min() >= 0 and a.max() <= 1 and not torch.equal(a, scene.make_world(4, 64))


def test_matched_twins_repeat_a_training_photograph_where_the_held_out_world_repeats_a_scene():
    seen = set()
    for seed in range(12):
        held, names = scene.mosaic(seed, 64)
        twin, stand_ins = scene.mosaic(seed, 64, photos="training-matched")
        assert len(stand_ins) == len(names) and set(stand_ins) <= set(scene.TRAIN_PHOTOS)
        assert set(names) <= set(scene.HELD_OUT_PHOTOS)
        assert [scene.is_grey(n) for n in names] == [scene.is_grey(n) for n in stand_ins]  # grey for grey
        for i in range(len(names)):
            for j in range(len(names)):
                assert (scene.scene_of(names[i]) == scene.scene_of(names[j])) == (stand_ins[i] == stand_ins[j])
        assert not torch.equal(held, twin) and torch.equal(twin, scene.make_world(seed, 64, photos="training-matched"))
        seen |= set(stand_ins)
    assert len(seen) > 5  # the stand-ins change with the seed
    held_scenes = {scene.scene_of(n) for n in scene.HELD_OUT_PHOTOS}
    assert held_scenes.isdisjoint(scene.scene_of(n) for n in scene.TRAIN_PHOTOS)  # a scene sits on one side
    with pytest.raises(ValueError, match="photos must be one of training, training-matched, held-out"):
        scene.make_world(0, photos="train")


@pytest.mark.parametrize("kind", scene.TRAJECTORIES)
def test_trajectories_stay_inside_move_one_patch_and_revisit(kind):
    poses = scene.trajectory(kind, 32, seed=5, world_patches=32, view=8)
    assert poses.shape == (32, 2) and poses.min() >= 0 and poses.max() <= 24
    assert (poses[1:] - poses[:-1]).abs().max() <= 1
    if kind != "random-walk":
        assert torch.equal(poses[0], poses[-1])  # out and back
    with pytest.raises(ValueError, match="unknown trajectory"):
        scene.trajectory("zigzag", 4, 0)


def test_patchify_roundtrip_and_world_coords():
    frames = scene.render(scene.make_world(0, 96), torch.tensor([[0, 0], [1, 2]]), view=4, patch=8)
    assert frames.shape == (2, 32, 32, 3)
    assert torch.equal(scene.unpatchify(scene.patchify(frames), view=4), frames)
    coords = scene.token_world_coords(torch.tensor([[1, 2]]), view=4)
    assert coords[0, 0].tolist() == [1, 2] and coords[0, 5].tolist() == [2, 3]
    # the token at world patch (2, 3) in frame 1 shows the same pixels as the world there
    world = scene.make_world(0, 96)
    assert torch.equal(scene.patchify(frames)[1, 5], scene.patchify(world[:, 16:24, 24:32].permute(1, 2, 0)[None])[0, 0])


def test_revisited_frames_are_views_fully_seen_in_context():
    poses = torch.tensor([[0, 0], [0, 1], [0, 2], [0, 1], [0, 0]])
    assert revisited_frames(poses, context_frames=2, view=4) == [3, 4]


def test_training_mask_matches_generation_through_the_cache(tiny_model):
    """The block mask used in training sees exactly what chunked generation through the cache sees."""
    cfg, T = TINY, 6
    n = cfg.tokens_per_frame
    g = torch.Generator().manual_seed(1)
    clean = torch.rand(1, T * n, cfg.patch_dim, generator=g) * 2 - 1
    noisy = torch.randn(1, (T - cfg.context_frames) * n, cfg.patch_dim, generator=g)
    coords = torch.cat([torch.arange(T).repeat_interleave(n)[:, None], torch.randint(0, 8, (T * n, 2), generator=g)], -1)
    t_noisy = torch.full((1, noisy.shape[1]), 0.3)
    with torch.no_grad():
        full = tiny_model(torch.cat([clean, noisy], 1), torch.cat([torch.ones(1, T * n), t_noisy], 1),
                          torch.cat([coords, coords[cfg.context_frames * n:]]), mask=training_mask(T, cfg))
        cache = KVCache(CacheConfig(), cfg.layers)
        F = cfg.chunk_frames * n
        for c in range(T // cfg.chunk_frames):
            sl = slice(c * F, (c + 1) * F)
            if c * cfg.chunk_frames >= cfg.context_frames:
                j = c * F - cfg.context_frames * n
                out = tiny_model(noisy[:, j:j + F], t_noisy[:, :F], coords[sl], cache=cache, chunk=c)
                torch.testing.assert_close(out, full[:, T * n + j:T * n + j + F], atol=1e-5, rtol=1e-5)
            clean_out = tiny_model(clean[:, sl], torch.ones(1, F), coords[sl], cache=cache, chunk=c, commit=True)
            torch.testing.assert_close(clean_out, full[:, sl], atol=1e-5, rtol=1e-5)


def test_generate_probes_and_quantized_run_share_noise(tiny_model):
    ref = generate(tiny_model, 1, "loop", 8, CacheConfig(), steps=2)
    assert ref.frames.shape == (8, 32, 32, 3) and ref.frames.min() >= 0 and ref.frames.max() <= 1
    torch.testing.assert_close(ref.frames[:2], ref.ground_truth[:2], atol=1e-6, rtol=0)  # the context is given
    assert len(ref.probes) == 3 and len(ref.probes[0].top1_exact) == TINY.layers
    assert shift_rate(ref) == 0.0  # exact keys in both
    again = generate(tiny_model, 1, "loop", 8, CacheConfig(), steps=2)
    assert torch.equal(ref.frames, again.frames)  # seeded noise
    q = generate(tiny_model, 1, "loop", 8, CacheConfig(method="rtn", target="k", sink_chunks=0, recent_chunks=0), steps=2)
    assert q.cache.bits_per_element() == pytest.approx(2.5)
    assert 0 < shift_rate(q) <= 1
    with pytest.raises(ValueError, match="n_frames"):
        generate(tiny_model, 1, "loop", 5, CacheConfig())


def test_small_eval_end_to_end_and_trace(tiny_model, tmp_path):
    weights = tmp_path / "tiny.safetensors"
    export(tiny_model, str(weights), {"steps": 0})
    model = load_world_model(weights)
    r = evaluate(model, ["rtn", "quantwm"], target="kv", seeds=[0, 1], n_frames=6, steps=1)
    for m in ("rtn", "quantwm"):
        mean = r["methods"][m]["mean"]
        assert set(mean) >= {"psnr", "ssim", "lpips", "tdiff", "shift_rate", "bits_per_element", "compression"}
        # the quantized spans' compression and the whole cache's (its sink, recent and current chunks in BF16), means
        # over the seeds of each run's figures (PSAC's bases make the bits differ a little from seed to seed)
        assert mean["compression"] == pytest.approx(16 / mean["bits_per_element"], rel=1e-3)
        assert 1 <= mean["cache_compression"] < mean["compression"]
        assert len(r["methods"][m]["per_frame"]["psnr"]) == 4
    assert len(r["bf16"]["same_place_mass_per_layer"]) == TINY.layers
    json.dumps(r)  # serialisable
    with pytest.raises(ValueError, match="seeds"):
        evaluate(model, ["rtn"], seeds=[100_000])
    run = generate(model, 2, "pan-return", 6, CacheConfig(), steps=1)
    rollout_trace(run, tmp_path / "t.safetensors")
    t = read_trace(tmp_path / "t.safetensors")
    assert t.frames.shape == (6, 32, 32, 3) and t.meta["model"] == "quantwm-world"
    assert t.layers[0]["k"].shape[1] == 4 * TINY.tokens_per_frame and t.layers[0]["q_hist"].shape[1] > 0


def test_load_world_model_rejects_missing_and_corrupt_files(tmp_path):
    with pytest.raises(ValueError, match="no world-model weights"):
        load_world_model(tmp_path / "none.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"junk")
    with pytest.raises(ValueError, match="not a QuantWM world-model file"):
        load_world_model(bad)


def test_committed_weights_load_and_retrieve_memory_sharply():
    """The shipped model: its deepest layer puts most attention on cached tokens that saw the same place."""
    from quantwm.world.evaluate import memory_stats

    model = load_world_model()
    run = generate(model, 0, "pan-return", 12, CacheConfig(), steps=2)
    mass = memory_stats(run)["same_place_mass"]
    assert len(mass) == model.cfg.layers and max(mass) > 0.5


def test_generate_accepts_explicit_poses_and_rejects_bad_ones(tiny_model):
    poses = torch.full((8, 2), 5)
    run = generate(tiny_model, 0, n_frames=8, probe=False, poses=poses)
    assert torch.equal(run.poses, poses)
    assert torch.equal(run.ground_truth[0], run.ground_truth[-1])  # a static camera sees one view
    for bad in (torch.full((7, 2), 5), torch.full((8, 2), -1), torch.full((8, 2), 100)):
        with pytest.raises(ValueError, match="poses must be"):
            generate(tiny_model, 0, n_frames=8, probe=False, poses=bad)


def test_widen_doubles_width_and_keeps_the_function(tiny_model):
    from quantwm.world.train import widen

    wide = widen(tiny_model).eval()
    assert (wide.cfg.dim, wide.cfg.heads, wide.cfg.head_dim) == (2 * TINY.dim, 2 * TINY.heads, TINY.head_dim)
    g = torch.Generator().manual_seed(0)
    L = 3 * TINY.tokens_per_frame
    tokens, t = torch.randn(1, L, TINY.patch_dim, generator=g), torch.rand(1, L, generator=g)
    coords = torch.randint(0, 8, (L, 3), generator=g)
    with torch.no_grad():
        torch.testing.assert_close(wide(tokens, t, coords), tiny_model(tokens, t, coords), atol=1e-4, rtol=1e-4)
        noisy = widen(tiny_model, noise=0.05)(tokens, t, coords)
    assert not torch.allclose(noisy, tiny_model(tokens, t, coords), atol=1e-4)  # the copies now differ


def test_place_shift_counts_only_jumps_to_another_world_place(tiny_model):
    ref = generate(tiny_model, 2, "random-walk", 8, CacheConfig(), steps=1)
    assert place_shift_rate(ref)[0] == 0.0
    q = generate(tiny_model, 2, "random-walk", 8, CacheConfig(method="rtn", target="k", sink_chunks=0, recent_chunks=0),
                 steps=1)
    overall, per_layer = place_shift_rate(q)
    assert len(per_layer) == TINY.layers and 0 <= overall <= shift_rate(q)
    # by hand for layer 0: a changed top-1 whose two tokens saw the same world place is not a place jump
    jumped = sum(int((q.places[pr.top1_exact[0]] != q.places[pr.top1_quant[0]]).any(-1).sum()) for pr in q.probes)
    assert per_layer[0] == pytest.approx(jumped / sum(pr.top1_exact[0].numel() for pr in q.probes))


@pytest.mark.parametrize("weights,tol", [("int8", 2e-2), ("fp16", 1e-3)])
def test_export_formats_load_back_close_to_the_trained_weights(tiny_model, tmp_path, weights, tol):
    path = tmp_path / f"w-{weights}.safetensors"
    export(tiny_model, str(path), {"steps": 0}, weights)
    loaded = load_world_model(path)
    for k, v in tiny_model.state_dict().items():
        err = (loaded.state_dict()[k] - v).abs().max() / v.abs().max().clamp_min(1e-12)
        assert err <= tol, (k, float(err))
    with pytest.raises(ValueError, match="weights must be one of int8, fp16"):
        export(tiny_model, str(path), {}, "fp8")


def test_int8_export_is_about_half_the_size_of_fp16(tiny_model, tmp_path):
    sizes = {}
    for w in ("int8", "fp16"):
        export(tiny_model, str(tmp_path / f"{w}.safetensors"), {}, w)
        sizes[w] = (tmp_path / f"{w}.safetensors").stat().st_size
    assert sizes["int8"] < 0.6 * sizes["fp16"]


# ---- +jensen in the probes (issue 12, bug 1) ------------------------------------------------------

from quantwm.world.generate import ChunkProbe, ProbingCache  # noqa: E402


def test_probes_compare_the_logits_jensen_methods_attend_with():
    """+jensen adds -(τ²/24) Σ q² Δ² to every stored key's logit: the probes (and so every shift rate of
    eval and the app) must compare argmaxes with that bias, not of plain q·k̂."""
    g = torch.Generator().manual_seed(0)
    H, N, D = 2, 16, 64
    cache = KVCache(CacheConfig("rtn+jensen", target="k", keep_exact=True), 1)
    places = torch.zeros(6 * N, 2, dtype=torch.long)
    pc = ProbingCache(cache, places)
    for c in range(5):
        k = torch.randn(1, H, N, D, generator=g) * (1 + 3 * torch.rand(1, H, N, 1, generator=g))
        pc.attend(0, torch.randn(1, H, N, D, generator=g), k, torch.randn(1, H, N, D, generator=g), c, commit=True)
    q = 3 * torch.randn(1, H, N, D, generator=g)
    pc.armed = ChunkProbe(5)
    pc.attend(0, q, torch.randn(1, H, N, D, generator=g), torch.randn(1, H, N, D, generator=g), 5, scale=0.5)
    probe = pc.armed
    k_hat = cache.keys(0)[0, :, :-N]
    bias = cache.logit_bias(0, q, 0.5)[0, :, :, :-N]
    plain = (q[0] * 0.5 @ k_hat.transpose(1, 2)).argmax(-1)
    biased = (q[0] * 0.5 @ k_hat.transpose(1, 2) + bias).argmax(-1)
    assert not torch.equal(plain, biased)  # the bias changes some argmaxes here
    assert torch.equal(probe.top1_quant[0], biased)


def test_a_suspended_rollout_leaves_gradients_on_in_its_caller():
    """`rollout` is a generator: waiting between chunks, it must not leave its `no_grad` switched on outside."""
    from quantwm.world.generate import rollout

    steps = rollout(load_world_model(), 0, n_frames=8)
    next(steps)
    assert torch.is_grad_enabled()
    steps.close()
