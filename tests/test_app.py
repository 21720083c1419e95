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
