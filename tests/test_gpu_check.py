"""benchmarks/gpu_check.sh: the device check runs end to end on the CPU (--dry-run; every step but the two that
rerun this suite's own tests, whose selections are checked here), its budget skips steps, and --steps picks them;
the dry run's kernel benchmark (`quantwm selfcheck --model tiny`, the user's command) and commit cost are checked
here too."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402

STEPS = ["cuda tests", "cuda tier", "warm attend", "commit cost", "trellis encode", "kernel bench", "real shapes",
         "live rollout"]
# The two steps that run tests of this suite in a pytest of their own: the suite runs those tests itself, and
# test_the_pytest_steps_select_tests_of_this_suite checks what they select; the dry run below runs the others.
PYTEST_STEPS = ("cuda tests", "cuda tier")


def test_the_dry_run_runs_every_step_and_writes_one_json(tmp_path):
    run = [s for s in STEPS if s not in PYTEST_STEPS]
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run", "--out", str(tmp_path), "--steps",
                           ",".join(run)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    steps = {s["name"]: s for s in report["steps"]}
    assert [s["name"] for s in gpu_check.steps(tmp_path, True)] == STEPS and list(steps) == run
    assert steps["warm attend"]["figures"]["checks"][0].startswith("ok     3 attends: 0 host syncs")
    assert all(s["status"] == "ok" for s in steps.values()), {k: s["tail"][-500:] for k, s in steps.items()}
    commit = steps["commit cost"]["figures"]  # per method: estimated steady commit ms per layer, nothing measured
    assert set(commit) == {"quantwm", "kivi"} and all(f["estimated_ms"] > 0 and f["measured_ms"] is None
                                                      for f in commit.values())
    trellis = steps["trellis encode"]["figures"]  # one span coded by quantwm-trellis's search, timed
    assert trellis["span"] == "1 x 64 x 32" and trellis["seconds"] > 0
    assert any(k.startswith("fused @ ") for k in steps["kernel bench"]["figures"])
    assert any(k.startswith("fused int8 @ ") for k in steps["kernel bench"]["figures"])
    selfcheck = json.loads((tmp_path / "kernel_bench.json").read_text())
    check_kernel_bench(selfcheck["rows"], steps["kernel bench"]["tail"])
    # quantwm selfcheck on a CPU: each method's path, every kernel's first-use check (all passed), its table
    assert selfcheck["paths"]["quantwm@2.5"] == "fused kernel" and selfcheck["paths"]["qvg-pro"].startswith("reference")
    checks = selfcheck["selfcheck"]
    assert len(checks) >= 10 and all(v["ok"] for v in checks)
    assert {v["kernel"] for v in checks} >= {"span_attention", "quantize_pack", "kmeans_assign", "unpack_bits"}
    assert any(v["layout"].startswith("k: channels") for v in checks)
    assert ", 0 failed" in steps["kernel bench"]["tail"]
    assert steps["real shapes"]["figures"]["quantwm"]["quantized_bytes_per_latent_frame"] > 0
    live = steps["live rollout"]["figures"]
    assert live["frames"] == 45 and live["frame_hw"] == [32, 64] and live["bits_per_element"] > 2
    assert "step" in done.stdout and "live rollout" in done.stdout.splitlines()[-2]  # the table, then the total


def check_kernel_bench(rows: list[dict], printed: str) -> None:
    """The kernel benchmark at the dry run's shapes: every path at every cache length, 2-bit paths reading fewer
    bytes, and its table printed."""
    lengths = sorted({r["cache_tokens"] for r in rows})
    assert lengths == [96, 128]
    for L in lengths:
        paths = {r["path"]: r for r in rows if r["cache_tokens"] == L}
        assert set(paths) == {"bf16", "dequant+sdpa", "fused", "fused int8", "fused e4m3", "quantize chunk (quantwm)"}
        assert paths["bf16"]["vs_bf16"] == 1.0
        for name in ("dequant+sdpa", "fused", "fused int8", "fused e4m3"):
            assert paths[name]["ms"] > 0 and paths[name]["bytes"] < paths["bf16"]["bytes"]  # 2-bit spans read less
        assert math.isfinite(paths["quantize chunk (quantwm)"]["ms"])
    assert "fused" in printed


@pytest.mark.parametrize("dry", [True, False])
def test_the_pytest_steps_select_tests_of_this_suite(tmp_path, dry):
    """Each pytest step names test files of this suite and, where it selects with -k, words of its tests' names
    (in the files' text, or a method name: test_fake_cuda.py's tests take every method `quantwm methods` lists);
    its figure is pytest's summary line."""
    from quantwm.core.methods import method_sources

    methods = {name for name, _, _ in method_sources()}
    for step in (s for s in gpu_check.steps(tmp_path, dry) if s["name"] in PYTEST_STEPS):
        cmd = step["cmd"]
        files = [a for a in cmd if a.startswith("tests/")]
        assert files and all((ROOT / f).is_file() for f in files), cmd
        if "-k" in cmd:
            source = "".join((ROOT / f).read_text() for f in files)
            words = cmd[cmd.index("-k") + 1].split(" or ")
            assert all(w in source or w in methods for w in words), (step["name"], words)
        text = "....\n13 passed, 114 deselected in 1.68s\n"
        assert gpu_check.figures(step["name"], tmp_path, text) == {"summary": "13 passed, 114 deselected in 1.68s"}


def test_steps_are_picked_by_name_and_an_unknown_name_is_refused(tmp_path, monkeypatch, capsys):
    quick = [{"name": n, "limit": 60, "cmd": [sys.executable, "-c", f"print('{n}')"]} for n in ("a", "b", "c")]
    monkeypatch.setattr(gpu_check, "steps", lambda out, dry: quick)
    rows = gpu_check.run_steps(tmp_path, True, budget=100, only=["c", "a"])
    assert [r["name"] for r in rows] == ["a", "c"]  # in the script's order
    with pytest.raises(SystemExit):
        gpu_check.main(["--dry-run", "--out", str(tmp_path), "--steps", "a,x"])
    assert "unknown step(s) 'x'; the steps are: a, b, c" in capsys.readouterr().err


def test_steps_past_the_budget_are_skipped_with_a_message(tmp_path, monkeypatch):
    quick = [{"name": n, "limit": 60, "cmd": [sys.executable, "-c", "print('ran')"]} for n in ("a", "b")]
    monkeypatch.setattr(gpu_check, "steps", lambda out, dry: quick)
    rows = gpu_check.run_steps(tmp_path, True, budget=gpu_check.MIN_STEP_S - 1)
    assert [r["status"] for r in rows] == ["skipped", "skipped"] and "budget" in rows[0]["note"]
    rows = gpu_check.run_steps(tmp_path, True, budget=100)
    assert [r["status"] for r in rows] == ["ok", "ok"] and "ran" in rows[0]["tail"]


def test_a_step_that_fails_or_overruns_is_reported(tmp_path, monkeypatch):
    bad = [{"name": "fails", "limit": 60, "cmd": [sys.executable, "-c", "raise SystemExit(3)"]},
           {"name": "hangs", "limit": 2, "cmd": [sys.executable, "-c", "print('started', flush=True); import time; time.sleep(60)"]}]
    monkeypatch.setattr(gpu_check, "steps", lambda out, dry: bad)
    monkeypatch.setattr(gpu_check, "MIN_STEP_S", 1)
    rows = gpu_check.run_steps(tmp_path, True, budget=100)
    assert [(r["status"], r["rc"]) for r in rows] == [("failed", 3), ("timed out", None)]
    assert "started" in rows[1]["tail"]
