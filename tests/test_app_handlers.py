"""The world-model and trace-inspection handlers, called as plain functions (no browser, no server)."""
import re

import imageio_ffmpeg
import numpy as np
import pytest

from app import handlers, plots
from app import overview_handlers as oh
from app import study_handlers as sh
from app import world_handlers as wh
from quantwm.core.cache import CacheMemory
from quantwm.drivers import studies
from quantwm.drivers.registry import RunRegistry
from quantwm.drivers.workbench import RunKey, Workbench
from quantwm.evaluation.synthetic import make_synthetic_trace

pytestmark = pytest.mark.usefixtures("shared_rollouts")  # conftest.py: each rollout made once per process

FRAMES = 10
SETTINGS = (3, "pan-return", "qvg-budget", "k", 2, FRAMES)  # lossy here (qvg's 256 centroids hold every key)


@pytest.fixture(scope="module")
def generated(runs):
    calls = []
    r = wh.generate_handler(runs, *SETTINGS, progress=lambda done, total: calls.append((done, total)))
    return r, calls


def test_generate_returns_h264_videos_plot_and_worst_frame(generated):
    r, calls = generated
    assert r["run_id"] == "seed=3 pan-return qvg-budget k 2-bit 10f" and not r["status"].startswith("**Error")
    assert "PSNR vs BF16" in r["status"] and "shift rate" in r["status"]
    for which in ("bf16_video", "method_video"):
        meta = next(imageio_ffmpeg.read_frames(r[which]))
        assert meta["codec"] == "h264" and meta["size"] == (64 * wh.FACTOR, 64 * wh.FACTOR)
        assert meta["pix_fmt"].startswith("yuv420p")
    assert r["frames"] == FRAMES and 4 <= r["frame"] < FRAMES and r["frame"] == r["worst_frames"][0]
    names = [t.name for t in r["figure"].data]
    assert names[:2] == ["tdiff", "worst flicker frames"] and "shift_rate" in names
    assert names.count("worst flicker frames") == 1  # marked on the flicker panel only
    assert calls and calls[-1][0] == calls[-1][1]  # the progress bar reached its end


def test_generate_again_is_served_from_the_cache(runs, generated):
    again = wh.generate_handler(runs, *SETTINGS)
    assert "from the cache" in again["status"] and again["bf16_video"] == generated[0]["bf16_video"]


STATUS_MEMORY = re.compile(r"quantized spans ([\d.]+) bits/element \(([\d.]+)x\); whole cache ([\d.]+) MB vs "
                           r"([\d.]+) MB BF16 \(([\d.]+)x\)")


def status_memory(status: str) -> dict:
    """The memory figures a status line shows, by their `CacheMemory` names."""
    m = STATUS_MEMORY.search(status)
    assert m, status
    return dict(zip(CacheMemory.FIGURES, map(float, m.groups())))


def test_the_status_line_names_both_compressions_as_cache_memory_counts_them(runs, generated, tmp_path):
    """A built-in run and the same run opened from its run file: the status line's quantized-spans and whole-cache
    figures are the cache's `CacheMemory`, each under its name, and the two compressions differ."""
    from quantwm.drivers.views import make_run
    from quantwm.evaluation.runfile import read_run, run_memory, write_run

    rid = generated[0]["run_id"]
    path = tmp_path / "run.safetensors"
    write_run(path, make_run(runs.wb, RunKey.parse(rid), (), ()))
    opened = wh.open_run_handler(runs, str(path))
    built_in, from_file = runs.wb.record(rid).memory, run_memory(read_run(path).meta)
    assert from_file.figures() == built_in.figures()
    for status, mem in ((generated[0]["status"], built_in), (opened["status"], from_file)):
        assert mem.summary() in status
        shown = status_memory(status)
        assert shown == pytest.approx(mem.figures(), abs=0.0051)
        assert shown["span_compression"] > shown["cache_compression"] > 1  # the spans' 16 / bits is not the cache's


def test_a_kernel_that_failed_its_self_check_shows_in_the_status_line_and_the_run_file(runs, tmp_path, monkeypatch):
    """The self-check's fallbacks (quantwm/core/selfcheck.py; caught kernels are tested in tests/test_selfcheck.py)
    reach the user: the generation's status line says which kernel ran its reference, and so does the run file's
    status when it is opened again."""
    from quantwm.core import selfcheck
    from quantwm.drivers.views import make_run
    from quantwm.evaluation.runfile import write_run

    failed = selfcheck.Verdict("span_attention", "k: channels; v: channels", "bfloat16", "cuda:0", False, 0.5, 0.01,
                               "2 streams x 64 queries x 256 keys x 128")
    monkeypatch.setattr(selfcheck, "_VERDICTS", {("span_attention", failed.layout, "bfloat16", "cuda:0"): failed})
    r = wh.generate_handler(runs, 5, "loop", "kivi", "k", 2, FRAMES)
    assert "KERNEL SELF-CHECK FAILED for 1 kernel(s)" in r["status"] and failed.line() in r["status"]
    path = tmp_path / "run.safetensors"
    write_run(path, make_run(runs.wb, RunKey.parse(r["run_id"]), (), ()))
    monkeypatch.setattr(selfcheck, "_VERDICTS", {})
    assert failed.line() in wh.open_run_handler(runs, str(path))["status"]


def test_generate_at_a_budget_says_what_quantwm_chose_as_a_histogram_of_channel_widths(runs):
    """quantwm's allocator gives each channel its own width: the status shows their shares over every stored span
    (the cache's `channel_bits`), summing to 100%, and the run keeps its budget (no OVER flag)."""
    r = wh.generate_handler(runs, 3, "pan-return", "quantwm", "kv", 2, FRAMES, 2.5)
    assert r["run_id"] == f"seed=3 pan-return quantwm kv budget=2.5 {FRAMES}f" and r["over"] is None
    m = re.search(r"configuration within 2.5 bits: k: allocator, bits per channel ([\d:%< ]+); v: allocator, "
                  r"bits per channel ([\d:%< ]+)\)", r["status"])
    assert m, r["status"]
    widths = runs.wb.record(r["run_id"]).channel_bits
    for kind, shown in zip("kv", m.groups()):
        assert [int(p.split(":")[0]) for p in shown.split()] == sorted(widths[kind])  # every width taken, in order
        assert sum(int(p.split(":")[1][:-1]) for p in shown.split() if "<" not in p) == pytest.approx(100, abs=5)
    assert r["method_label"].startswith("quantwm within 2.5 bits, spans 2.")
    assert studies.bits_histogram({2: 336, 3: 48, 8: 1}) == "bits per channel 2:87% 3:12% 8:<1%"


def spans_measure(monkeypatch, bits: float):
    """Make every comparison report its quantized spans at `bits` bits per element (a run over its budget);
    returns the real `studies.compare`, to put back."""
    real = studies.compare

    def overrun(wb, key, progress=None):
        cmp = real(wb, key, progress)
        return {**cmp, "summary": {**cmp["summary"], "span_bits_per_element": bits}}

    monkeypatch.setattr(studies, "compare", overrun)
    return real


def test_a_run_over_its_budget_or_over_bf16_is_flagged_on_the_generate_tab(runs, monkeypatch):
    """The Generate tab flags as the Methods table does (`memory_flag`): a budget run whose spans measure over
    it, and a fixed-bits run that stores more than BF16 (qvg's "2-bit": 256 centroids per span)."""
    real = spans_measure(monkeypatch, 2.61)
    r = wh.generate_handler(runs, 3, "pan-return", "kivi", "k", 2, FRAMES, 2.5)
    assert r["status"].startswith("**OVER: its quantized spans store 2.61 bits/element, over the budget of 2.5.**")
    assert r["method_label"].endswith("OVER")
    monkeypatch.setattr(studies, "compare", real)
    fixed = wh.generate_handler(runs, 3, "pan-return", "qvg", "kv", 2, FRAMES, sizing="bits")
    assert fixed["status"].startswith("**OVER: it stores more than BF16") and "fixed 2-bit grid" in fixed["status"]
    assert wh.memory_flag({"span_bits_per_element": 2.5, "cache_mb": 1.0, "bf16_mb": 4.0}, 2.5) is None
    assert wh.memory_flag({"span_bits_per_element": 2.0, "cache_mb": 5.0, "bf16_mb": 4.0}, None).startswith(
        "it stores more than BF16")


def test_a_run_over_its_budget_is_never_said_to_be_within_it(runs, monkeypatch):
    """A run whose spans measure over its budget: its label says the budget, not "within" it, and so does the
    status's configuration clause; a run that keeps to it is still "within"."""
    real = spans_measure(monkeypatch, 2.6)
    r = wh.generate_handler(runs, 3, "pan-return", "kivi", "k", 2, FRAMES, 2.5)
    assert r["over"] and r["method_label"] == "kivi budget 2.5 bits, spans 2.60 bits/element OVER"
    assert "configuration within" not in r["status"] and "within 2.5" not in r["status"]
    assert "configuration chosen for a budget of 2.5 bits: k: bits=2, group_size=64" in r["status"]
    monkeypatch.setattr(studies, "compare", real)
    kept = wh.generate_handler(runs, 3, "pan-return", "kivi", "k", 2, FRAMES, 2.5)
    assert kept["over"] is None and kept["method_label"].startswith("kivi within 2.5 bits, spans 2.50 bits/element")
    assert "configuration within 2.5 bits: k: bits=2, group_size=64" in kept["status"]


# ---- BF16 and two methods side by side, on the page's place world ------------------------------------------
SIDE = (6, "loop", "quantwm", "kv", 2, FRAMES, 2.5, "budget")  # the page's world seed and methods, 10 frames


@pytest.fixture(scope="module")
def side_by_side(runs):
    calls = []
    r = wh.generate_handler(runs, *SIDE, progress=lambda done, total: calls.append((done, total)), world="place",
                            method_b="qvg")
    return r, calls


def test_one_generate_shows_bf16_and_two_methods_each_with_its_vbench_flicker(runs, side_by_side):
    """Method A and method B beside it on the place world, from one Generate: the progress bar counts every
    rollout's chunks, each method keeps its label and its line in the status, and each line gives VBench's
    temporal flickering of the run's own frames and of BF16's, from the last context frame on."""
    from quantwm.evaluation.vbench import temporal_flickering

    r, calls = side_by_side
    assert (r["run_id"], r["run_b"]) == ("seed=6 place loop quantwm kv budget=2.5 10f",
                                         "seed=6 place loop qvg kv budget=2.5 10f")
    chunks = FRAMES // runs.wb.cfg.chunk_frames
    assert calls[-1] == (3 * chunks, 3 * chunks)  # BF16, method A and method B
    assert r["method_label"].startswith("quantwm within 2.5 bits, spans ") and r["method_label"].endswith("bits/element")
    assert r["method_b_label"].startswith("qvg within 2.5 bits, spans ") and r["method_b_label"].endswith("bits/element")
    a, b = runs.wb.record(r["run_id"]), runs.wb.record(r["run_b"])
    ref, ctx = runs.wb.record(a.key.reference().id), runs.wb.cfg.context_frames
    flicker = {name: temporal_flickering(rec.frames[ctx - 1:]) for name, rec in (("bf16", ref), ("a", a), ("b", b))}
    line_a, line_b = r["status"].split("\n\n")
    assert line_a.startswith(f"**{r['run_id']}** (") and line_b.startswith(f"Method B: **{r['run_b']}** (")
    assert f"VBench flicker {flicker['a']:.4f} (BF16 {flicker['bf16']:.4f})" in line_a
    assert f"VBench flicker {flicker['b']:.4f} (BF16 {flicker['bf16']:.4f})" in line_b
    assert "configuration within 2.5 bits: k: bits=2" in line_b and "Worst flicker frames:" not in line_b
    for which in ("bf16_video", "method_video", "method_b_video"):
        assert next(imageio_ffmpeg.read_frames(r[which]))["codec"] == "h264"


def test_the_per_frame_plot_overlays_both_methods_on_one_y_range_per_metric(side_by_side):
    """Every panel draws both methods' curves, told apart by colour and named once each in the legend, on one
    fixed y-range that holds both (not a range per run)."""
    r = side_by_side[0]
    fig, labels = r["figure"], (r["method_label"], r["method_b_label"])
    for axis, metric in (("y", "tdiff"), ("y2", "warp_error"), ("y3", "psnr"), ("y4", "shift_rate")):
        curves = {t.legendgroup: t for t in fig.data if t.name == metric}
        assert set(curves) == set(labels) and {t.yaxis for t in curves.values()} == {axis}, metric
        assert curves[labels[0]].line.color != curves[labels[1]].line.color
        scale = fig.layout["yaxis" + axis[1:]]
        values = [v for t in curves.values() for v in t.y if v is not None]
        assert scale.autorange is False and scale.range[0] <= min(values) and max(values) <= scale.range[1], metric
        assert max(values) >= scale.range[1] - 0.1 * (scale.range[1] - scale.range[0])  # the runs' own range
    named = [t.name for t in fig.data if t.showlegend is not False]
    assert named.count(labels[0]) == named.count(labels[1]) == 1


def test_scrub_shows_three_frames_and_draws_the_maps_on_the_run_they_are_of(runs, side_by_side, generated):
    r = side_by_side[0]
    a, b, t = r["run_id"], r["run_b"], FRAMES - 1
    plain = wh.scrub_handler(runs, a, t, [], "all", "all", None, b, "A")
    assert np.array_equal(plain["method"][::4, ::4], runs.view(a).frame(t))
    assert np.array_equal(plain["method_b"][::4, ::4], runs.view(b).frame(t))
    assert np.array_equal(plain["bf16"][::4, ::4], runs.view(b).frame_view(t)["bf16"])
    assert "maps of method A (quantwm)" in plain["status"]
    on_b = wh.scrub_handler(runs, a, t, ["flicker map"], "all", "all", None, b, "B")
    assert np.array_equal(on_b["method"], plain["method"]) and not np.array_equal(on_b["method_b"], plain["method_b"])
    top = np.percentile(runs.view(b).frame_view(t)["flicker"], 99)
    assert "maps of method B (qvg)" in on_b["status"] and f"99th percentile, {top:.4f}" in on_b["status"]
    traced = wh.trace_pixel_handler(runs, a, t, 20, 30, 1, 0, b, "B")["result"]  # a trace of method B's run
    marked = wh.scrub_handler(runs, a, t - 1, [], "all", "all", traced, b, "A")
    assert all((marked[k] != wh.scrub_handler(runs, a, t - 1, [], "all", "all", None, b)[k]).any()
               for k in ("bf16", "method", "method_b"))  # its pixel marked on every frame
    assert wh.scrub_handler(runs, a, t, [])["method_b"] is None
    for run_b, maps, needle in ((None, "B", "with no method B shown"), (b, "C", "maps must be 'A'"),
                                (generated[0]["run_id"], "A", "cannot be shown beside")):
        bad = wh.scrub_handler(runs, a, t, [], "all", "all", None, run_b, maps)
        assert bad["status"].startswith("**Error:**") and needle in bad["status"] and "bf16" not in bad


def test_a_trace_names_the_source_under_each_shown_method_s_keys(runs, side_by_side):
    """A pixel traced in method B's run (its frame clicked) names method A's source at the same Query, layer and
    head too, and the other way round; alone, a run's trace names its own."""
    r = side_by_side[0]
    a, b, t = r["run_id"], r["run_b"], FRAMES - 1
    on_b = wh.trace_pixel_handler(runs, a, t, 21, 42, "all", "all", b, "B")
    res = on_b["result"]
    own, other = (runs.view(i).pixel_trace(t, 21, 42, res["layer"], res["head"]) for i in (b, a))
    assert res["run"] == b and res["source_method"] == list(own["source_method"])
    assert res["other"]["run"] == a and res["other"]["source"] == list(other["source_method"])
    assert res["other"]["jumped"] == (other["source_method"] != other["source_bf16"])
    src, osrc = own["source_method"], other["source_method"]
    assert f"qvg source: frame {src[0]}, row {src[1]}, col {src[2]}" in on_b["status"]
    assert f"quantwm source: frame {osrc[0]}, row {osrc[1]}, col {osrc[2]}" in on_b["status"]
    assert re.search(r"the BF16 source ranks \d+ under qvg's keys, \d+ under quantwm's\.", on_b["status"])
    assert on_b["other_source"].shape == on_b["method_source"].shape == (192, 192, 3)
    on_a = wh.click_pixel_handler(runs, a, t, [21 * wh.FACTOR, 42 * wh.FACTOR], res["layer"], res["head"], b, "A")
    assert on_a["result"]["run"] == a and on_a["result"]["other"]["run"] == b
    assert on_a["result"]["source_method"] == res["other"]["source"]
    assert "other" not in wh.trace_pixel_handler(runs, a, t, 21, 42)["result"]


def test_exports_are_of_the_run_the_maps_are_of(runs, side_by_side):
    r = side_by_side[0]
    a, b, t = r["run_id"], r["run_b"], FRAMES - 1
    traced = wh.trace_pixel_handler(runs, a, t, 21, 42, 1, 0, b, "B")["result"]
    names = [f.rsplit("/", 1)[-1] for f in wh.export_handler(runs, a, t, "all", "all", ["svg"], traced, b, "B")["files"]]
    tag = "seed6-place-loop-qvg-kv-budget2.5-10f"
    assert sorted(names) == sorted([f"frames-{tag}.svg", f"maps-{tag}-frame{t}-layerall-headall.svg",
                                    f"trace-{tag}-frame{t}-x21-y42-layer1-head0.svg"]), names
    names = [f.rsplit("/", 1)[-1] for f in wh.export_handler(runs, a, t, "all", "all", ["svg"], traced, b, "A")["files"]]
    assert sorted(n.split("-")[0] for n in names) == ["frames", "maps"] and all("-quantwm-" in n for n in names)


def test_a_method_b_that_cannot_run_is_left_out_and_method_a_shown(runs, side_by_side):
    """nvfp4 cannot store 2.5 bits per element, and a results cache that holds BF16 and one method's run has no
    room for a second: method A is shown and the status says why B is not; method B set to method A is shown
    once; an unknown method B is an error naming it."""
    r = wh.generate_handler(runs, *SIDE, world="place", method_b="nvfp4")
    assert r["run_id"] == side_by_side[0]["run_id"] and r["run_b"] == "" and r["method_b_video"] is None
    assert "\n\nMethod B, nvfp4, is left out: nvfp4 cannot fit 2.5 bits per element" in r["status"]
    same = wh.generate_handler(runs, *SIDE, world="place", method_b="quantwm")
    assert same["run_b"] == "" and same["status"].endswith("Method B is method A (quantwm): shown once.")
    from dataclasses import replace

    from quantwm.evaluation.limits import run_bytes

    small = replace(runs.wb.limits, cache_mb=2.5 * run_bytes(runs.wb.cfg, FRAMES) / 2 ** 20)  # BF16 and one method
    alone = wh.generate_handler(RunRegistry(Workbench(model=runs.wb.model, limits=small)), *SIDE, world="place",
                                method_b="qvg")
    assert alone["run_id"] == r["run_id"] and alone["run_b"] == ""
    assert "Method B, qvg, is left out: 2 methods at 10 frames do not fit in the results cache" in alone["status"]
    bad = wh.generate_handler(runs, *SIDE, world="place", method_b="nope")
    assert bad["status"].startswith("**Error:**") and "unknown method 'nope'" in bad["status"]
    assert wh.generate_handler(runs, *SIDE, world="mars")["status"].startswith("**Error:** unknown world 'mars'")


def test_a_run_file_opens_beside_another_of_the_same_generation_as_method_b(runs, side_by_side, generated, tmp_path):
    """Two methods recorded from the same world and noise, each its own run file: the second opens beside the
    first as method B, and every view takes the pair; a file of another generation cannot stand beside it."""
    from quantwm.drivers.views import make_run
    from quantwm.evaluation.runfile import write_run

    r = side_by_side[0]
    paths = {}
    for name, rid in (("a", r["run_id"]), ("b", r["run_b"]), ("other", generated[0]["run_id"])):
        paths[name] = tmp_path / f"{name}.safetensors"
        write_run(paths[name], make_run(runs.wb, RunKey.parse(rid), (1,), (0,)))
    ids = {name: wh.open_run_handler(runs, str(path))["run_id"] for name, path in paths.items()}
    shown = wh.open_run_handler(runs, ids["a"], files=False, run_b=ids["b"])
    assert shown["run_b"] == ids["b"] and "Method B: **file=b.safetensors qvg kv 2-bit** (opened:" in shown["status"]
    assert shown["controls"]["world"] == "place" and shown["method_b_label"].startswith("qvg 2-bit, spans ")
    assert [t.legendgroup for t in shown["figure"].data if t.name == "tdiff"] == [shown["method_label"],
                                                                                   shown["method_b_label"]]
    trace = wh.trace_pixel_handler(runs, ids["a"], FRAMES - 1, 21, 42, 1, 0, ids["b"], "B")
    assert trace["result"]["run"] == ids["b"] and trace["result"]["other"]["method"] == "quantwm"
    refused = wh.open_run_handler(runs, ids["a"], files=False, run_b=ids["other"])
    assert refused["status"].startswith("**Error:**") and "cannot be shown beside" in refused["status"]


@pytest.mark.parametrize("settings, needle", [
    ((3, "pan-return", "nope", "k", 2, FRAMES), "unknown method 'nope'"),
    ((3, "spiral", "qvg", "k", 2, FRAMES), "unknown trajectory"),
    ((3, "loop", "qvg", "k", 2, 7), "frames must exceed 4 by a multiple of 2"),
    ((3, "loop", "qvg", "k", 5, FRAMES), "bits"),
    (("x", "loop", "qvg", "k", 2, FRAMES), "world seed must be an integer, got 'x'"),
])
def test_generate_bad_input_is_a_message(runs, settings, needle):
    r = wh.generate_handler(runs, *settings)
    assert r["status"].startswith("**Error:**") and needle in r["status"] and r.get("run_id") is None


def test_a_bad_frame_count_names_the_valid_ones(runs):
    top = runs.wb.limits.max_frames - (runs.wb.limits.max_frames - 4) % 2
    status = wh.generate_handler(runs, 3, "loop", "qvg", "k", 2, 7)["status"]
    assert f"frames must exceed 4 by a multiple of 2: 6, 8, 10, ... up to {top} on this server; got 7" in status


def test_scrub_enlarges_both_frames_and_overlays_change_only_the_method_frame(runs, generated):
    rid, t = generated[0]["run_id"], FRAMES - 1
    plain = wh.scrub_handler(runs, rid, t, [])
    assert plain["bf16"].shape == (256, 256, 3) and plain["method"].shape == (256, 256, 3)
    assert np.array_equal(plain["bf16"][::4, ::4], runs.view(rid).frame_view(t)["bf16"])  # nearest-neighbour 4x
    both = wh.scrub_handler(runs, rid, t, list(wh.OVERLAYS), "all", "all")
    assert np.array_equal(both["bf16"], plain["bf16"]) and not np.array_equal(both["method"], plain["method"])
    assert f"Frame **{t}**" in both["status"] and "top-1 moved" in both["status"]
    assert "overlays: red flicker map from 0 to full at this frame's 99th percentile" in both["status"]  # its scale
    assert "(above BF16's, per pixel; 0 = BF16, lower is better)" in both["status"]
    assert "cyan: a token whose top-1 source moved in at least half of the chosen layers and heads" in both["status"]
    assert "overlays:" not in plain["status"]
    warp = wh.scrub_handler(runs, rid, t, ["warping error"])  # the motion-compensated flicker overlay alone
    assert "mean warping error" in warp["status"] and not np.array_equal(warp["method"], plain["method"])
    assert np.array_equal(wh.scrub_handler(runs, rid, 0, ["warping error", "flicker map"])["method"],
                          wh.scrub_handler(runs, rid, 0, [])["method"])  # frame 0: no previous frame, nothing to tint
    ctx = wh.scrub_handler(runs, rid, 2, ["top-1 jumps"])
    assert "context" in ctx["status"] and "no top-1 jump map" in ctx["status"]


def test_overlays_are_scaled_to_their_frame_and_the_top1_map_is_thresholded(runs, generated):
    """Flicker is tinted full red from the frame's own 99th percentile (a frame of small flicker still shows), the
    top-1 overlay tints only tokens that moved in at least half the chosen layers and heads."""
    rid, t = generated[0]["run_id"], FRAMES - 1
    v = runs.view(rid).frame_view(t)
    top = float(np.percentile(v["flicker"], 99))
    r = wh.scrub_handler(runs, rid, t, ["flicker map"])
    assert f"99th percentile, {top:.4f}" in r["status"]
    bar = r["scale"]  # the key: grey at 0 on the left, full red at the 99th percentile on the right
    assert bar.shape == (30, 256, 3) and bar[20, 0].tolist() == [128, 128, 128]
    assert np.abs(bar[20, -1].astype(int) - (np.array(wh.media.RED) * 0.85 + 128 * 0.15)).max() <= 1
    assert wh.scrub_handler(runs, rid, t, [])["scale"] is None
    assert wh.scrub_handler(runs, rid, t, ["flicker map", "warping error"])["scale"].shape[0] in (30, 60)
    plain = wh.scrub_handler(runs, rid, t, [])["method"]
    full = (v["flicker"] >= top).repeat(wh.FACTOR, 0).repeat(wh.FACTOR, 1)  # full red at or above the 99th
    expect = (plain[full].astype(np.float32) * 0.15 + np.float32(wh.media.RED) * 0.85).round()
    assert full.mean() >= 0.005 and np.abs(r["method"][full].astype(np.float32) - expect).max() <= 1
    jumps = wh.scrub_handler(runs, rid, t, ["top-1 jumps"], "all", "all")
    share = v["jumps"]
    tinted = (jumps["method"] != plain).any(-1)
    cell = tinted.shape[0] // share.shape[0]
    assert np.array_equal(tinted[::cell, ::cell], share >= wh.JUMP_SHARE)
    assert f"at least half the chosen layers and heads: {float((share >= 0.5).mean()):.1%}" in jumps["status"]


def test_the_traced_pixel_is_marked_on_both_frames(runs, generated):
    rid, t = generated[0]["run_id"], FRAMES - 1
    traced = wh.trace_pixel_handler(runs, rid, t, 20, 30, 1, 0)["result"]
    plain, marked = wh.scrub_handler(runs, rid, t - 1, []), wh.scrub_handler(runs, rid, t - 1, [], traced=traced)
    for side in ("bf16", "method"):
        changed = (marked[side] != plain[side]).any(-1)
        ys, xs = np.nonzero(changed)
        assert changed.any() and (marked[side][changed] == wh.media.YELLOW).all()
        assert ys.min() < 30 * wh.FACTOR < ys.max() and xs.min() < 20 * wh.FACTOR < xs.max()  # around the pixel
    assert "yellow square: the traced pixel (20, 30)" in marked["status"]
    other = wh.scrub_handler(runs, rid, t, [], traced={**traced, "run": "seed=9 loop rtn kv 2-bit 10f"})
    assert "traced pixel" not in other["status"]


@pytest.mark.parametrize("run_id, frame, overlays, needle", [
    ("{rid}", FRAMES, [], "frame 10 out of range"),
    ("{rid}", -1, [], "out of range"),
    ("{rid}", None, [], "no frame given"),
    ("{rid}", 5, ["sparkles"], "unknown overlay"),
    ("", 5, [], "Generate a run first"),
    ("seed=1 loop rtn kv 2-bit 10f", 5, [], "press Generate"),
])
def test_scrub_bad_input_is_a_message(runs, generated, run_id, frame, overlays, needle):
    r = wh.scrub_handler(runs, run_id.format(rid=generated[0]["run_id"]), frame, overlays)
    assert r["status"].startswith("**Error:**") and needle in r["status"] and "bf16" not in r


def assert_markers_on_maxima(fig):
    """The BF16 / method top-1 markers sit on the maximum of the BF16 / method logit heatmap."""
    heat = [t for t in fig.data if t.type == "heatmap"]
    marks = [t for t in fig.data if t.type == "scatter"][:2]
    for z, mark in zip((np.asarray(heat[0].z), np.asarray(heat[1].z)), marks):
        assert z[mark.y[0], mark.x[0]] == z.max()


def test_one_picker_all_traces_the_first_layer_and_head_whose_top1_moved(runs, generated):
    """The page's one layer/head picker on "all" (or one of the two on "all"): the trace takes the first
    (layer, head) in order whose top-1 moved at the Query, says so, and equals the trace asked for by number."""
    rid = generated[0]["run_id"]
    view = runs.view(rid)
    L, H = view.facts.layers, view.facts.heads
    for x, y, head in ((45, 10, "all"), (20, 30, "all"), (45, 10, 2)):
        moved = [(la, h) for la in range(L) for h in range(H) if head in ("all", h)
                 and view.pixel_trace(FRAMES - 1, x, y, la, h)["jumped"]]
        r = wh.trace_pixel_handler(runs, rid, FRAMES - 1, x, y, "all", head)
        res = r["result"]
        first = moved[0] if moved else (0, 0 if head == "all" else head)
        assert (res["layer"], res["head"]) == first
        assert ("whose top-1 moved at this Query" if moved else "no top-1 moved at this Query") in r["status"]
        assert wh.trace_pixel_handler(runs, rid, FRAMES - 1, x, y, *first)["result"] == res


def test_trace_pixel_twin_and_click_agree(runs, generated):
    rid = generated[0]["run_id"]
    twin = wh.trace_pixel_handler(runs, rid, FRAMES - 1, 45, 10, 2, 1)
    click = wh.click_pixel_handler(runs, rid, FRAMES - 1, [45 * wh.FACTOR + 3, 10 * wh.FACTOR + 1], 2, 1)
    assert twin["result"] == click["result"]
    res = twin["result"]
    assert res["query"] == [FRAMES - 1, 1, 5] and res["layer"] == 2 and res["head"] == 1
    assert res["jumped"] == (res["source_bf16"] != res["source_method"])
    assert f"frame {res['source_bf16'][0]}, row {res['source_bf16'][1]}" in twin["status"]
    assert twin["query_image"].shape == twin["bf16_source"].shape == (192, 192, 3)
    band = twin["bf16_source"][:14, :60]  # its frame label: light text on a black band in the corner
    assert (band == 0).all(-1).mean() > 0.3 and (band >= 200).all(-1).any()
    kinds = [t.type for t in twin["figure"].data]
    assert kinds.count("heatmap") == 3
    assert_markers_on_maxima(twin["figure"])


@pytest.mark.parametrize("frame, x, y, layer, needle", [
    (FRAMES - 1, 64, 3, 0, "outside the 64x64 frame"),
    (FRAMES - 1, 3, -2, 0, "outside"),
    (FRAMES + 5, 3, 3, 0, "out of range"),
    (1, 3, 3, 0, "context frame"),
    (FRAMES - 1, 3, 3, 4, "layer 4 out of range"),
    (FRAMES - 1, 3, 3, "top", "layer must be 'all' or an integer"),
    (FRAMES - 1, None, 3, 0, "no x given"),
])
def test_trace_pixel_bad_input_is_a_message(runs, generated, frame, x, y, layer, needle):
    r = wh.trace_pixel_handler(runs, generated[0]["run_id"], frame, x, y, layer, 0)
    assert r["status"].startswith("**Error:**") and needle in r["status"] and "figure" not in r


def test_click_outside_the_enlarged_frame_is_a_message(runs, generated):
    r = wh.click_pixel_handler(runs, generated[0]["run_id"], FRAMES - 1, [64 * wh.FACTOR + 2, 5], 0, 0)
    assert r["status"].startswith("**Error:**") and "outside" in r["status"]


def test_energy_handler_table_and_bad_layer(runs, wb, generated):
    r = wh.energy_handler(runs, generated[0]["run_id"], 1)
    assert r["header"][0] == "layer" and len(r["rows"]) == wb.cfg.layers and len(r["rows"][0]) == 1 + wb.cfg.heads
    assert "top 8 of 64" in r["status"] and len(r["figure"].data) == 2 * wb.cfg.heads
    data = r["figure"].data  # one colour per head in both panels, and one legend entry per head
    assert all(data[2 * h].line.color == data[2 * h + 1].line.color for h in range(wb.cfg.heads))
    assert len({data[2 * h].line.color for h in range(wb.cfg.heads)}) == wb.cfg.heads
    assert sum(bool(t.showlegend is not False) for t in data) == wb.cfg.heads
    assert wh.energy_handler(runs, generated[0]["run_id"], 9)["status"].startswith("**Error:** layer 9")


def test_key_value_handler_runs_several_seeds_at_one_budget_and_its_sentence_holds_to_its_table(runs):
    """Two seeds, kivi beside quantwm, within 2.5 bits: per-seed rows and a mean ± sd row per (method, target); the
    sentence's every-seed claims agree with the per-seed numbers of the table on every metric it names."""
    calls = []
    r = sh.key_value_handler(runs, 3, "pan-return", "kivi", 2.5, FRAMES, 2, progress=lambda a, n: calls.append((a, n)))
    h = r["header"]
    assert h == list(sh.KV_COLUMNS) and calls[-1][0] == calls[-1][1]  # progress reached its end
    assert [row[:3] for row in r["rows"]] == [[m, t, s] for m in ("kivi", "quantwm") for t in "kv"
                                             for s in (3, 4, "mean ± sd")]
    per_seed = [row for row in r["rows"] if row[2] != "mean ± sd"]
    for row in per_seed:  # Keys-only leaves V exact, Values-only leaves K exact
        assert row[h.index("v_rel_err" if row[1] == "k" else "k_rel_err")] == 0
    assert "Within 2.5 bits per element, seeds 3-4" in r["status"]
    for method in ("kivi", "quantwm"):
        part = r["status"].split(f"{method}, 2 seed(s): ")[1].split(" quantwm, 2 seed(s)")[0]
        ks = [dict(zip(h, row)) for row in per_seed if row[0] == method and row[1] == "k"]
        vs = [dict(zip(h, row)) for row in per_seed if row[0] == method and row[1] == "v"]
        for col, name, sign in sh.KV_DAMAGE:  # judged on the table's numbers, as the sentence is
            worse = sum(sh.keys_hurt_more(k, v, col, sign) for k, v in zip(ks, vs))
            better = sum(sh.keys_hurt_more(v, k, col, sign) for k, v in zip(ks, vs))
            clause = ("Keys only does more damage on every seed in" if worse == 2 else
                      "Values only does more damage on every seed in" if better == 2 else
                      "The two are equal on every seed in" if worse == better == 0 else "Seeds disagree on")
            sentence = next(x for x in part.split(". ") if x.startswith(clause))
            assert name in sentence, (method, name, worse, part)
    data = r["figure"].data
    assert {t.name for t in data} == {"Keys only", "Values only"} and len(data) == 2 * 9  # every metric charted
    assert sh.key_value_handler(runs, 3, "loop", "bf16", 2.5, FRAMES, 2)["status"].startswith("**Error:** bf16")
    assert "seeds must lie in 1..16" in sh.key_value_handler(runs, 3, "loop", "kivi", 2.5, FRAMES, 0)["status"]


def test_kv_finding_is_computed_from_the_numbers():
    def row(**kw):
        return {"k_rel_err": 0.03, "v_rel_err": 0.15, "psnr": 30.0, "ssim": 0.9, "tdiff": 0.02, "lpips": 0.01,
                "place_shift_rate": 0.1, "attn_out_rel_err": 0.1, **kw}

    ks = [row(psnr=26.0, place_shift_rate=0.3, lpips=0.012), row(psnr=31.0, place_shift_rate=0.2, lpips=0.012)]
    vs = [row(k_rel_err=0, v_rel_err=0.15, tdiff=0.03, lpips=0.012, attn_out_rel_err=0.2),
          row(k_rel_err=0, v_rel_err=0.15, tdiff=0.05, lpips=0.01200004, attn_out_rel_err=0.2)]
    text = sh._kv_finding("kivi", ks, vs)
    assert "Keys only does more damage on every seed in place shift." in text
    assert "Values only does more damage on every seed in flicker (tdiff), output error." in text
    # LPIPS differs on seed 2 only past the table's 4 decimals: equal as shown, so equal in the sentence
    assert "The two are equal on every seed in SSIM, LPIPS." in text
    assert "Seeds disagree on PSNR (Keys only worse on 1, Values only on 1)" in text
    assert "holds on every seed in place shift, not in PSNR, SSIM, flicker (tdiff), LPIPS, output error." in text
    assert "premise does not hold" in sh._kv_finding("rtn", [row(k_rel_err=0.3)] * 2, vs)


def test_methods_handler(runs):
    r = sh.methods_handler(runs, 3, "pan-return", "k", FRAMES, ["qvg-budget", "rtn"], 2.5)
    h = r["header"]
    assert sorted(row[0] for row in r["rows"]) == ["qvg-budget", "rtn"] and h[0] == "method"
    assert all(row[h.index("fits")] == "yes" for row in r["rows"]) and "Two compressions" in r["status"]
    assert "bf16_mb" not in h and "bf16_mb " in r["status"]  # one world: the same in every row, named once
    for c in h:  # every shown numeric column differs between the rows
        if c not in sh.TEXT_COLUMNS:
            assert len({row[h.index(c)] for row in r["rows"]}) > 1, c
    assert [t.name for t in r["figure"].data] == r["metrics"] and set(r["metrics"]) <= set(h)  # the table's metrics
    assert "unknown method" in sh.methods_handler(runs, 3, "loop", "k", FRAMES, ["zzz"], 2.5)["status"]
    assert "at least one method" in sh.methods_handler(runs, 3, "loop", "k", FRAMES, [], 2.5)["status"]
    for bad in (0, -1, 17, "x", None):
        assert "budget must be a number of bits per element in (0, 16]" in sh.methods_handler(
            runs, 3, "loop", "k", FRAMES, ["rtn"], bad)["status"]


def test_a_row_over_the_budget_or_over_bf16_is_flagged(runs, monkeypatch):
    real = studies.methods_table

    def inflated(wb, key, methods, progress=None, left_out=None):  # as if a method overran what it measured
        rows = real(wb, key, methods, progress, left_out)
        return [{**r, "span_bits_per_element": r["span_bits_per_element"] + 1} for r in rows]

    monkeypatch.setattr(studies, "methods_table", inflated)
    r = sh.methods_handler(runs, 3, "pan-return", "k", FRAMES, ["rtn"], 2.5)
    assert [row[r["header"].index("fits")] for row in r["rows"]] == ["OVER"] and "**OVER**" in r["status"]


def test_the_methods_chart_names_every_bar_and_its_title_counts_only_the_methods_within(runs, monkeypatch):
    """Each row's bar is named on the chart, every name a tick of its own on a line of its own height (none left
    out for room), and the title counts the methods within the budget, naming those over it apart."""
    real = studies.methods_table

    def two_over(wb, key, methods, progress=None, left_out=None):
        rows = real(wb, key, methods, progress, left_out)
        return [{**r, "span_bits_per_element": 2.6} if r["method"] in ("rtn", "kivi") else r for r in rows]

    monkeypatch.setattr(studies, "methods_table", two_over)
    r = sh.methods_handler(runs, 3, "pan-return", "k", FRAMES, ["qvg-budget", "rtn", "kivi"], 2.5)
    fits = {row[0]: row[r["header"].index("fits")] for row in r["rows"]}
    assert fits == {"qvg-budget": "yes", "rtn": "OVER", "kivi": "OVER"}
    labels = [m + (" (OVER)" if fits[m] == "OVER" else "") for m in fits]
    over = ", ".join(m for m in fits if fits[m] == "OVER")
    fig = r["figure"]
    assert fig.layout.title.text == f"1 method within 2.5 bits per element, 2 over: {over}: seed 3, pan-return, target k"
    assert len(fig.data) == len(r["metrics"]) >= 2
    for bars in fig.data:  # one bar per row in every panel, on the panels' shared axis of names
        assert bars.orientation == "h" and list(bars.y) == labels
    axis = fig.layout.yaxis
    assert axis.tickmode == "array" and list(axis.tickvals) == labels and list(axis.ticktext) == labels
    margin = fig.layout.margin
    assert (fig.layout.height - margin.t - margin.b) / len(labels) >= plots.BAR_ROW_PX


def test_quantwm_and_quantwm_alloc_are_one_row_at_a_budget(runs):
    """At a budget quantwm runs as its allocator, quantwm-alloc (`at_budget`): chosen together, their one run is
    shown once and the row says so, in the table and on the chart."""
    assert studies.at_budget_name("quantwm") == "quantwm-alloc" and studies.at_budget_name("rtn") == "rtn"
    assert studies.at_budget_name("quantwm+jensen") == "quantwm-alloc+jensen"
    r = sh.methods_handler(runs, 3, "pan-return", "k", FRAMES, ["quantwm", "quantwm-alloc", "rtn"], 2.5)
    names = [row[0] for row in r["rows"]]
    assert sorted(names) == ["quantwm (= quantwm-alloc at a budget)", "rtn"], names
    assert all(list(bars.y) == names for bars in r["figure"].data)
    alone = sh.methods_handler(runs, 3, "pan-return", "k", FRAMES, ["quantwm-alloc", "rtn"], 2.5)
    assert sorted(row[0] for row in alone["rows"]) == ["quantwm-alloc", "rtn"]  # one of the two: its own name


def test_the_exported_methods_figure_shows_what_the_table_shows(runs, monkeypatch):
    """Same methods (those left out of the table too), metric columns and OVER flags; a method that cannot fit
    the budget does not fail the export (int8k-fp8v at 2.5 bits)."""
    real = studies.methods_table

    def one_over(wb, key, methods, progress=None, left_out=None):
        rows = real(wb, key, methods, progress, left_out)
        return [{**r, "span_bits_per_element": 2.51} if r["method"] == "rtn" else r for r in rows]

    from quantwm.evaluation import figures as FG

    monkeypatch.setattr(studies, "methods_table", one_over)
    saved, save = [], FG.save_figure
    monkeypatch.setattr(FG, "save_figure", lambda fig, stem, formats: saved.append(fig) or save(fig, stem, formats))
    chosen = ["qvg-budget", "rtn", "int8k-fp8v"]
    shown = sh.methods_handler(runs, 3, "pan-return", "k", FRAMES, chosen, 2.5)
    m = sh.export_methods_handler(runs, 3, "pan-return", "k", FRAMES, chosen, 2.5, ["svg"])
    h = shown["header"]
    assert m["shown"] == {"methods": [row[0] for row in shown["rows"]], "metrics": shown["metrics"],
                          "fits": [row[h.index("fits")] for row in shown["rows"]]}
    assert m["shown"]["fits"] == ["yes", "OVER"] and "int8k-fp8v" not in m["shown"]["methods"]
    assert m["files"][0].rsplit("/", 1)[-1] == "methods-qvg-budget-rtn-seed3-pan-return-k-budget2.5.svg"
    axes = saved[0].axes
    assert [ax.get_title() for ax in axes] == shown["metrics"]
    assert [t.get_text() for t in axes[0].get_xticklabels()] == ["qvg-budget", "rtn (OVER)"]


def test_trace_inspect_and_energy_handlers(small_trace_path, tmp_path):
    r = handlers.trace_inspect_handler(str(small_trace_path), "qvg", "k", 2, 1, 0, 70)
    assert "query 70 (frame 13, row 0, col 6)" in r["status"] and r["result"]["query"] == [13, 0, 6]
    assert r["jump_image"].shape == (256, 256, 3) and [t.type for t in r["figure"].data].count("heatmap") == 3
    assert_markers_on_maxima(r["figure"])
    wide = tmp_path / "wide.safetensors"  # a non-square token grid
    make_synthetic_trace(seed=1, n_layers=1, n_heads=2, grid=(4, 6), cached_frames=6, chunk_frames=2).save(wide)
    assert_markers_on_maxima(handlers.trace_inspect_handler(str(wide), "rtn", "k", 2, 0, 1, 3)["figure"])
    e = handlers.trace_energy_handler(str(small_trace_path), 1)
    assert "top-8 energy fraction" in e["status"] and e["figure"] is not None
    garbage = tmp_path / "bad.safetensors"
    garbage.write_bytes(b"not a trace")
    for result in (handlers.trace_inspect_handler(str(garbage), "qvg", "k", 2, 0, 0, 0),
                   handlers.trace_energy_handler(str(garbage), 0)):
        assert result["status"].startswith("**Error:**") and "not a valid QuantWM trace" in result["status"]
    assert "unknown method" in handlers.trace_inspect_handler(str(small_trace_path), "zz", "k", 2, 0, 0, 0)["status"]
    assert "out of range" in handlers.trace_inspect_handler(str(small_trace_path), "qvg", "k", 2, 0, 5, 0)["status"]
    assert handlers.trace_inspect_handler(None, "qvg", "k", 2, 0, 0, 0)["status"] == "**Error:** no trace file given."


def test_clicking_the_trace_query_frame_selects_that_token_s_query(small_trace_path):
    """The jump image shows query 70's frame (13) enlarged 4x, 8 pixels per token: a click at (98, 66) is
    token row 2, col 3 of frame 13, i.e. query 64 + 2 * 8 + 3 = 83."""
    r = handlers.trace_click_handler(str(small_trace_path), "qvg", "k", 2, 1, 0, 70, [98, 66])
    assert r["query_index"] == 83 and r["result"]["query"] == [13, 2, 3] and "query 83" in r["status"]
    direct = handlers.trace_inspect_handler(str(small_trace_path), "qvg", "k", 2, 1, 0, 83)
    assert r["result"] == direct["result"]
    for index, needle in (([300, 10], "outside the 64x64 frame"), (None, "no pixel clicked")):
        bad = handlers.trace_click_handler(str(small_trace_path), "qvg", "k", 2, 1, 0, 70, index)
        assert bad["status"].startswith("**Error:**") and needle in bad["status"] and "query_index" not in bad


def test_export_handlers_write_print_figures_and_refuse_bad_input(runs, generated):
    rid = generated[0]["run_id"]
    traced = wh.trace_pixel_handler(runs, rid, FRAMES - 1, 10, 20, 1, 0)["result"]
    r = wh.export_handler(runs, rid, FRAMES - 1, "all", "all", ["svg"], traced)
    assert sorted(f.rsplit("/", 1)[-1].split("-")[0] for f in r["files"]) == ["frames", "maps", "trace"]
    bare = wh.export_handler(runs, rid, 1, "all", "all", ["png"])  # no trace in the panel: none exported
    assert sorted(f.rsplit("/", 1)[-1].split("-")[0] for f in bare["files"]) == ["frames", "maps"]
    assert wh.export_handler(runs, rid, FRAMES - 1, "all", "all", ["gif"])["status"].startswith(
        "**Error:** unknown figure format")
    assert wh.export_handler(runs, "not a run", 5)["status"].startswith("**Error:** 'not a run' is not a run id")
    assert "frame 99 out of range" in wh.export_handler(runs, rid, 99)["status"]
    e = wh.export_energy_handler(runs, rid, 2, ["pdf"])
    assert [f.rsplit("/", 1)[-1] for f in e["files"]] == [f"energy-seed3-pan-return-qvg-budget-k-2bit-{FRAMES}f-layer2.pdf"]
    assert wh.export_energy_handler(runs, rid, 9, ["pdf"])["status"].startswith("**Error:** layer 9 out of range")
    m = sh.export_methods_handler(runs, 3, "pan-return", "k", FRAMES, ["qvg-budget", "rtn"], 2.5, ["pdf"])
    assert len(m["files"]) == 1 and m["files"][0].endswith("-budget2.5.pdf") and "methods-" in m["files"][0]
    assert sh.export_methods_handler(runs, 3, "pan-return", "k", FRAMES, [], 2.5, ["pdf"])["status"].startswith("**Error:** choose")


def test_export_writes_what_each_panel_shows(runs, generated):
    """The trace from the trace panel (its frame, pixel, layer, head, not the slider's frame), the maps from the
    slider's frame with the jump-map pickers' layer and head, and no trace of another run."""
    rid = generated[0]["run_id"]
    traced = wh.trace_pixel_handler(runs, rid, FRAMES - 2, 12, 40, 1, 1)["result"]
    r = wh.export_handler(runs, rid, FRAMES - 1, 2, "all", ["svg"], traced)  # the slider moved on since
    names = [f.rsplit("/", 1)[-1] for f in r["files"]]
    assert any(n.startswith("trace-") and n.endswith(f"-frame{FRAMES - 2}-x12-y40-layer1-head1.svg") for n in names)
    assert any(n.startswith("maps-") and n.endswith(f"-frame{FRAMES - 1}-layer2-headall.svg") for n in names)
    stale = {**traced, "run": "seed=9 loop rtn kv 2-bit 10f"}  # a trace of another run is not this run's
    assert wh.trace_of(stale, rid) is None and wh.trace_of(traced, rid) is traced and wh.trace_of(None, rid) is None
    r = wh.export_handler(runs, rid, FRAMES - 1, "all", "all", ["svg"], stale)
    assert not any(f.rsplit("/", 1)[-1].startswith("trace-") for f in r["files"])


def test_a_new_run_empties_the_trace_panel_and_exports_of_the_run_before(runs, generated):
    """The tab's hook after a run is shown (`_views_of`): another run's trace, heatmap and exports are emptied;
    the trace of the run shown stays. A trace error empties the panel under its Error line."""
    from types import SimpleNamespace

    from app.playback_tab import _trace_outputs, _views_of

    rid = generated[0]["run_id"]
    traced = wh.trace_pixel_handler(runs, rid, FRAMES - 1, 10, 20, 1, 0)["result"]
    ui = SimpleNamespace(trace_out=[None] * 7, export_status=None, export_files=None)  # the panel, the other source too
    views_of = _views_of(ui, wh.trace_of)
    assert len(ui.views_out) == 9
    cleared = views_of("seed=9 loop rtn kv 2-bit 10f", traced)
    assert "seed=9 loop rtn kv 2-bit 10f" in cleared[0] and cleared[1:] == (None,) * 6 + ("", None)
    import gradio as gr

    assert views_of(rid, traced) == (gr.skip(),) * 9  # this run's trace: nothing changes
    assert views_of("seed=9 loop rtn kv 2-bit 10f", traced, rid) == (gr.skip(),) * 9  # shown as method B: it stays
    bad = _trace_outputs(wh.trace_pixel_handler(runs, rid, FRAMES - 1, 99, 3, 0, 0))
    assert bad[0].startswith("**Error:**") and bad[1:] == (None,) * 6


def test_the_per_frame_plot_tells_revisits_from_invented_places(wb, generated):
    from app.plots import _coverage_runs, frame_series_figure

    assert _coverage_runs([1, 1, 1, 0.5, 0.2, 1, 1], 2) == [("memory", 2, 2), ("invented", 3, 4), ("memory", 5, 6)]
    key = RunKey.parse(generated[0]["run_id"])
    seen = studies.compare(wb, key)["series"]["seen_by_context"]
    ctx = wb.model_facts()["context_frames"]
    assert len(seen) == FRAMES and seen[:ctx] == [1.0] * ctx and all(0 <= s <= 1 for s in seen)
    fig = frame_series_figure({"tdiff": [0.0] * 6, "seen_by_context": [1, 1, 1, 0.5, 1, 0.0]}, [], 2)
    names = {t.name for t in fig.data}
    assert any("should match" in n for n in names) and any("invented by the model" in n for n in names)
    assert len(fig.layout.shapes) == 1 + 4  # the context, then memory / invented / memory / invented


def test_the_logit_heatmaps_legend_shows_its_markers_in_visible_colours():
    """The BF16 top-1 marker is white on the heatmap; its legend entry is drawn dark (white on the legend's white
    background did not show), and the legend names each marker once."""
    from app.plots import logit_heatmaps_figure

    z = np.arange(12.0).reshape(3, 4)
    fig = logit_heatmaps_figure(z, z[::-1].copy(), (2, 1, 1), (0, 1, 1), "kivi", 2)
    legend = [t for t in fig.data if t.showlegend is not False and t.type == "scatter"]
    assert [t.name for t in legend] == ["BF16 top-1 (white circle)", "kivi top-1 (red cross)"]
    assert all(t.marker.color not in ("white", "#ffffff") for t in legend)
    assert [t.marker.color for t in fig.data if t.type == "scatter" and t.x[0] is not None][:2] == ["white", "red"]


def test_kv_finding_quotes_the_tables_means_and_weighs_ssim():
    """The sentence's mean errors are the table's mean ± sd means, of the unrounded values (0.029216 and 0.029224:
    0.02922, where averaging the 4-decimal values gave 0.0292), and SSIM is weighed like every damage metric."""
    def row(**kw):
        return {"k_rel_err": 0.029216, "v_rel_err": 0.0, "psnr": 30.0, "ssim": 0.9, "tdiff": 0.02, "lpips": 0.01,
                "place_shift_rate": 0.1, "attn_out_rel_err": 0.1, **kw}

    ks = [row(), row(k_rel_err=0.029224)]
    vs = [row(k_rel_err=0.0, v_rel_err=0.15, ssim=0.8), row(k_rel_err=0.0, v_rel_err=0.17, ssim=0.85)]
    text = sh._kv_finding("kivi", ks, vs)
    assert "Key error 0.02922 (Keys only) vs Value error 0.16 (Values only)" in text, text
    assert sh._mean_sd([0.029216, 0.029224]).startswith("0.02922 ± ")  # the table's mean cell
    assert "Values only does more damage on every seed in SSIM." in text, text
    assert "The two are equal on every seed in PSNR, flicker (tdiff), LPIPS, place shift, output error." in text


def test_the_key_value_chart_keeps_its_legend_clear_of_the_panel_titles():
    """The legend stands right of the panels, where no panel's title is (above them it covered the first's)."""
    metrics = [("k_rel_err", "Key error (Keys only)"), *[(c, name) for c, name, _ in sh.KV_DAMAGE]]
    by = {(m, t): [{c: 0.1 + s for c, _ in metrics} for s in range(2)] for m in ("kivi", "quantwm") for t in "kv"}
    fig = plots.key_value_figure(by, metrics, "Keys only (k) vs Values only (v)")
    titles = [a for a in fig.layout.annotations if a.text in {name for _, name in metrics}]
    assert len(titles) == len(metrics) and all(a.x <= 1 for a in titles)  # every title over its panel
    legend = fig.layout.legend
    assert legend.xanchor == "left" and (legend.x or 0) >= 1  # the legend starts right of every panel


def test_trace_analysis_compares_at_one_budget_and_flags_a_row_over_it(small_trace_path, monkeypatch):
    """Trace analysis at its default, equal memory as on the other tabs: every method within 2.5 bits by its rule,
    and a `fits` column; a row measured over the budget (qvg's raised here, as a data span can) is flagged OVER in
    the table and the status. At fixed bits the status names the spread and a row over BF16 is flagged."""
    path = str(small_trace_path)
    status, header, rows = handlers.analyze_handler(path, ["rtn", "qvg", "quantwm"], "k", "2", 2.5, "budget")
    col = header.index
    assert "within 2.5 bits per element, each method by its rule (rtn k: bits=2" in status, status
    assert [row[0] for row in rows] == ["rtn", "qvg", "quantwm"]
    assert all(row[col("fits")] == "yes" and row[col("bits_per_element")] <= 2.5 for row in rows)
    real = handlers.analyze_trace

    def overrun(*args, **kwargs):
        report = real(*args, **kwargs)
        report["methods"]["qvg"]["mean"]["bits_per_element"] = 9.3
        return report

    monkeypatch.setattr(handlers, "analyze_trace", overrun)
    status, header, rows = handlers.analyze_handler(path, ["rtn", "qvg", "quantwm"], "k", "2", 2.5, "budget")
    assert {row[0]: row[col("fits")] for row in rows} == {"rtn": "yes", "qvg": "OVER", "quantwm": "yes"}
    assert "**OVER**: qvg: its quantized spans store 9.30 bits/element, over the budget of 2.5." in status
    monkeypatch.setattr(handlers, "analyze_trace", real)
    fixed, header, rows = handlers.analyze_handler(path, ["rtn", "qvg"], "k", "2", 2.5, "bits")
    assert "2 bits (fixed grids, no budget)" in fixed and re.search(r"from 2\.50 \(rtn\) to [\d.]+ \(qvg\)", fixed)
    fits = {row[0]: row[col("fits")] for row in rows}
    qvg_bits = next(row[col("bits_per_element")] for row in rows if row[0] == "qvg")
    assert fits == {"rtn": "yes", "qvg": "OVER" if qvg_bits > 16 else "yes"}
    for bad in (0, -1, 20):
        assert handlers.analyze_handler(path, ["rtn"], "k", "2", bad, "budget")[0].startswith(
            "**Error:** budget must be a number of bits per element in (0, 16]")


RUN_ID_VIEWS = {
    "scrub": lambda runs, rid: wh.scrub_handler(runs, rid, 5),
    "trace_pixel": lambda runs, rid: wh.trace_pixel_handler(runs, rid, 5, 3, 3),
    "click_pixel": lambda runs, rid: wh.click_pixel_handler(runs, rid, 5, [12, 12]),
    "energy": lambda runs, rid: wh.energy_handler(runs, rid, 0),
    "export_figures": lambda runs, rid: wh.export_handler(runs, rid, 5),
    "export_energy": lambda runs, rid: wh.export_energy_handler(runs, rid, 0),
    "overview": lambda runs, rid: oh.overview_handler(runs, rid),
    "strip_frame": lambda runs, rid: oh.strip_click_handler(runs, rid, 3),
    "open_run": lambda runs, rid: wh.open_run_handler(runs, rid, files=False),
}


@pytest.mark.parametrize("view", RUN_ID_VIEWS)
@pytest.mark.parametrize("bad", ["a b c", "seed=x loop quantwm kv 2-bit 10f", 5])
def test_a_bad_run_id_gets_one_error_line_naming_it(runs, view, bad):
    """Every handler taking a run id answers a malformed one with one **Error:** line that names it, never
    Python's own words ("not enough values to unpack", "invalid literal for int()")."""
    status = RUN_ID_VIEWS[view](runs, bad)["status"]
    assert status.startswith(f"**Error:** {str(bad)!r} is not ") and "\n" not in status, status
    assert "unpack" not in status and "invalid literal" not in status, status

