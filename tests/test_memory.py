import pytest

from quantwm.evaluation.memory import PRESETS, memory_report


def test_memory_bf16_matches_the_shape_formula():
    r = memory_report("tiny", 8, "bf16")
    p = PRESETS["tiny"]
    assert r["total_bytes"] == r["bf16_bytes"] == 2 * p.layers * 8 * p.tokens_per_frame * p.heads * p.head_dim * 2
    assert r["cache_compression"] == 1.0


def test_memory_counts_quantized_components_and_current_chunk():
    r = memory_report("tiny", 7, "quantwm")  # chunks of 2 frames: 3 full + a 1-frame current chunk
    assert r["chunks"] == 4
    assert {"k.codes", "k.codebook0", "k.centroid_ids0", "k.psac_basis", "v.codes", "k.full"} <= set(r["bytes"])
    assert "v.psac_basis" not in r["bytes"]  # PSAC is for keys only
    assert r["total_bytes"] == sum(r["bytes"].values())
    assert r["compression"] == pytest.approx(16 / r["bits_per_element"])


def test_memory_sampled_layers_scale_exactly():
    full = memory_report("tiny", 8, "rtn")
    sampled = memory_report("tiny", 8, "rtn", sample_layers=1)
    assert sampled["layers_quantized"] == 1
    assert sampled["total_bytes"] == full["total_bytes"]


def test_memory_rejects_bad_arguments():
    with pytest.raises(ValueError, match="known presets"):
        memory_report("nope", 8, "rtn")
    with pytest.raises(ValueError, match="latent_frames"):
        memory_report("tiny", 0, "rtn")
    with pytest.raises(ValueError, match="known methods"):
        memory_report("tiny", 4, "nope")
