import dataclasses

import pytest
import torch

from quantwm.core.cache import CacheConfig, CacheMemory, KVCache
from quantwm.core.methods import qvg
from quantwm.evaluation.memory import PAPER_PRESETS, PRESETS, get_preset, held_frames, memory_report, window_chunks


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


def test_cache_memory_names_the_spans_and_the_whole_cache_apart():
    """rtn at 2 bits, groups of 64 over D=64: the spans store 2.5 bits per element (6.4x); the whole cache keeps the
    sink, the recent and the current chunk in full precision (counted as BF16 even when written in float32)."""
    cache = KVCache(CacheConfig("rtn"), 1)
    g = torch.Generator().manual_seed(0)
    for i in range(5):  # sink, 2 quantized, recent, current: 4 of 10 halves quantized
        k, v, q = (torch.randn(1, 2, 16, 64, generator=g) for _ in range(3))
        cache.attend(0, q, k, v, chunk=i, commit=i < 4)
    m = cache.memory()
    elems = 2 * 5 * 2 * 16 * 64  # K and V of 5 chunks
    assert m.span_bits_per_element == pytest.approx(2.5) and m.span_compression == pytest.approx(6.4)
    assert m.cache_bytes == 2 * (2 * 16 * 64) * 2.5 / 8 * 2 + 2 * (elems - 2 * 2 * 2 * 16 * 64)
    assert m.bf16_bytes == 2 * elems and m.stored_bytes > m.cache_bytes  # float32 chunks stored at 4 bytes
    assert m.cache_compression == pytest.approx(m.bf16_mb / m.cache_mb) and 1 < m.cache_compression < m.span_compression
    assert m.summary() == (f"quantized spans 2.50 bits/element (6.40x); whole cache {m.cache_mb:.2f} MB vs "
                           f"{m.bf16_mb:.2f} MB BF16 ({m.cache_compression:.2f}x)")
    assert CacheMemory.from_dict(m.to_dict()).figures() == m.figures() and set(m.figures()) == set(CacheMemory.FIGURES)
    assert KVCache(CacheConfig("rtn"), 1).memory().summary().startswith("no quantized spans; whole cache 0.00 MB")


def test_memory_report_figures_are_its_cache_memory():
    r = memory_report("tiny", 16, "kivi")
    m = CacheMemory.from_dict(r["memory"])
    assert (r["bits_per_element"], r["compression"], r["cache_compression"]) == (
        m.span_bits_per_element, m.span_compression, m.cache_compression)
    assert m.cache_bytes == r["total_bytes"] and m.bf16_bytes == r["bf16_bytes"] and r["summary"] == m.summary()
    assert r["compression"] > r["cache_compression"] > 1


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


def test_memory_qvg_spans_of_8_chunks_reach_its_papers_compression(monkeypatch):
    """QVG's accounting: 256 BF16 centroids amortised over a span of 8 chunks (Self-Forcing: 37,440 tokens). The
    bytes do not depend on the Lloyd iterations (quantwm.core.budget measures a method's bytes with one): the
    k-means keeps its first assignment, which spares 37,440 tokens x 256 centroids two more passes. Every head
    has its own centroids and stores alike: one head of Wan-1.3B's 12 stands for all of them (a ratio of bytes)."""
    real = qvg.kmeans
    monkeypatch.setattr(qvg, "kmeans", lambda x, n_clusters, iters, **kw: real(x, n_clusters, 0, **kw))
    monkeypatch.setitem(PRESETS, "wan-1.3b", dataclasses.replace(PRESETS["wan-1.3b"], heads=1))
    r = memory_report("wan-1.3b", 21, "qvg", sample_layers=1, span_chunks=8)
    assert r["compression"] >= 6.5 and r["quantized_figures_from_latent_frames"] == 33  # 11 chunks complete one span
    assert r["cache_compression"] == pytest.approx(1.0)  # 21 frames: no span of 8 is complete, all BF16
    assert "bf16 codebook" in r["grid"] and "symmetric" in r["grid"]


def test_memory_reports_runtime_state_and_a_drifting_query_stream_stores_more_bases():
    drift = memory_report("tiny", 16, "quantwm", queries="drift")
    still = memory_report("tiny", 16, "quantwm", queries="none")
    assert drift["bytes"]["k.psac_basis"] > still["bytes"]["k.psac_basis"]  # a basis whenever S moves
    assert drift["runtime_bytes"]["query_stats"] == 2 * 2 * 64 * 64 * 8  # layers x heads x D x D float64
    assert drift["runtime_bytes"]["method_state"] > 0
    with pytest.raises(ValueError, match="query stream"):
        memory_report("tiny", 8, "rtn", queries="calibrated")


@pytest.mark.parametrize("name", PAPER_PRESETS)
def test_paper_presets_carry_their_fastvideo_source_and_length(name):
    p = get_preset(name)
    assert p.source.startswith("fastvideo 0.2.1: fastvideo/") and ".py:" in p.source
    assert p.length and p.sink_frames is not None and p.head_dim == 128


def test_causal_forcing_is_an_alias_of_self_forcing():
    assert get_preset("causal-forcing") is PRESETS["self-forcing"]
    assert memory_report("causal-forcing", 3, "bf16", sample_layers=1)["preset"]["name"] == "self-forcing"


def test_lingbot_world_v2_window_rounds_up_to_whole_chunks_and_says_so():
    """Window 18 with a 6-frame sink at chunks of 4: sink 2 chunks, 4 committed + the current = 20 frames."""
    sink, most, note = window_chunks(PRESETS["lingbot-world-v2"])
    assert (sink, most) == (2, 4) and "rounded up" in note and "20 frames held" in note
    assert held_frames(PRESETS["lingbot-world-v2"], 24, sink, most) == 20


def test_memory_windowed_cache_holds_no_more_than_its_window():
    p = PRESETS["tiny-window"]  # window 8 frames, sink 2, chunks of 2
    frame = 2 * p.layers * p.tokens_per_frame * p.heads * p.head_dim * 2
    bf16 = memory_report("tiny-window", 20, "bf16")
    assert bf16["held_frames"] == p.window and bf16["total_bytes"] == bf16["bf16_bytes"] == p.window * frame
    q = memory_report("tiny-window", None, "quantwm")  # its length, 12 frames: sink, 1 quantized, recent, current
    assert q["latent_frames"] == p.length and q["held_frames"] == p.window
    assert q["bf16_bytes"] == p.window * frame and 1 < q["cache_compression"] < q["compression"]


def test_memory_report_length_defaults_to_the_presets():
    with pytest.raises(ValueError, match="no default length"):
        memory_report("tiny", None, "bf16")


def test_hy_world_keeps_its_adapters_recent_context_bf16_and_counts_both_attentions():
    """HY-World 1.5's preset holds every frame (any may be retrieved), 108 cache layers (RoPE and PRoPE per block),
    and by default the 12 recent frames BF16 as its adapter does: 3 chunks of 4."""
    p = PRESETS["hy-world-1.5"]
    assert p.layers == 108 and p.window is None and p.recent_frames == 12
    assert memory_report("hy-world-1.5", 8, "bf16", sample_layers=1)["recent_chunks"] == 3
    assert memory_report("hy-world-1.5", 8, "bf16", sample_layers=1, recent_chunks=0)["recent_chunks"] == 0
