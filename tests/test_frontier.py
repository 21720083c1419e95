"""Tests for quantwm.drivers.frontier: the resumable sweep, the equal-bits summary, the Ray path."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from quantwm.cli import main
from quantwm.drivers import frontier as FR


@pytest.fixture(scope="module")
def trace_source(small_trace_path):
    return f"trace:{small_trace_path}"


def test_sweep_resumes_from_its_manifest(tmp_path, trace_source):
    tasks = FR.make_tasks([trace_source], {"rtn": [{}], "qvg": [{"n_centroids": 4}]}, [2], "k")
    first = FR.sweep(tasks[:1], tmp_path)
    assert len(first) == 1
    calls = []
    real = FR.run_task
    FR.run_task, original = (lambda t: calls.append(t) or real(t)), FR.run_task
    try:
        second = FR.sweep(tasks, tmp_path)  # only the point not yet in the manifest runs
    finally:
        FR.run_task = original
    assert [c["method"] for c in calls] == ["qvg"] and len(second) == 2
    on_disk = json.loads((tmp_path / "manifest.json").read_text())
    assert set(on_disk) == {FR.task_key(t) for t in tasks}


def test_the_envelope_compares_every_method_at_each_budget():
    pts = {}
    for method, bits, shift in (("qvg", 2.5, 0.4), ("qvg", 3.5, 0.2), ("quantwm", 3.0, 0.1), ("kivi", 2.4, 0.3)):
        t = {"source": "trace:x", "method": method, "options": {"b": bits}, "bits": 2, "target": "k"}
        pts[FR.task_key(t)] = {"task": t, "result": {"bits_per_element": bits, "shift_rate": shift}}
    env = FR.summarise(pts, budgets=(2.5, 3.0, 4.0))["trace:x"]["envelope"]
    assert set(env["2.5"]["shift_rate"]) == {"qvg", "kivi"}  # quantwm has no point within 2.5 bits
    assert env["3"]["shift_rate"]["qvg"]["bits"] == 2.5  # not the 3.5-bit qvg point
    assert env["4"]["shift_rate"]["qvg"]["value"] == 0.2
    rows = FR.leads(env, "shift_rate")
    assert rows[0]["ours"] is None and rows[0]["other"]["method"] == "kivi"
    assert rows[1]["other"]["method"] == "kivi" and rows[1]["ratio"] == pytest.approx(0.1 / 0.3)
    assert rows[2]["ratio"] == pytest.approx(0.5)
    lines = FR.describe_leads(rows, "shift_rate")
    assert "no quantwm point within the budget" in lines[0] and "ratio 0.50" in lines[2]


def test_the_summary_carries_the_keys_rate_distortion_meter():
    pts = {}
    for method, bits, above in (("kivi", 2.5, 2.3), ("kivi", 2.25, 2.0), ("quantwm", 2.5, 0.9)):
        t = {"source": "trace:x", "method": method, "options": {"b": bits}, "bits": 2, "target": "k"}
        pts[FR.task_key(t)] = {"task": t, "result": {"bits_per_element": bits, "shift_rate": 0.1,
                                                     "k_bits_above_bound": above}}
    env = FR.summarise(pts, budgets=(2.25, 2.5))["trace:x"]["envelope"]
    assert env["2.5"]["k_bits_above_bound"]["kivi"]["value"] == 2.0  # the fewest bits above within 2.5 bits
    lines = FR.describe_meter(env)
    assert lines[0] == "<= 2.25 bits, Keys' bits above the Gaussian bound: kivi 2.00 (kivi(b=2.25) at 2.25 bits)"
    assert "quantwm 0.90 (quantwm(b=2.5) at 2.50 bits)" in lines[1]
    assert FR.describe_meter(FR.envelope([{"method": "m", "label": "m", "bits_per_element": 2, "psnr": 30.0}])) == []


def test_the_envelope_keeps_the_highest_psnr():
    points = [{"method": "qvg", "label": f"qvg({b})", "bits_per_element": b, "psnr": p} for b, p in ((2.4, 30.0), (2.5, 28.0))]
    points.append({"method": "quantwm", "label": "quantwm", "bits_per_element": 2.45, "psnr": 31.0})
    env = FR.envelope(points, budgets=(2.5,))
    assert env["2.5"]["psnr"]["qvg"]["value"] == 30.0
    (row,) = FR.leads(env, "psnr")
    assert row["difference"] == pytest.approx(1.0)


def test_frontier_cli_writes_json_and_figure(tmp_path, trace_source, capsys):
    out = tmp_path / "fr"
    assert main(["frontier", "--quick", "--sources", trace_source, "--bits", "2", "--target", "k",
                 "--formats", "svg", "--out-dir", str(out)]) == 0
    summary = json.loads((out / "frontier.json").read_text())
    (s,) = summary.values()
    assert {p["method"] for p in s["points"]} == {"rtn", "qvg", "quantwm"}
    assert set(s["envelope"]) == {f"{b:g}" for b in FR.BUDGETS}
    assert (out / "frontier.svg").stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "<= 2.5 bits, shift_rate:" in printed and "Keys' bits above the Gaussian bound: " in printed
    assert all(math.isfinite(p["k_bits_above_bound"]) for p in s["points"])
    assert main(["frontier", "--sources", "trace:/nope.safetensors", "--out-dir", str(out)]) == 2


def test_sweep_on_a_local_ray_with_two_cpus(trace_source):
    pytest.importorskip("ray")
    import shutil
    import tempfile

    scratch = Path(tempfile.mkdtemp(prefix="qwm-", dir="/tmp"))  # short: Ray's sockets live below it
    try:
        tasks = FR.make_tasks([trace_source], {"rtn": [{}], "kivi": [{}]}, [2], "k")
        manifest = FR.sweep(tasks, scratch, workers=2, ray_address="local")
        assert len(manifest) == 2 and (scratch / "ray").is_dir()  # Ray's temporary files stay in the scratch folder
        local = FR.run_task(tasks[0])
        assert manifest[FR.task_key(tasks[0])]["result"] == local  # the same numbers as in this process
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def test_a_configuration_the_source_cannot_take_is_recorded_not_fatal(tmp_path, trace_source):
    tasks = FR.make_tasks([trace_source], {"rtn": [{"group_size": 128}, {}]}, [2], "k")  # the trace has D = 64
    manifest = FR.sweep(tasks, tmp_path)
    bad = manifest[FR.task_key(tasks[0])]["result"]
    assert "does not divide" in bad["error"]
    (s,) = FR.summarise(manifest).values()
    assert len(s["points"]) == 1


def test_budget_mode_configures_each_method_within_each_budget(tmp_path, trace_source, capsys):
    out = tmp_path / "fb"
    assert main(["frontier", "--sources", trace_source, "--methods", "kivi,quantwm,nvfp4", "--budget", "2.5,3",
                 "--target", "k", "--formats", "svg", "--out-dir", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    results = {(e["task"]["method"], e["task"]["budget"]): e["result"] for e in manifest.values()}
    assert len(results) == 6
    for (method, budget), r in results.items():
        if method == "nvfp4":  # 4.5 bits: cannot fit, says so, is left out
            assert "nvfp4 cannot fit" in r["error"]
        else:
            assert r["bits_per_element"] <= budget + 1e-9 and r["configuration"]["k"]
    assert "quantwm(budget=2.5)" in capsys.readouterr().out
    assert main(["frontier", "--sources", trace_source, "--budget", "0,3", "--out-dir", str(out)]) == 2
    assert "--budget takes bits per element in (0, 16]" in capsys.readouterr().err


def test_points_over_the_largest_budget_are_not_run(trace_source):
    tasks = FR.make_tasks([trace_source], {"qvg": [{"n_centroids": 2}, {"n_centroids": 256}], "quantwm": [{"budget": 3.0}]},
                          [2], "k")
    kept, dropped = FR.within(tasks, 4.0)
    assert dropped == 1 and [t["options"] for t in kept] == [{"n_centroids": 2}, {"budget": 3.0}]
    own = FR.make_tasks([trace_source], {"nvfp4": [{}], "int8k-fp8v": [{}]}, [2], "k")
    assert FR.within(own, 4.0) == (own, 0)  # deployed formats: one point each, always on the frontier
