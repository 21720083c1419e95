"""The place world (quantwm/world/scene.py): one held-out photograph, whole and unjittered; and the other kinds'
worlds unchanged by its arrival."""
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_world import TINY, tiny_world_model

from quantwm.cli_parser import build_parser
from quantwm.world import scene
from quantwm.world.generate import generate
from quantwm.world.train import sample_clip

BEFORE = Path(__file__).parent / "data" / "worlds_before_place.safetensors"


@pytest.mark.parametrize("kind, seed", [("photo", 0), ("photo", 1), ("procedural", 0)])
def test_photo_and_procedural_worlds_are_unchanged_by_the_place_kind(kind, seed):
    """The README's and docs' measured results use photo worlds of seeds 0 and 1: against the worlds the code
    made before the place kind existed (tests/data, its metadata says how), every 8th pixel and each channel's sum.
    Their bits also depend on the intra-op thread count and the CPU's vector width (antialiased resampling rounds
    differently, by up to 2e-7 measured), so they are compared to 1e-6; a changed tile, crop or jitter draw moves
    pixels by far more."""
    before = load_file(BEFORE)
    world = scene.make_world(seed, 256, kind)
    assert torch.allclose(world[:, 3::8, 5::8], before[f"{kind}_{seed}_sample"], rtol=0, atol=1e-6)
    assert torch.allclose(world.double().sum((1, 2)), before[f"{kind}_{seed}_sum"], rtol=0, atol=1e-3)


def test_place_world_is_a_known_kind_deterministic_per_seed():
    assert "place" in scene.WORLDS and scene.WORLDS[:2] == ("photo", "procedural")
    a, b = scene.make_world(1, 64, "place"), scene.make_world(1, 64, "place")
    assert torch.equal(a, b) and a.shape == (3, 64, 64) and 0 <= a.min() and a.max() <= 1
    assert not torch.equal(a, scene.make_world(2, 64, "place"))  # the seed picks the photograph
    assert not torch.equal(a, scene.make_world(1, 64, "photo"))  # not the mosaic of the same seed


def test_place_world_shows_each_held_out_photograph_and_no_training_one():
    shown = [scene.place_photo(seed) for seed in range(12)]
    assert set(shown) == set(scene.HELD_OUT_PHOTOS) and not set(shown) & set(scene.TRAIN_PHOTOS)
    for seed in range(4):
        world = scene.make_world(seed, 32, "place")
        for name in scene.TRAIN_PHOTOS:  # the place world of a seed equals its held-out photograph's, no other's
            assert not torch.allclose(world, _resampled(name, 32), atol=0.05)
        assert torch.equal(world, _resampled(scene.place_photo(seed), 32))


def test_place_world_is_never_a_training_world():
    with pytest.raises(ValueError, match="evaluation world"):
        scene.make_world(scene.TRAIN_SEED_BASE, 64, "place")
    for side in ("training", "training-matched"):
        with pytest.raises(ValueError, match="held-out photograph only"):
            scene.make_world(0, 64, "place", photos=side)
    with pytest.raises(ValueError, match="evaluation world"):  # training draws seeds >= TRAIN_SEED_BASE
        sample_clip(torch.Generator().manual_seed(0), TINY, 6, 4, {}, world="place")


def test_place_world_pixels_are_the_photograph_itself_at_its_own_size():
    """At the photograph's own scale nothing is resampled: the world is its centred square, pixel for pixel
    (chelsea, 300 x 451: columns 75 to 375), so no jitter, flip or tint is applied."""
    assert scene.place_photo(1) == "chelsea"
    photo = scene.load_photo("chelsea")
    assert torch.equal(scene.make_world(1, 300, "place"), photo[:, :, 75:375])


def test_place_world_keeps_the_photographs_colours_when_shrunk():
    for seed in range(4):
        name = scene.place_photo(seed)
        world, photo = scene.make_world(seed, 256, "place"), scene.load_photo(name)
        side = min(photo.shape[1:])
        y, x = (photo.shape[1] - side) // 2, (photo.shape[2] - side) // 2
        square = photo[:, y:y + side, x:x + side]
        # a resampling keeps each channel's mean (a colour jitter scales it by 0.8 to 1.2)
        assert torch.allclose(world.mean((1, 2)), square.mean((1, 2)), atol=2e-3), name
        assert torch.equal(world[0], world[1]) == scene.is_grey(name)  # grey photographs stay grey, untinted


def test_unknown_world_kind_names_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown world 'places'; known: photo, procedural, place"):
        scene.make_world(0, 64, "places")
    with pytest.raises(SystemExit):  # argparse rejects it before any work
        build_parser().parse_args(["eval", "--world", "places"])
    assert build_parser().parse_args(["eval", "--world", "place"]).world == "place"


def test_generate_on_a_place_world_shows_the_photograph_along_the_trajectory():
    model = tiny_world_model()
    run = generate(model, 2, "loop", 6, world="place", probe=False)
    world = scene.make_world(2, TINY.world_patches * TINY.patch, "place")
    assert torch.equal(run.ground_truth, scene.render(world, run.poses, TINY.view, TINY.patch))


def _resampled(name: str, size: int) -> torch.Tensor:
    """A photograph's centred square at size x size, resampled as a place world is (the expected world)."""
    photo = scene.load_photo(name)
    side = min(photo.shape[1:])
    y, x = (photo.shape[1] - side) // 2, (photo.shape[2] - side) // 2
    square = photo[None, :, y:y + side, x:x + side]
    return torch.nn.functional.interpolate(square, size=(size, size), mode="bilinear", antialias=True,
                                           align_corners=False)[0].clamp(0, 1)
