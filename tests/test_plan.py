"""quantwm.evaluation.plan and `quantwm plan`: the planner's bytes are a real cache's `CacheMemory`.

The real caches here have one layer (and, where quantized, 2 of the 12 heads): a cache's bytes are a sum over
layers and heads of identical shapes (every layer and head stores its own spans; nothing is shared across
them), so one layer's BF16 bytes times the layers is exact, and a method at budget B stores at most B bits per
element in every span whatever the number of heads. Tokens per chunk and head dim stay the real ones, since a
span's metadata (group scales, codebooks, the allocator's tables) depends on them.
"""
import json
import math

import pytest
import torch

from quantwm.cli import main
from quantwm.core.cache import CacheConfig, KVCache
from quantwm.evaluation.memory import PRESETS
from quantwm.evaluation.plan import FRONTIER, held, latent_frames, peak_bytes, plan, preset_with, video_frames


def _fill(cache: KVCache, heads: int, chunk_tokens: int, frames_per_chunk: int, latent: int, head_dim: int = 128,
          random: bool = False) -> None:
    """Write a rollout of `latent` latent frames into layer 0: every chunk committed but the last (current) one."""
    g = torch.Generator().manual_seed(0)
    n_chunks = -(-latent // frames_per_chunk)
    for i in range(n_chunks):
        n = chunk_tokens if i < n_chunks - 1 else (latent - i * frames_per_chunk) * chunk_tokens // frames_per_chunk
        shape = (1, heads, n, head_dim)
        k, v = ((torch.randn(shape, generator=g) if random else torch.zeros(shape)).bfloat16() for _ in range(2))
        cache.write(0, k, v, i)
        if random:
            cache.observe(0, torch.randn(1, heads, 64, head_dim, generator=g))
        if i < n_chunks - 1:
            cache.commit(0, i)


def test_video_and_latent_frames_follow_wans_vae():
    assert latent_frames(81) == 21 and video_frames(21) == 81 and latent_frames(1) == 1 and latent_frames(82) == 22


def test_plan_wan13b_81_frames_in_24_gib_is_a_real_bf16_cache(tmp_path, capsys):
    """The acceptance command: 21 latent frames fit in 24 GiB at BF16; the planner's bytes are those of a real
    one-layer cache of Wan-1.3B's shapes times its 30 layers, exactly."""
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "wan-1.3b", "--frames", "81", "--memory-gb", "24", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    r = json.loads(out.read_text())
    assert "bits per element needed: 16 (BF16 fits" in text and r["bits_needed"] == 16 and r["budget"] == 16
    p = PRESETS["wan-1.3b"]
    cache = KVCache(CacheConfig("bf16"), 1)
    _fill(cache, p.heads, p.chunk_frames * p.tokens_per_frame, p.chunk_frames, 21)
    mem = cache.memory()
    assert mem.bf16_bytes * p.layers == r["bf16_bytes"] == r["rows"][0]["peak_bytes"]
    assert r["rows"][0]["bytes_per_frame"] * 21 == r["bf16_bytes"]
    assert f"{r['bf16_bytes'] / 2**30:.2f} GiB" in text  # 5.62 GiB
    # the quality columns are the frontier envelope's quantwm points, budget by budget
    envelope = json.loads(FRONTIER.read_text())["world"]["envelope"]
    at = {x["bits"]: x for x in r["rows"]}
    assert at[2.5]["quality"]["psnr"]["quantwm"] == envelope["2.5"]["psnr"]["quantwm"]["value"]
    assert f"{envelope['2.5']['psnr']['quantwm']['value']:.2f}" in text and "frontier columns: quantwm's best" in text
    # 87 latent frames at BF16 fit in 24 GiB, 90 do not
    assert r["rows"][0]["frames_that_fit"] == 87
    assert peak_bytes(p, held(p, 87, None, 1, 1), 16) <= 24 * 2**30 < peak_bytes(p, held(p, 90, None, 1, 1), 16)


@pytest.mark.parametrize("method", ["kivi", "quantwm"])
def test_plan_budget_fits_a_real_quantized_cache(method, capsys):
    """3 GiB for 81 frames needs 2.94 bits per element: the planner picks 2.75, and a method at that budget (the
    budget is method-agnostic: every method stores at most B bits per element) in a real cache of those shapes
    stores its BF16 chunks exactly as planned and stays within the planned peak."""
    p = PRESETS["wan-1.3b"]
    assert main(["plan", "--model", "wan-1.3b", "--frames", "81", "--memory-gb", "3"]) == 0
    text = capsys.readouterr().out
    r = plan(p, 21, 3.0)
    assert r["bits_needed"] == pytest.approx(2.937, abs=1e-3) and r["budget"] == 2.75
    assert "bits per element needed: 2.937; budget: 2.75" in text
    assert r["quality"]["psnr"]["quantwm"] > r["quality"]["psnr"]["other"]  # figures read from the envelope
    assert "docs/frontier/world.json" in text
    heads = 2
    cache = KVCache(CacheConfig(method, budget=2.75), 1)
    _fill(cache, heads, p.chunk_frames * p.tokens_per_frame, p.chunk_frames, 21, random=True)
    mem = cache.memory()
    scale = p.layers * p.heads / heads
    full = mem.by_component["k.full"] + mem.by_component["v.full"]  # bfloat16 chunks: stored as BF16 holds them
    assert full * scale == r["full_precision_bytes"]
    assert mem.span_bits_per_element <= 2.75
    row = next(x for x in r["rows"] if x["bits"] == 2.75)
    assert mem.cache_bytes * scale <= row["peak_bytes"] <= 3 * 2**30
    assert mem.cache_bytes * scale > peak_bytes(p, held(p, 21, None, 1, 1), 2.0)  # the budget is used, not wasted


def test_plan_window_is_the_cache_with_max_chunks():
    """A rolling window's peak is a real cache's with max_chunks = sink + window, after any number of chunks;
    with the window fitting, any length fits."""
    p = preset_with("tiny")
    sink, window = 1, 3
    r = plan(p, 40, 1.0, window=window, sink=sink)
    cache = KVCache(CacheConfig("bf16", max_chunks=sink + window), 1)
    _fill(cache, p.heads, p.chunk_frames * p.tokens_per_frame, p.chunk_frames, 40, head_dim=p.head_dim)
    assert cache.memory().bf16_bytes * p.layers == r["bf16_bytes"]
    assert r["held"] == {"full_chunks": 2, "quantized_chunks": 2, "current_frames": 2}
    assert all(math.isinf(x["frames_that_fit"]) for x in r["rows"])


def test_plan_says_when_nothing_fits(capsys):
    assert main(["plan", "--model", "matrix-game-2", "--frames", "2001", "--memory-gb", "1"]) == 0
    assert "none fits (the full-precision chunks alone exceed the limit)" in capsys.readouterr().out
    assert plan(PRESETS["matrix-game-2"], 501, 1.0)["budget"] is None


def test_plan_quality_absent_without_a_frontier(tmp_path):
    r = plan(PRESETS["wan-1.3b"], 21, 3.0, frontier=tmp_path / "missing.json")
    assert r["budget"] == 2.75 and r["quality"] is None
    assert FRONTIER.is_file()


def test_plan_overrides_and_bad_values(capsys):
    assert preset_with("wan-1.3b", heads=4).heads == 4
    with pytest.raises(ValueError, match="unknown model"):
        preset_with("wan-2")
    assert main(["plan", "--model", "wan-1.3b", "--frames", "81", "--memory-gb", "0"]) == 2
    assert "memory limit must be a positive number" in capsys.readouterr().err
