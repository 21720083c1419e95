import math

import pytest
import torch

from quantwm.evaluation.analyze import MEAN_KEYS, analyze_trace, report_rows
from quantwm.evaluation.metrics import second_moment
from quantwm.evaluation.trace import read_trace


@pytest.fixture(scope="module")
def small_trace(small_trace_path):
    return read_trace(small_trace_path)


def test_synthetic_trace_is_valid_and_sharp(small_trace):
    import torch

    t = small_trace.layers[0]
    assert t["k"].shape == (2, 12 * 64, 64) and t["q"].shape == (2, 2 * 64, 64)
    p = torch.softmax(t["q"] @ t["k"].transpose(1, 2) * small_trace.softmax_scale, -1)
    assert p.max(-1).values.mean() > 0.3  # each query has a clear source token


def test_analyze_report_has_every_field_and_bf16_is_exact(small_trace):
    r = analyze_trace(small_trace, ["bf16", "rtn", "quantwm"], target="k")
    assert set(r) >= {"methods", "query_energy_top8", "trace", "config"}
    for m in ("bf16", "rtn", "quantwm"):
        assert set(r["methods"][m]["mean"]) == set(MEAN_KEYS)
        assert len(r["methods"][m]["layers"]) == 2
    bf = r["methods"]["bf16"]["mean"]
    assert bf["shift_rate"] == 0 and bf["k_rel_err"] == 0 and math.isnan(bf["bits_per_element"])
    assert r["methods"]["rtn"]["mean"]["bits_per_element"] == pytest.approx(2.5)
    assert r["methods"]["rtn"]["mean"]["v_rel_err"] == 0  # target k leaves values exact
    assert len(r["query_energy_top8"]) == 2 and all(0 < f <= 1 for f in r["query_energy_top8"][0])
    assert r["trace"]["model"].startswith("synthetic-world")


def test_analyze_ordering_on_the_synthetic_world(small_trace):
    # qvg-budget: QVG's algorithm at quantwm's storage budget (paper-configured qvg stores 256 centroids, which
    # on this trace's short spans hold nearly every key: a different budget)
    r = analyze_trace(small_trace, ["rtn", "qvg-budget", "quantwm"], target="k")
    s = {m: e["mean"]["shift_rate"] for m, e in r["methods"].items()}
    assert s["quantwm"] < s["qvg-budget"] < s["rtn"]


def test_analyze_value_target_moves_values_only(small_trace):
    r = analyze_trace(small_trace, ["rtn"], target="v")
    m = r["methods"]["rtn"]["mean"]
    assert m["shift_rate"] == 0 and m["k_rel_err"] == 0 and m["v_rel_err"] > 0 and m["out_rel_err"] > 0


def test_analyze_reports_the_keys_rate_distortion_meter(small_trace):
    r = analyze_trace(small_trace, ["bf16", "rtn", "kivi", "quantwm"], target="kv")
    bf, rtn, kivi, ours = (r["methods"][m]["mean"] for m in ("bf16", "rtn", "kivi", "quantwm"))
    assert math.isnan(bf["k_bits_above_bound"]) and math.isnan(bf["k_bits_per_element"])  # nothing quantized
    assert rtn["k_bits_per_element"] == pytest.approx(2.5)
    assert ours["k_bits_per_element"] != pytest.approx(ours["bits_per_element"])  # Keys' bits alone, Values' apart
    # per-token RTN loses more than the span's weighted variance: the bound needs no bits, all 2.5 are above it
    assert rtn["k_distortion"] > 1 and rtn["k_bits_above_bound"] == pytest.approx(2.5)
    for m in (kivi, ours):
        assert 0 <= m["k_bound_distortion"] < m["k_distortion"] < 1
        assert 0 < m["k_bits_above_bound"] < m["k_bits_per_element"]
    assert math.isnan(analyze_trace(small_trace, ["rtn"], target="v")["methods"]["rtn"]["mean"]["k_bits_above_bound"])
    _, rows = report_rows(r)
    assert len(rows[0]) == 1 + len(MEAN_KEYS) and rows[0][MEAN_KEYS.index("k_bits_above_bound") + 1] is None


def test_analyze_rejects_unknown_method(small_trace):
    with pytest.raises(ValueError, match="known methods"):
        analyze_trace(small_trace, ["nope"])


# ---- S is built causally, never from the measured queries (issue 12, bug 2) -----------------------------

def _capture_stats(monkeypatch):
    from quantwm.core.methods.rtn import RTN

    seen = []
    encode = RTN.encode
    monkeypatch.setattr(RTN, "uses_queries", True)  # the cache keeps S where a method reads it: let rtn "read" it
    monkeypatch.setattr(RTN, "encode", lambda self, x, kind, ctx: seen.append(ctx.stats.clone()) or encode(self, x, kind, ctx))
    return seen


def _trace(tmp_path, with_hist: bool, with_chunks: bool):
    """4 cached chunks of 16 tokens; history queries of chunk c point along channel c; measured ones along 7."""
    from quantwm.evaluation.trace import TraceWriter

    g = torch.Generator().manual_seed(0)
    H, D, n = 1, 64, 16
    w = TraceWriter(16, (4, 4), 0.25, model="test")
    w.extra_meta["chunk_frames"] = 1
    hist = torch.zeros(H, 4 * n, D)
    for c in range(4):
        hist[:, c * n:(c + 1) * n, c] = 3.0
    q = torch.zeros(H, n, D)
    q[..., 7] = 5.0
    chunk_of = torch.arange(4).repeat_interleave(n)
    w.record(0, q, torch.randn(H, 4 * n, D, generator=g), torch.randn(H, 4 * n, D, generator=g),
             q_hist=hist if with_hist else None, q_hist_chunk=chunk_of if with_chunks else None)
    w.save(tmp_path / "t.safetensors")
    return read_trace(tmp_path / "t.safetensors"), hist


def test_analyze_builds_s_causally_from_q_hist_chunk(tmp_path, monkeypatch):
    trace, hist = _trace(tmp_path, True, True)
    seen = _capture_stats(monkeypatch)
    report = analyze_trace(trace, ["rtn"], "k", 2)
    assert report["config"]["stats"].startswith("causal")
    # committing chunk c+1 quantizes chunk c (sink 0 and the recent chunk stay exact): S holds chunks 0..c+1
    assert len(seen) == 2
    for span, S in zip((1, 2), seen):
        want = second_moment(hist[:, :(span + 2) * 16])
        torch.testing.assert_close(S, want, rtol=1e-5, atol=1e-6)
        assert S[0, 7, 7] == 0  # the measured queries never enter S


def test_analyze_without_q_hist_uses_identity_not_the_measured_queries(tmp_path, monkeypatch):
    trace, _ = _trace(tmp_path, False, False)
    seen = _capture_stats(monkeypatch)
    report = analyze_trace(trace, ["rtn"], "k", 2)
    assert report["config"]["stats"].startswith("S = identity")
    for S in seen:
        torch.testing.assert_close(S, torch.eye(64)[None])


def test_analyze_legacy_q_hist_without_chunks_is_flagged(tmp_path, monkeypatch):
    trace, hist = _trace(tmp_path, True, False)
    seen = _capture_stats(monkeypatch)
    assert analyze_trace(trace, ["rtn"], "k", 2)["config"]["stats"].startswith("not causal")
    torch.testing.assert_close(seen[0], second_moment(hist), rtol=1e-5, atol=1e-6)


def test_read_trace_rejects_a_bad_q_hist_chunk(tmp_path):
    from safetensors.torch import load_file, save_file

    _trace(tmp_path, True, True)
    t = load_file(tmp_path / "t.safetensors")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "t.safetensors"), "pt") as f:
        meta = f.metadata()
    t["L0.q_hist_chunk"] = t["L0.q_hist_chunk"][:5]
    save_file(t, tmp_path / "bad.safetensors", metadata=meta)
    with pytest.raises(ValueError, match="q_hist_chunk must be int64"):
        read_trace(tmp_path / "bad.safetensors")


def test_kivi_pre_quantizes_keys_before_rope_on_a_post_rope_trace(small_trace):
    """kivi-pre on a post-RoPE trace: keys un-rotated with the trace's 3-D RoPE, quantized, rotated at read."""
    r = analyze_trace(small_trace, ["kivi", "kivi-pre"], "k", 2)
    k, pre = r["methods"]["kivi"]["mean"], r["methods"]["kivi-pre"]["mean"]
    assert pre["bits_per_element"] == k["bits_per_element"] and pre["k_rel_err"] != k["k_rel_err"]
    assert 0 < pre["shift_rate"] < 1


def test_kivi_pre_is_refused_by_a_post_rope_cache():
    from quantwm.core.cache import CacheConfig, KVCache

    with pytest.raises(ValueError, match="before RoPE"):
        KVCache(CacheConfig("kivi-pre"), 1)
