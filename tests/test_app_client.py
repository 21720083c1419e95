"""The app's API through gradio_client against a real server: generate, scrub, the pixel-trace twin, methods."""
import pathlib
import re

import imageio_ffmpeg
import pytest
from PIL import Image

pytestmark = pytest.mark.usefixtures("shared_rollouts")  # conftest.py: each rollout made once per process

FRAMES = 10


@pytest.fixture(scope="module")
def workbench():
    from quantwm.drivers.workbench import Workbench

    return Workbench()


@pytest.fixture(scope="module")
def server(small_trace_path, workbench):
    from app import assemble as mod

    demo = mod.build_app(str(small_trace_path), workbench, frames=FRAMES)
    _, url, _ = demo.queue(default_concurrency_limit=1).launch(prevent_thread_lock=True, quiet=True,
                                                               **mod.launch_options())
    yield url
    demo.close()


@pytest.fixture(scope="module")
def client(server):
    from gradio_client import Client

    return Client(server, verbose=False)


@pytest.fixture(scope="module")
def generated(client):
    """The photo world of seed 4, method A alone (the page opens on the place world with two methods:
    `test_generate_defaults_to_the_pages_place_world_with_two_methods_and_views_take_both`)."""
    return client.predict(4, "loop", "quantwm", "kv", 2, FRAMES, world="photo", method_b="none", api_name="/generate")


API_PARAMETERS = {
    "/generate": ["seed", "trajectory", "method", "target", "bits", "frames", "budget", "sizing", "world", "method_b"],
    "/open_run": ["run", "run_b"],
    "/upload_run": ["path"],
    "/show_frame": ["run_id", "frame", "overlays", "layer", "head", "traced", "run_b", "maps"],
    "/scrub": ["run_id", "frame", "overlays", "layer", "head", "traced", "run_b", "maps"],
    "/click_pixel": ["run_id", "frame", "layer", "head", "run_b"],
    "/click_pixel_b": ["run_id", "frame", "layer", "head", "run_b"],
    "/click_pixel_bf16": ["run_id", "frame", "layer", "head", "run_b", "maps"],
    "/trace_pixel": ["run_id", "frame", "x", "y", "layer", "head", "run_b", "maps"],
    "/overview": ["run_id"],
    "/click_strip": ["run_id"],
    "/strip_frame": ["run_id", "x"],
    "/export_figures": ["run_id", "frame", "layer", "head", "formats", "traced", "run_b", "maps"],
    "/energy": ["run_id", "layer"],
    "/export_energy": ["run_id", "layer", "formats"],
    "/key_vs_value": ["seed", "trajectory", "baseline", "budget", "frames", "seeds"],
    "/methods_table": ["seed", "trajectory", "target", "frames", "methods", "budget"],
    "/export_methods_figure": ["seed", "trajectory", "target", "frames", "methods", "budget", "formats"],
    "/analyze": ["path", "methods", "target", "bits", "budget", "sizing"],
    "/trace_inspect": ["path", "method", "target", "bits", "layer", "head", "query"],
    "/trace_click_query": ["path", "method", "target", "bits", "layer", "head", "query"],
    "/trace_energy": ["path", "layer"],
}


def test_every_endpoint_names_its_parameters(client):
    api = client.view_api(return_format="dict", print_info=False)["named_endpoints"]
    assert set(api) == set(API_PARAMETERS)
    for name, params in API_PARAMETERS.items():
        assert [p["parameter_name"] for p in api[name]["parameters"]] == params, name


def test_strip_frame_endpoint_maps_a_strip_column_to_a_frame(client, generated):
    """The overview strip's click over the API: the column's frame, and the run's overview status."""
    assert client.predict(generated[1], 1023, api_name="/strip_frame") == FRAMES - 1
    assert client.predict(generated[1], 0, api_name="/strip_frame") == 0
    status = client.predict(generated[1], api_name="/overview")[0]
    assert f"{FRAMES} frames" in status and "No per-(layer, head) table" in status  # a generated run has none


def test_export_figures_endpoint_writes_print_files(client, generated):
    traced = client.predict(generated[1], FRAMES - 1, 32, 32, 1, 0, api_name="/trace_pixel")[-1]
    status, files = client.predict(generated[1], FRAMES - 1, "all", "all", ["pdf", "svg"], traced,
                                   api_name="/export_figures")
    names = sorted(pathlib.Path(f).name for f in files)
    assert len(names) == 6 and all(n.endswith((".pdf", ".svg")) for n in names), status
    assert {n.split("-")[0] for n in names} == {"frames", "maps", "trace"}
    assert any(n.endswith(f"-frame{FRAMES - 1}-x32-y32-layer1-head0.pdf") for n in names)
    energy = client.predict(generated[1], 1, ["svg"], api_name="/export_energy")[1]
    assert [pathlib.Path(f).name.split("-")[0] for f in energy] == ["energy"] and energy[0].endswith("-layer1.svg")
    pdf = next(f for f in files if f.endswith(".pdf"))
    assert pathlib.Path(pdf).read_bytes().startswith(b"%PDF")


def test_generate_returns_run_id_videos_plot_and_slider(generated):
    status, run_id, bf16_video, method_video, plot, slider, run_b, method_b_video, _ = generated
    assert run_b == "" and method_b_video.get("visible") is False  # method B "none": its player hidden
    assert run_id == f"seed=4 loop quantwm kv budget=2.5 {FRAMES}f" and "PSNR vs BF16" in status  # equal memory
    assert method_video.get("label", "").startswith("quantwm within 2.5 bits, spans ") and "bits/element" in method_video["label"]
    assert "configuration within 2.5 bits: k: allocator, bits per channel " in status and not status.startswith("**OVER")
    for video in (bf16_video, method_video):
        video = video.get("value", video) if isinstance(video, dict) else video  # an update carries its value
        path = video["video"] if isinstance(video, dict) else video
        assert next(imageio_ffmpeg.read_frames(path))["codec"] == "h264"
    assert plot["type"] == "plotly" and '"tdiff"' in plot["plot"]
    assert slider["maximum"] == FRAMES - 1 and 4 <= slider["value"] < FRAMES


def test_generate_defaults_to_the_pages_place_world_with_two_methods_and_views_take_both(client):
    """/generate with the arguments the API had before worlds and method B takes the page's defaults for them:
    the place world and qvg beside quantwm, both within the budget; scrub, trace and export take method B's run
    (run_b) and which run the maps are of (maps)."""
    out = client.predict(6, "loop", "quantwm", "kv", 2, FRAMES, api_name="/generate")
    status, run_id, *_, run_b, method_b_video, maps = out
    assert (run_id, run_b) == (f"seed=6 place loop quantwm kv budget=2.5 {FRAMES}f",
                               f"seed=6 place loop qvg kv budget=2.5 {FRAMES}f")
    assert len(re.findall(r"VBench flicker [\d.]+ \(BF16 [\d.]+\)", status)) == 2
    assert method_b_video["label"].startswith("qvg within 2.5 bits, spans ") and method_b_video["visible"] is True
    assert [c[1] for c in maps["choices"]] == ["A", "B"] and maps["value"] == "A"
    info, _, method, _, method_b = client.predict(run_id, FRAMES - 1, ["flicker map"], "all", "all", None, run_b, "B",
                                                  api_name="/scrub")
    assert "maps of method B (qvg)" in info and method_b["visible"] is True
    assert Image.open(method_b["value"]).size == Image.open(method).size == (256, 256)
    traced = client.predict(run_id, FRAMES - 1, 21, 42, 1, 0, run_b, "B", api_name="/trace_pixel")
    assert traced[-1]["run"] == run_b and traced[-1]["other"]["run"] == run_id and "quantwm source: frame" in traced[0]
    assert Image.open(traced[5]).size == (192, 192)  # the other method's source thumbnail
    files = client.predict(run_id, FRAMES - 1, "all", "all", ["pdf"], traced[-1], run_b, "B",
                           api_name="/export_figures")[1]
    assert len(files) == 3 and all("-place-loop-qvg-" in pathlib.Path(f).name for f in files)


def test_scrub_returns_both_enlarged_frames(client, generated):
    info, bf16, method, scale, method_b = client.predict(generated[1], FRAMES - 1, ["flicker map"], "all", "all",
                                                         api_name="/scrub")
    assert method_b.get("visible") is False  # no method B shown
    assert info.startswith(f"Frame **{FRAMES - 1}**")
    assert Image.open(bf16).size == Image.open(method).size == (256, 256)
    scale = scale.get("value", scale) if isinstance(scale, dict) else scale  # an update carries its value
    assert Image.open(scale if isinstance(scale, str) else scale["path"]).size == (256, 30)  # the flicker's colour bar


def test_pixel_trace_twin_returns_sources(client, generated):
    status, q_img, src_bf16, src_method, heatmap, src_other, result = client.predict(
        generated[1], FRAMES - 1, 17, 33, 1, 2, api_name="/trace_pixel")
    assert src_other is None  # no other method shown
    assert result["query"] == [FRAMES - 1, 4, 2] and result["layer"] == 1 and result["head"] == 2
    assert all(0 <= f < FRAMES - 2 for f in (result["source_bf16"][0], result["source_method"][0]))
    assert result["jumped"] == (result["source_bf16"] != result["source_method"])
    assert "BF16 source: frame" in status and heatmap["type"] == "plotly" and '"heatmap"' in heatmap["plot"]
    assert Image.open(src_method).size == (192, 192)


def test_pixel_trace_bad_pixel_is_a_message(client, generated):
    status = client.predict(generated[1], FRAMES - 1, 99, 3, 0, 0, api_name="/trace_pixel")[0]
    assert status.startswith("**Error:**") and "outside the 64x64 frame" in status


def test_generate_at_fixed_bits_is_the_explicit_mode_and_flags_a_run_over_bf16(client):
    """sizing="bits" runs the grid as named; qvg's "2-bit" stores more than BF16 here, and the status says so."""
    status, run_id = client.predict(4, "loop", "qvg", "kv", 2, FRAMES, 2.5, "bits", world="photo", method_b="none",
                                    api_name="/generate")[:2]
    assert run_id == f"seed=4 loop qvg kv 2-bit {FRAMES}f" and "fixed 2-bit grid, no budget" in status
    assert status.startswith("**OVER: it stores more than BF16"), status


def test_generate_at_a_budget_names_its_configuration(client):
    status, run_id = client.predict(4, "loop", "kivi", "kv", 2, FRAMES, 2.5, method_b="none", api_name="/generate")[:2]
    assert "budget=2.5" in run_id and "configuration within 2.5 bits: k: bits=2" in status
    bad = client.predict(4, "loop", "kivi", "kv", 2, FRAMES, 99, api_name="/generate")[0]
    assert bad.startswith("**Error:**") and "budget must be a number of bits per element in (0, 16], got 99" in bad


def test_methods_table(client):
    status, table, plot = client.predict(4, "loop", "kv", FRAMES, ["rtn", "quantwm", "nvfp4"], 2.5,
                                         api_name="/methods_table")
    header, rows = table["headers"], table["data"]
    col = {name: header.index(name) for name in header}
    assert sorted(r[0] for r in rows) == ["quantwm", "rtn"] and header[0] == "method"
    assert all(r[col["fits"]] == "yes" for r in rows)
    conf = [r[col["configuration"]] for r in rows]
    assert any("allocator, bits per channel" in c for c in conf) and any("bits=2" in c for c in conf)  # chosen
    assert "bf16_mb" not in header and "The same in every row (not shown as columns): " in status  # one world
    assert "bf16_mb " in status.split("The same in every row")[1]  # named with its value
    assert "memory" in status and "At most 2.5 bits" in status and plot["type"] == "plotly"
    assert "Left out: nvfp4 (nvfp4 cannot fit 2.5 bits per element" in status
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError, match="'nope'.* is not in the list of choices"):  # the UI offers known names only
        client.predict(4, "loop", "kv", FRAMES, ["nope"], 2.5, api_name="/methods_table")
    empty = client.predict(4, "loop", "kv", FRAMES, [], 2.5, api_name="/methods_table")[0]
    assert empty.startswith("**Error:**") and "at least one method" in empty
    bad = client.predict(4, "loop", "kv", FRAMES, ["rtn"], 0, api_name="/methods_table")[0]
    assert bad.startswith("**Error:**") and "budget must be a number of bits per element in (0, 16], got 0" in bad


def test_bad_numbers_get_the_pages_error_line_from_the_api_too(client, generated):
    """One kind of error: what the API sends reaches the handler unrounded and unchecked by Gradio, and comes
    back as the page's **Error:** line naming the field and the allowed range."""
    frame = client.predict(generated[1], FRAMES + 3, [], "all", "all", api_name="/scrub")[0]
    assert frame.startswith("**Error:**") and f"frame {FRAMES + 3} out of range" in frame
    seed = client.predict(-5, "loop", "quantwm", "kv", 2, FRAMES, api_name="/generate")[0]
    assert seed.startswith("**Error:**") and "world seed must lie in [0, 100000)" in seed
    rounded = client.predict(3.7, "loop", "quantwm", "kv", 2, FRAMES, api_name="/generate")[0]
    assert rounded.startswith("**Error:**") and "world seed must be an integer, got 3.7" in rounded


def test_a_second_generation_waits_in_the_queue_while_views_stay_served(server, client, generated, workbench):
    """One generation at a time: while one runs (held open here on the server), a second user's Generate
    waits in Gradio's queue with its position shown (not an error, not a blocked worker), a view is served,
    and once the first finishes the second gets its own run."""
    import threading
    import time

    from gradio_client import Client

    wb = workbench
    gate, real = threading.Event(), wb._rollout

    def held(key, progress):
        if key.seed == 5:
            gate.wait(120)
        return real(key, progress)

    wb._rollout = held
    other, viewer = Client(server, verbose=False), Client(server, verbose=False)
    try:
        long_job = client.submit(5, "random-walk", "rtn", "kv", 2, 12, world="photo", method_b="none",
                                 api_name="/generate")
        deadline = time.time() + 300  # a limit on waiting for the state, generous for a loaded machine
        while not str(wb.running or "").startswith("seed=5 ") and time.time() < deadline:
            time.sleep(0.02)
        assert str(wb.running).startswith("seed=5 "), "the first generation did not start"
        waiting = other.submit(6, "loop", "kivi", "kv", 2, FRAMES, world="photo", method_b="none", api_name="/generate")
        seen = set()
        while ("IN_QUEUE", 0) not in seen and time.time() < deadline:
            st = waiting.status()
            seen.add((st.code.name, st.rank))
            time.sleep(0.02)
        info = viewer.predict(generated[1], FRAMES - 2, [], "all", "all", api_name="/scrub")[0]  # while held
        assert ("IN_QUEUE", 0) in seen, seen  # queued behind the running generation, position shown
        assert info.startswith(f"Frame **{FRAMES - 2}**") and not long_job.done()  # a view, served meanwhile
    finally:
        gate.set()
        wb._rollout = real
    first = long_job.result()
    second = waiting.result()
    assert first[1] == "seed=5 random-walk rtn kv budget=2.5 12f"
    assert second[1] == f"seed=6 loop kivi kv budget=2.5 {FRAMES}f" and not second[0].startswith("**Error")


def test_a_recorded_run_opens_over_the_api_and_every_view_answers(client, tmp_path):
    from gradio_client import handle_file

    from quantwm.drivers.views import make_run
    from quantwm.drivers.workbench import RunKey, Workbench
    from quantwm.evaluation.runfile import write_run

    path = tmp_path / "rec.safetensors"
    write_run(path, make_run(Workbench(), RunKey(seed=8, method="rtn", frames=FRAMES)))
    out = client.predict(handle_file(str(path)), api_name="/upload_run")
    run_id, video = out[1], out[2] if isinstance(out[2], str) else out[2]["video"]
    assert run_id == "file=rec.safetensors rtn kv 2-bit" and "opened" in out[0] and pathlib.Path(video).is_file()
    trace = client.predict(run_id, FRAMES - 1, 10, 20, 1, 0, api_name="/trace_pixel")
    assert trace[0].startswith(f"Query frame {FRAMES - 1}, row 2, col 1") and trace[-1]["query"] == [FRAMES - 1, 2, 1]
    assert client.predict(run_id, FRAMES - 2, ["top-1 jumps"], "all", "all", api_name="/scrub")[0].startswith(
        f"Frame **{FRAMES - 2}**")
    assert client.predict(run_id, api_name="/open_run")[1] == run_id  # reopened by id
    refused = client.predict(str(path), api_name="/open_run")[0]  # a server path is not an opened run
    assert refused.startswith("**Error:**") and "not an opened run" in refused


def test_a_budget_of_zero_at_equal_memory_is_an_error_as_20_and_minus_1_are(client):
    """"Equal memory" with a budget of 0 is refused like any budget outside (0, 16], never run as a fixed grid;
    the error names the explicit mode for that."""
    for bad in (0, 20, -1):
        status = client.predict(4, "loop", "quantwm", "kv", 2, FRAMES, bad, "budget", api_name="/generate")[0]
        assert status.startswith(f"**Error:** budget must be a number of bits per element in (0, 16], got {bad}"), status
        assert 'choose Memory: "Fixed bits" (sizing="bits")' in status


def test_layer_head_and_bits_are_accepted_as_the_api_lists_them(client, generated):
    """view_api lists the number pickers' choices as strings ('all', '0', '1', ...); those strings are accepted,
    and so are the numbers themselves; a value outside them gets the handler's error naming the range."""
    api = client.view_api(return_format="dict", print_info=False)["named_endpoints"]
    listed = {(name, p["parameter_name"]): p["python_type"]["type"] for name in ("/trace_pixel", "/energy", "/generate")
              for p in api[name]["parameters"]}
    assert listed[("/trace_pixel", "layer")] == "Literal['all', '0', '1', '2', '3']"
    assert "'1'" in listed[("/trace_pixel", "head")] and "'1'" in listed[("/energy", "layer")]
    assert listed[("/generate", "bits")] == "Literal['2', '3', '4', '8']"
    for layer, head in (("1", "2"), (1, 2)):
        result = client.predict(generated[1], FRAMES - 1, 17, 33, layer, head, api_name="/trace_pixel")[-1]
        assert (result["layer"], result["head"]) == (1, 2)
    assert client.predict(generated[1], FRAMES - 2, [], "1", "all", api_name="/scrub")[0].startswith(
        f"Frame **{FRAMES - 2}**")
    assert "top 8 of" in client.predict(generated[1], "1", api_name="/energy")[0]
    status, run_id = client.predict(4, "loop", "qvg", "kv", "2", FRAMES, 2.5, "bits", world="photo", method_b="none",
                                    api_name="/generate")[:2]
    assert run_id == f"seed=4 loop qvg kv 2-bit {FRAMES}f", status
    bad = client.predict(generated[1], FRAMES - 1, 17, 33, "9", "0", api_name="/trace_pixel")[0]
    assert bad.startswith("**Error:**") and "layer 9 out of range" in bad


RUN_ID_ENDPOINTS = {  # every endpoint taking a run id: its other arguments
    "/show_frame": (FRAMES - 1, [], "all", "all"), "/scrub": (FRAMES - 1, [], "all", "all"),
    "/trace_pixel": (FRAMES - 1, 3, 3, "all", "all"), "/overview": (), "/export_figures": (FRAMES - 1, "all", "all"),
    "/energy": ("0",), "/export_energy": ("0", ["pdf"]), "/open_run": (),
}


def test_every_endpoint_taking_a_run_id_answers_a_bad_one_with_one_error_line(client):
    """A malformed run id gets one **Error:** line naming it, from every endpoint (the strip's twin raises it as
    the API error), never "not enough values to unpack"."""
    from gradio_client.exceptions import AppError

    bad = "a b c"
    for name, args in RUN_ID_ENDPOINTS.items():
        out = client.predict(bad, *args, api_name=name)
        status = out[0] if isinstance(out, (list, tuple)) else out
        assert status.startswith(f"**Error:** {bad!r} is not ") and "\n" not in status, (name, status)
        assert "unpack" not in status, (name, status)
    with pytest.raises(AppError, match=f"{bad!r} is not a run id") as raised:
        client.predict(bad, 3, api_name="/strip_frame")
    assert "unpack" not in str(raised.value)
