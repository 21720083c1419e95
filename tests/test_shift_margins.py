"""benchmarks/shift_margins.py: the margin bins add up to analyze's shift, and the bound's test channel behaves as
its rate says."""
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import shift_margins as sm  # noqa: E402

from quantwm.evaluation.analyze import analyze_trace  # noqa: E402
from quantwm.evaluation.metrics import second_moment  # noqa: E402
from quantwm.evaluation.rate_distortion import distortion_at, weighted_spectrum  # noqa: E402
from quantwm.evaluation.trace import read_trace  # noqa: E402


def test_the_bins_add_up_to_the_shift_analyze_reports(tiny_trace_path):
    table = sm.margin_table(tiny_trace_path, ["textbook", "quantwm"], 2.5, bound=True)
    assert list(table) == ["textbook", "quantwm", "bound"]
    report = analyze_trace(read_trace(tiny_trace_path), ["textbook", "quantwm"], target="k", budget=(2.5, None))
    for m in ("textbook", "quantwm"):
        share, rate, adds = table[m]["bins"]
        assert table[m]["logit_rmse"] > 0 and table[m]["top1_key_error"] > 0
        assert share.sum() == pytest.approx(1.0) and bool((rate >= 0).all() and (rate <= 1).all())
        assert adds.sum().item() == pytest.approx(report["methods"][m]["mean"]["shift_rate"], abs=1e-9)
    assert torch.equal(table["bound"]["bins"][0], table["textbook"]["bins"][0])  # the same exact logits and bins


def test_the_test_channel_is_exact_at_a_high_rate_and_errs_at_a_low_one():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 40, 16, generator=g)
    k = torch.randn(2, 64, 16, generator=g) * torch.linspace(0.3, 2, 16)
    exact = q.double() @ k.double().transpose(-1, -2)
    spans = [slice(16, 48)]
    errors = [(sm.bound_logits(q, k, spans, b, torch.Generator().manual_seed(1)) - exact) for b in (30.0, 2.0, 0.5)]
    assert errors[0].abs().max() < 1e-6  # 30 bits an element: the keys as they are
    assert errors[1][:, :, :16].abs().max() < 1e-9 and errors[1][:, :, 48:].abs().max() < 1e-9  # outside: exact
    rms = [e[:, :, spans[0]].square().mean().sqrt().item() for e in errors]
    assert 0 < rms[1] < rms[2]
    # the mean squared logit error is the bound's distortion in the queries' metric, D*(R) of W = S^½ C S^½
    S = second_moment(q.double())
    for e, b in zip(errors[1:], (2.0, 0.5)):
        want = distortion_at(weighted_spectrum(k[:, spans[0]].double(), S), b * 16).mean()
        assert e[:, :, spans[0]].square().mean().item() == pytest.approx(want.item(), rel=0.15)
