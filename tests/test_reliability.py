"""Limits, the shared results cache, temporary files and faults (issue: reliability under load)."""
import os
import subprocess
import sys
import threading

import pytest
import torch

from app import media
from app import world_handlers as wh
from quantwm.drivers import studies
from quantwm.drivers.registry import RunRegistry
from quantwm.drivers.workbench import RunKey, Workbench
from quantwm.evaluation.limits import Limits, fit_chunk_seconds, request_bytes, request_seconds, run_bytes

FRAMES = 10


@pytest.fixture(scope="module")
def wb():
    return Workbench()


def small_cache(wb, runs: float) -> RunRegistry:
    """The registry of a workbench sharing `wb`'s model whose results cache holds about `runs` records of FRAMES
    frames."""
    return RunRegistry(Workbench(model=wb.model, limits=Limits.from_machine(
        wb.cfg, len(wb.methods()), cache_mb=runs * run_bytes(wb.cfg, FRAMES) / 2 ** 20, max_frames=64)))


def test_frames_over_the_limit_are_refused_at_once_naming_it(wb):
    runs = RunRegistry(wb)
    r = wh.generate_handler(runs, 0, "loop", "quantwm", "kv", 2, 100000)
    assert r["status"].startswith("**Error:**") and f"limit of {wb.limits.max_frames} frames" in r["status"]
    assert "--max-frames" in r["status"] and not wb.cached(RunKey(frames=100000 - 100000 % 2))
    for bad in (float("nan"), "many", None, -3, 2.5, True):
        assert wh.generate_handler(runs, 0, "loop", "quantwm", "kv", 2, bad)["status"].startswith("**Error:**")
    huge_seed = wh.generate_handler(runs, 10 ** 18, "loop", "quantwm", "kv", 2, FRAMES)["status"]
    assert "world seed must lie in [0, 100000)" in huge_seed


def test_limits_follow_memory_time_and_overrides(wb):
    cfg = wb.cfg
    big = Limits.from_machine(cfg, 5, memory_mb=64_000)
    small = Limits.from_machine(cfg, 5, memory_mb=400)
    assert small.max_frames < big.max_frames
    assert request_bytes(cfg, small.max_frames) <= 200 * 2 ** 20 < request_bytes(cfg, small.max_frames + 2)
    timed = Limits.from_machine(cfg, 5, (0.1, 1e-4), memory_mb=64_000, max_seconds=30)
    assert request_seconds(cfg, timed.max_frames, (0.1, 1e-4)) <= 30 < request_seconds(cfg, timed.max_frames + 2,
                                                                                        (0.1, 1e-4))
    assert Limits.from_machine(cfg, 5, memory_mb=64_000, max_frames=20).max_frames == 20
    with pytest.raises(ValueError, match="no room"):
        Limits.from_machine(cfg, 5, memory_mb=1)
    with pytest.raises(ValueError, match="max_seconds must be positive"):
        Limits.from_machine(cfg, 5, max_seconds=0)
    assert fit_chunk_seconds([100, 200, 300], [1.1, 1.2, 1.3]) == pytest.approx((1.0, 1e-3))
    assert "frames" in big.describe() and "methods per comparison" in big.describe()


def test_memory_estimates_bound_the_records_they_describe(wb):
    ref, rec = wb.pair(RunKey(seed=1, method="quantwm", frames=FRAMES))
    ref.reference_flow()
    for r in (ref, rec):
        assert r.nbytes() <= run_bytes(wb.cfg, FRAMES) <= 1.5 * r.nbytes()
    assert request_bytes(wb.cfg, FRAMES) >= ref.nbytes() + rec.nbytes()


def test_methods_and_uploads_over_the_limit(wb, tmp_path):
    lim = Limits.from_machine(wb.cfg, 3, memory_mb=64_000, max_upload_mb=0.001)
    with pytest.raises(ValueError, match="over this server's limit of 3"):
        lim.check_methods(4, FRAMES)
    tight = Limits.from_machine(wb.cfg, 20, cache_mb=3.5 * run_bytes(wb.cfg, FRAMES) / 2 ** 20, memory_mb=64_000)
    with pytest.raises(ValueError, match="do not fit in the results cache"):
        tight.check_methods(5, FRAMES)
    f = tmp_path / "big.safetensors"
    f.write_bytes(b"x" * 4096)
    with pytest.raises(ValueError, match="over this server's limit"):
        lim.check_upload(str(f), "trace file")
    from app.handlers import analyze_handler, trace_energy_handler

    status, _, _ = analyze_handler(str(f), ["rtn"], "k", 2, check_upload=lim.check_upload)
    assert "over this server's limit" in status
    assert "over this server's limit" in trace_energy_handler(str(f), 0, check_upload=lim.check_upload)["status"]
    f.write_bytes(b"")  # an empty upload, then garbage: messages, not crashes
    assert analyze_handler(str(f), ["rtn"], "k", 2)[0].startswith("**Error:**")
    f.write_bytes(os.urandom(2000))
    assert analyze_handler(str(f), ["rtn"], "k", 2)[0].startswith("**Error:**")
    assert analyze_handler(str(tmp_path / "gone"), ["rtn"], "k", 2)[0].startswith("**Error:**")


def test_two_generations_at_once_each_get_their_own_results(wb):
    keys = [RunKey(seed=s, method="rtn", frames=FRAMES) for s in (11, 12)]
    out, spans = {}, {}

    def client(k):
        import time
        t0 = time.perf_counter()
        out[k] = studies.compare(wb, k)
        spans[k] = (t0, time.perf_counter())

    threads = [threading.Thread(target=client, args=(k,)) for k in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert set(out) == set(keys)
    for k in keys:
        assert out[k]["key"] == k.id
        solo = studies.compare(wb, k)  # from the cache now: the same numbers
        assert solo["summary"] == out[k]["summary"]
    assert (out[keys[0]]["bf16"] != out[keys[1]]["bf16"]).any()  # different worlds, different frames


def test_eviction_keeps_runs_with_their_references_and_deletes_their_videos(wb, tmp_path):
    small = small_cache(wb, 4.5)
    files = media.TempFiles(str(tmp_path / "app"))
    old = wh.FILES
    wh.use_files(files)
    try:
        wh.track_evictions(small)
        mine = wh.generate_handler(small, 21, "loop", "rtn", "kv", 2, FRAMES)
        video = mine["bf16_video"]
        assert os.path.isfile(video)
        for seed in (22, 23):  # another user's runs push mine out
            assert not wh.generate_handler(small, seed, "loop", "kivi", "kv", 2, FRAMES)["status"].startswith("**Error")
            for k in small.wb._records:  # no run without its reference, ever
                assert k.reference() in small.wb._records
        assert small.wb.cached_bytes() <= small.wb.cache_bytes
        scrub = wh.scrub_handler(small, mine["run_id"], FRAMES - 1)
        assert "was evicted" in scrub["status"] and "press Generate" in scrub["status"]
        assert not os.path.exists(video) and not os.path.exists(os.path.dirname(video))
        again = wh.generate_handler(small, 21, "loop", "rtn", "kv", 2, FRAMES)  # regenerated: the same run
        assert again["summary"] == mine["summary"]
        assert wh.scrub_handler(small, again["run_id"], FRAMES - 1)["bf16"] is not None
        exports = [files.export_dir("run") for _ in range(files.keep_exports + 3)]
        assert sum(os.path.isdir(e) for e in exports) == files.keep_exports
    finally:
        wh.FILES = old
        files.close()
    assert not os.path.exists(files.root)


def test_a_generation_that_turns_non_finite_ends_in_a_message(wb, monkeypatch):
    small = small_cache(wb, 8)
    real = small.wb._rollout

    def poisoned(key, progress):
        rec = real(key, progress)
        if key.method != "bf16":
            rec.frames[3:, 0, 0, 0] = float("nan")
        return rec

    monkeypatch.setattr(small.wb, "_rollout", poisoned)
    r = wh.generate_handler(small, 31, "loop", "rtn", "kv", 2, FRAMES)
    assert "non-finite frames" in r["status"] and not small.wb.cached(RunKey(31, "loop", "rtn", "kv", 2, FRAMES))
    assert small.wb.cached(RunKey(31, "loop", "bf16", "kv", 2, FRAMES))  # what was computed is kept


def test_an_unexpected_failure_in_a_handler_is_a_message():
    def broken(*_):
        raise RuntimeError("disk on fire")

    r = wh.guarded(broken)(1, 2)
    assert r["status"].startswith("**Error:**") and "RuntimeError: disk on fire" in r["status"]


@pytest.mark.parametrize("content", [b"", b"garbage" * 100, "truncated"], ids=["empty", "garbage", "truncated"])
def test_corrupt_weights_at_start_up_exit_2_with_one_line(tmp_path, content, app_start):
    """The truncated file starts the real command line (`python -m quantwm.app`); the others call its `main`
    in this process, which is what that command runs."""
    from quantwm.world.generate import DEFAULT_WEIGHTS

    bad = tmp_path / "w.safetensors"
    bad.write_bytes(open(DEFAULT_WEIGHTS, "rb").read()[:5000] if content == "truncated" else content)
    argv = ["--weights", str(bad), "--port", "7999"]
    if content == "truncated":
        p = subprocess.run([sys.executable, "-m", "quantwm.app", *argv], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "GRADIO_ANALYTICS_ENABLED": "False"})
        code, err = p.returncode, p.stderr
    else:
        code, err = app_start(argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "w.safetensors" in lines[0] and lines[0].startswith("quantwm app: error:")


def test_nan_weights_are_refused(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from quantwm.world.generate import DEFAULT_WEIGHTS, load_world_model

    with safe_open(str(DEFAULT_WEIGHTS), "pt") as f:
        meta = f.metadata()
    state = load_file(str(DEFAULT_WEIGHTS))
    name = next(k for k, t in state.items() if t.is_floating_point() and not k.endswith("::scale"))
    state[name] = state[name].clone()
    state[name].view(-1)[0] = torch.nan
    save_file(state, str(tmp_path / "nan.safetensors"), metadata=meta)
    with pytest.raises(ValueError, match="NaN or Inf"):
        load_world_model(tmp_path / "nan.safetensors")
