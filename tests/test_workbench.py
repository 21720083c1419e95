"""The drivers over one results cache: the Workbench (quantwm/drivers/workbench.py), the views of its runs
(views.py, through registry.py) and the studies (studies.py); one module-scoped Workbench serves them all, so
each run is generated once."""
import threading
import time

import pytest
import torch

from quantwm.drivers import studies
from quantwm.drivers.workbench import RunKey, Workbench
from quantwm.evaluation.diagnostics import trace_energy, trace_query_view

FRAMES = 10


@pytest.fixture(scope="module")
def key():
    return RunKey(seed=2, trajectory="loop", method="rtn", target="kv", bits=2, frames=FRAMES)


def test_run_key_id_roundtrip_and_validation(key):
    assert RunKey.parse(key.id) == key
    assert key.reference() == RunKey(2, "loop", "bf16", "kv", 2, FRAMES)
    for bad in ("seed=x loop rtn kv 2-bit 10f", "hello", "seed=1 loop rtn kv budget=x 10f"):
        with pytest.raises(ValueError, match="not a run id"):
            RunKey.parse(bad)
    for empty in ("", "  ", None):  # a view asked for before any run
        with pytest.raises(ValueError, match="Generate a run first"):
            RunKey.parse(empty)
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        RunKey(method="nope")
    with pytest.raises(ValueError, match="unknown trajectory"):
        RunKey(trajectory="zigzag")
    with pytest.raises(ValueError, match="target"):
        RunKey(target="q")


def test_run_ids_name_the_world_and_old_ids_without_one_are_photo_worlds():
    """A world kind other than photo is named after the seed; an id written before worlds were named (no world)
    still parses, as the photo world it was made on."""
    place = RunKey(seed=6, method="qvg", frames=FRAMES, budget=2.5, world="place")
    assert place.id == "seed=6 place loop qvg kv budget=2.5 10f" and RunKey.parse(place.id) == place
    assert place.reference().world == "place" and RunKey.parse(place.reference().id) == place.reference()
    old = RunKey.parse("seed=4 loop quantwm kv budget=2.5 32f")
    assert old.world == "photo" and old.id == "seed=4 loop quantwm kv budget=2.5 32f"
    assert RunKey.parse("seed=1 procedural pan-return rtn k 3-bit 10f").world == "procedural"
    with pytest.raises(ValueError, match="unknown world 'mars'; known: photo, procedural, place"):
        RunKey(world="mars")
    with pytest.raises(ValueError, match="not a run id"):
        RunKey.parse("seed=6 mars loop qvg kv budget=2.5 10f")


def test_a_run_key_s_world_is_the_world_its_rollout_shows(wb):
    """The context frames are the world rendered along the trajectory: a place key's are the place world's, not
    the photo mosaic's of the same seed."""
    from quantwm.world.scene import make_world, render, trajectory

    c = wb.cfg
    poses = trajectory("loop", FRAMES, 6, c.world_patches, c.view)[:c.context_frames]
    for world in ("place", "photo"):
        frames = wb.run(RunKey(seed=6, method="bf16", frames=FRAMES, world=world)).frames[:c.context_frames]
        truth = render(make_world(6, c.world_patches * c.patch, world), poses, c.view, c.patch)
        assert torch.allclose(frames, truth, atol=1e-6), world


def test_compare_caches_runs_and_reports_series(wb, key):
    cmp = studies.compare(wb, key)
    assert wb.cached(key) and wb.cached(key.reference())
    rec = wb.record(key.id)
    assert studies.compare(wb, key)["summary"] == cmp["summary"] and wb.record(key.id) is rec  # from the cache
    s = cmp["series"]
    assert len(s["psnr"]) == len(s["tdiff"]) == len(s["shift_rate"]) == FRAMES
    assert cmp["bf16"].shape == cmp["method"].shape == (FRAMES, 64, 64, 3) and cmp["bf16"].dtype.name == "uint8"
    summ = cmp["summary"]
    assert 0 < summ["shift_rate"] < 1 and summ["psnr"] < 100
    # the two compressions, by name: the quantized spans' (2-bit codes plus scales) above the whole cache's
    assert summ["span_compression"] > summ["cache_compression"] > 1 and summ["cache_mb"] < summ["bf16_mb"]
    assert {k: summ[k] for k in rec.memory.FIGURES} == rec.memory.figures() and cmp["memory"] == rec.memory.summary()
    # BF16 bytes: K and V, every layer, every cached token, 2 bytes per element
    c = wb.cfg
    assert summ["bf16_mb"] == pytest.approx(2 * c.layers * FRAMES * c.tokens_per_frame * c.dim * 2 / 2 ** 20)


def test_vbench_flicker_of_each_side_counts_every_frame_pair_from_the_last_context_frame(wb, runs, key, monkeypatch):
    """The Generate tab's VBench score: each side's own frames from the last context frame on, the same whether
    its frame pairs are measured a few at a time (as a long run's are) or all at once."""
    from quantwm.evaluation import vbench
    from quantwm.evaluation.vbench import temporal_flickering

    studies.compare(wb, key)
    view, ctx = runs.view(key.id), wb.cfg.context_frames
    whole = {"bf16": temporal_flickering(view.run.bf16[ctx - 1:]), "method": temporal_flickering(view.run.method[ctx - 1:])}
    scored = view.vbench_flicker()
    monkeypatch.setattr(vbench, "PAIRS_AT_ONCE", 2)
    assert scored == pytest.approx(whole, abs=1e-12) == view.vbench_flicker()
    assert whole["bf16"] != temporal_flickering(view.run.bf16)  # the context frames are not counted


def test_a_second_generation_waits_for_the_running_one(wb):
    key = RunKey(seed=5, method="bf16", frames=FRAMES)
    got = []
    wb._lock.acquire()  # a generation is running
    t = threading.Thread(target=lambda: got.append(wb.run(key)))
    t.start()
    time.sleep(0.3)
    assert t.is_alive() and not got  # waiting, not refused
    wb._lock.release()
    t.join(120)
    assert got and got[0].key == key and wb.cached(key)


def test_runs_made_side_by_side_equal_runs_made_one_by_one(wb, key):
    """`prefetch` with two workers: every run of a study and its reference, the same records as one at a time
    (each rollout draws its own noise), progress over all their chunks; a method that cannot run is reported,
    the others kept."""
    keys = [key, RunKey(seed=2, method="kivi", target="k", frames=FRAMES, budget=2.5)]
    studies.compare(wb, key)  # the module's Workbench makes them one by one
    studies.compare(wb, keys[1])
    side = Workbench(model=wb.model, workers=2)
    calls = []
    assert side.workers == 2 and side.prefetch(keys, lambda a, n: calls.append((a, n))) == {}
    assert calls[-1] == (3 * FRAMES // wb.cfg.chunk_frames,) * 2  # BF16 and both methods, every chunk
    for k in (key.reference(), *keys):
        a, b = wb.record(k.id), side.record(k.id)
        assert a.frames.equal(b.frames) and all(x.equal(y) for x, y in zip(a.k_stored + a.v_stored, b.k_stored + b.v_stored))
    bad = RunKey(seed=2, method="rtn", frames=FRAMES, budget=0.25)  # below what rtn can store
    failed = side.prefetch([bad, RunKey(seed=3, method="bf16", frames=FRAMES)])
    assert list(failed) == [bad] and "rtn cannot fit 0.25 bits" in str(failed[bad])
    assert not side.cached(bad) and side.cached(RunKey(seed=3, method="bf16", frames=FRAMES))


def test_a_study_computes_a_records_metrics_once(wb, key, monkeypatch):
    """A Methods table shown again (or exported) and a Key-vs-Value study re-run reuse each record's clip metrics
    and attention-output error: the same numbers, nothing computed again."""
    from quantwm.drivers.views import RunView
    from quantwm.evaluation import diagnostics

    first = studies.methods_table(wb, key, ["rtn"]), studies.key_vs_value(wb, key)
    calls = []
    for owner, name in ((RunView, "summary"), (diagnostics, "probed_attention_error")):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, real=real, name=name, **kw: calls.append(name) or real(*a, **kw))
    assert (studies.methods_table(wb, key, ["rtn"]), studies.key_vs_value(wb, key)) == first and calls == []


def test_frame_view_and_pixel_trace(wb, runs, key):
    studies.compare(wb, key)
    view = runs.view(key.id)
    v = view.frame_view(FRAMES - 1)
    assert v["flicker"].shape == (64, 64) and v["jumps"].shape == (8, 8) and not v["context"]
    assert view.frame_view(1)["jumps"] is None
    with pytest.raises(ValueError, match="out of range"):
        view.frame_view(FRAMES)
    tr = view.pixel_trace(FRAMES - 1, 20, 50, layer=1, head=2)
    assert tr["query"] == (FRAMES - 1, 6, 2)
    assert tr["logits_bf16"].shape == tr["logits_method"].shape == ((FRAMES - 2) , 64)
    f, r, c = tr["source_bf16"]
    assert tr["logits_bf16"][f, r * 8 + c] == tr["logits_bf16"].max()
    f, r, c = tr["source_method"]
    assert tr["logits_method"][f, r * 8 + c] == tr["logits_method"].max()
    assert tr["jumped"] == (tr["source_bf16"] != tr["source_method"])
    with pytest.raises(ValueError, match="context frame"):
        view.pixel_trace(0, 1, 1)
    with pytest.raises(ValueError, match="outside"):
        view.pixel_trace(FRAMES - 1, 64, 1)
    with pytest.raises(ValueError, match="press Generate"):
        runs.view(RunKey(seed=77, frames=FRAMES).id)


def test_energy_per_layer(wb, runs, key):
    studies.compare(wb, key)
    e = runs.view(key.id).energy()
    assert len(e) == wb.cfg.layers and e[0]["eigenvalues"].shape == (wb.cfg.heads, wb.cfg.head_dim)
    assert all(0 < f <= 1 for s in e for f in s["top_fraction"])


def test_key_vs_value_isolates_each_half(wb, key):
    k, v = studies.key_vs_value(wb, key)
    assert (k["target"], v["target"]) == ("k", "v")
    assert k["k_rel_err"] > 0 and k["v_rel_err"] == 0 and v["k_rel_err"] == 0 and v["v_rel_err"] > 0
    assert v["shift_rate"] == 0 and k["shift_rate"] > 0  # only Key errors move the top-1 source
    assert k["attn_out_rel_err"] > 0 and v["attn_out_rel_err"] > 0 and 0 < k["lpips"] < 1


def test_methods_table_rows_and_unknown_method(wb, key):
    rows = studies.methods_table(wb, key, ["rtn", "kivi"])
    assert [r["method"] for r in rows] == ["rtn", "kivi"]
    assert all(r["span_compression"] > r["cache_compression"] > 1 and r["cache_mb"] < r["bf16_mb"] for r in rows)
    with pytest.raises(ValueError, match="unknown method"):
        studies.methods_table(wb, key, ["rtn", "bogus"])
    with pytest.raises(ValueError, match="at least one"):
        studies.methods_table(wb, key, [])


def test_methods_table_at_a_budget_configures_sorts_and_leaves_out(wb, key):
    from dataclasses import replace

    at = replace(key, budget=2.5)
    assert RunKey.parse(at.id) == at and "budget=2.5" in at.id and at.reference().budget is None
    left_out = {}
    rows = studies.methods_table(wb, at, ["quantwm", "kivi", "nvfp4"], left_out=left_out)
    assert [r["method"] for r in rows] == sorted(["quantwm", "kivi"], key=lambda m: next(
        r["span_bits_per_element"] for r in rows if r["method"] == m))
    assert all(r["span_bits_per_element"] <= 2.5 + 1e-9 for r in rows)
    assert "k: allocator, bits per channel " in next(r["configuration"] for r in rows if r["method"] == "quantwm")
    assert list(left_out) == ["nvfp4"] and "cannot fit 2.5" in left_out["nvfp4"]


def test_trace_views(small_trace_path):
    r = trace_query_view(str(small_trace_path), "qvg", "k", 2, 0, 1, 5)
    assert r["logits_bf16"].shape == (12, 64) and r["query_coords"] == (12, 0, 5)
    assert r["jumps"].shape == (128,) and 0 <= r["shift_rate"] <= 1
    with pytest.raises(ValueError, match="query 500 out of range"):
        trace_query_view(str(small_trace_path), "qvg", "k", 2, 0, 1, 500)
    e = trace_energy(str(small_trace_path))
    assert len(e) == 2 and e[0]["cumulative"].shape == (2, 64)
