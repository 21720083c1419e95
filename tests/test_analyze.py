import math

import pytest

from quantwm.evaluation.analyze import MEAN_KEYS, analyze_trace
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
    r = analyze_trace(small_trace, ["rtn", "qvg", "quantwm"], target="k")
    s = {m: e["mean"]["shift_rate"] for m, e in r["methods"].items()}
    assert s["quantwm"] < s["qvg"] < s["rtn"]


def test_analyze_value_target_moves_values_only(small_trace):
    r = analyze_trace(small_trace, ["rtn"], target="v")
    m = r["methods"]["rtn"]["mean"]
    assert m["shift_rate"] == 0 and m["k_rel_err"] == 0 and m["v_rel_err"] > 0 and m["out_rel_err"] > 0


def test_analyze_rejects_unknown_method(small_trace):
    with pytest.raises(ValueError, match="known methods"):
        analyze_trace(small_trace, ["nope"])
