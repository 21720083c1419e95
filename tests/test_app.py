import pytest

from app.handlers import analyze_handler


@pytest.fixture(scope="module")
def trace_file(small_trace_path):
    return str(small_trace_path)


def test_analyze_handler_returns_a_row_per_method(trace_file):
    message, header, rows = analyze_handler(trace_file, ["rtn", "quantwm"], "k", 2)
    assert header[0] == "method" and "shift_rate" in header
    assert [r[0] for r in rows] == ["rtn", "quantwm"]
    shift = header.index("shift_rate")
    assert 0 <= rows[1][shift] < rows[0][shift] <= 1
    assert "2 bits" in message


@pytest.mark.parametrize("path, methods, needle", [
    (None, ["rtn"], "no trace file"),
    ("{trace}", [], "at least one method"),
    ("{trace}", ["nope"], "unknown method"),
    ("{garbage}", ["rtn"], "not a valid QuantWM trace"),
])
def test_analyze_handler_turns_bad_input_into_a_message(path, methods, needle, trace_file, tmp_path):
    garbage = tmp_path / "g.safetensors"
    garbage.write_bytes(b"nope")
    if path:
        path = path.format(trace=trace_file, garbage=garbage)
    message, header, rows = analyze_handler(path, methods, "k", 2)
    assert message.startswith("**Error:**") and needle in message and rows == []


def test_app_builds_with_an_api_name_on_every_event(trace_file):
    from app.assemble import build_app

    demo = build_app(trace_file)
    fns = list(demo.fns.values()) if isinstance(demo.fns, dict) else list(demo.fns)
    assert fns and all(getattr(f, "api_name", None) for f in fns)


def test_an_image_shown_again_is_not_rewritten_and_a_new_one_appears_only_whole(trace_file, tmp_path):
    """Gradio names an image's file by the hash of its bytes; the app's images are written once, whole: the second
    save of the same image (a Generate draws its frames twice at once) leaves the file as it was, so a browser
    fetching it meanwhile is never sent a file that changes under it; while threads save new images at once, a
    file that exists always holds the whole image."""
    import os
    import threading

    import numpy as np
    from gradio import processing_utils
    from PIL import Image

    from app.assemble import build_app

    build_app(trace_file)
    assert processing_utils.save_pil_to_cache.__name__ == "save_image_once"  # what Gradio's components call
    img = Image.fromarray(np.arange(64 * 64 * 3, dtype=np.uint8).reshape(64, 64, 3))
    path = processing_utils.save_pil_to_cache(img, str(tmp_path), format="png")
    os.utime(path, ns=(10**9, 10**9))
    assert processing_utils.save_pil_to_cache(img, str(tmp_path), format="png") == path
    assert os.stat(path).st_mtime_ns == 10**9  # not written again
    assert np.array_equal(np.asarray(Image.open(path)), np.asarray(img))
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (256, 256, 3), dtype=np.uint8)) for _ in range(4)]
    sizes = {processing_utils.hash_bytes(processing_utils.encode_pil_to_bytes(i, "png")):
             len(processing_utils.encode_pil_to_bytes(i, "png")) for i in images}
    seen, done = [], threading.Event()

    def watch():
        while not done.is_set():
            for h, n in sizes.items():
                f = tmp_path / "new" / h / "image.png"
                if f.exists():
                    seen.append(f.stat().st_size == n)

    watcher = threading.Thread(target=watch)
    watcher.start()
    savers = [threading.Thread(target=lambda: [processing_utils.save_pil_to_cache(i, str(tmp_path / "new"), format="png")
                                               for i in images]) for _ in range(4)]
    for t in savers:
        t.start()
    for t in savers:
        t.join()
    done.set()
    watcher.join()
    assert all(seen) and all((tmp_path / "new" / h / "image.png").stat().st_size == n for h, n in sizes.items())
    assert not list((tmp_path / "new").glob("*/.*.part"))  # nothing left beside them


def test_the_app_process_keeps_an_environment_that_already_has_the_allocator_settings(monkeypatch):
    from app import main as app_main

    calls = []
    monkeypatch.setattr(app_main.os, "execve", lambda *a: calls.append(a))
    app_main.restart_with_server_env({**app_main.SERVER_ENV, "PATH": "/bin"})
    assert calls == []  # nothing to change: no re-execution
    app_main.restart_with_server_env({"MALLOC_ARENA_MAX": "4", "PATH": "/bin"})  # the user's own value is kept
    (exe, argv, env), = calls
    assert exe == app_main.sys.executable and env["MALLOC_ARENA_MAX"] == "4" and env["MKL_DISABLE_FAST_MM"] == "1"


def test_the_page_names_no_server_path_and_lists_what_runs_where():
    """No literal backticks in plain-text labels, no server path for the default trace, no empty "1 2 3" table
    before an analysis; kivi-pre listed where it runs (traces) and its absence explained on the Generate tab."""
    from app.assemble import build_app

    comps = build_app(None).config["components"]
    props = [c.get("props", {}) for c in comps]
    labels = [p.get("label") for p in props if isinstance(p.get("label"), str)]
    assert labels and not any("`" in label for label in labels)
    texts = " ".join(str(p.get("value")) for p in props if isinstance(p.get("value"), str))
    assert "/tmp" not in texts and "the built-in synthetic world trace" in texts
    table = next(p for p in props if p.get("label") == "Means over layers and heads")
    assert table["visible"] is False
    methods = {p["label"]: [c[1] for c in p["choices"]] for p in props if p.get("label") == "Method"}
    generate = next(p for p in props if p.get("label") == "Method A" and "kivi-pre" in str(p.get("info")))
    assert "kivi-pre" not in [c[1] for c in generate["choices"]]
    assert any("kivi-pre" in choices for choices in methods.values())  # Trace analysis's list
