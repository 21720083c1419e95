"""The distribution as users install it: the wheel's contents, the entry points, Gradio's server conventions."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(ROOT)],
                   check=True, capture_output=True)
    (path,) = out.glob("quantwm-*.whl")
    return zipfile.ZipFile(path)


def test_wheel_ships_the_weights_and_runtime_data(wheel):
    names = set(wheel.namelist())
    weights = wheel.getinfo("quantwm/assets/world_model.safetensors")
    assert weights.file_size == (ROOT / "assets" / "world_model.safetensors").stat().st_size > 1_000_000
    assert {"quantwm/app/page.js", "quantwm/app/main.py", "quantwm/kernels/span_attention.py",
            "quantwm/core/cache.py", "quantwm/evaluation/figures.py", "quantwm/drivers/workbench.py"} <= names


def test_wheel_claims_no_top_level_name_but_quantwm(wheel):
    tops = {n.split("/")[0] for n in wheel.namelist()}
    assert tops == {"quantwm", next(t for t in tops if t.endswith(".dist-info"))}
    entry = next(n for n in wheel.namelist() if n.endswith("entry_points.txt"))
    entries = wheel.read(entry).decode()
    assert "quantwm = quantwm.cli:main" in entries
    assert "[sglang.multimodal_gen.plugins]\nquantwm = quantwm.adapters.sglang_plugin:register" in entries
    meta = wheel.read(next(n for n in wheel.namelist() if n.endswith("METADATA"))).decode()
    for dep in ("torch", "tqdm", "safetensors", "scikit-image", "opencv-python-headless", "matplotlib", "gradio"):
        assert f"Requires-Dist: {dep}" in meta, dep
    for extra in ("app", "kernels", "diffusers", "test", "sglang", "fastvideo"):
        assert f"Provides-Extra: {extra}" in meta


def test_weights_are_found_as_package_data():
    from quantwm.world.generate import DEFAULT_WEIGHTS

    assert DEFAULT_WEIGHTS.is_file() and DEFAULT_WEIGHTS.parent.name == "assets"


def test_server_address_follows_gradio_conventions():
    from app.main import server_address

    env = {"GRADIO_SERVER_NAME": "0.0.0.0", "GRADIO_SERVER_PORT": "7990"}
    assert server_address(None, None, env) == ("0.0.0.0", 7990)
    assert server_address("127.0.0.1", 8000, env) == ("127.0.0.1", 8000)  # explicit --host/--port win
    assert server_address(None, None, {}) == ("127.0.0.1", 7860)
    with pytest.raises(ValueError, match="GRADIO_SERVER_PORT must be an integer"):
        server_address(None, None, {"GRADIO_SERVER_PORT": "http"})
    with pytest.raises(ValueError, match="port must lie in"):
        server_address(None, 70000, {})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_app_serves_on_gradio_server_port_with_the_runs_given_by_run(tmp_path):
    """`python app.py --run FILE` serves on GRADIO_SERVER_PORT with the run file listed among the opened runs, from
    a process that re-executed itself with the allocator settings. (`python -m quantwm app` runs the same `main`:
    test_app_rejects_a_bad_port_with_one_line starts it; the browser tests drive an app with an opened run.)"""
    from test_app_browser import synthetic_latent_run

    run = tmp_path / "opened.safetensors"
    synthetic_latent_run(run)
    port = _free_port()
    env = {**os.environ, "GRADIO_SERVER_PORT": str(port), "GRADIO_ANALYTICS_ENABLED": "False"}
    proc = subprocess.Popen([sys.executable, "app.py", "--run", str(run)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 300  # the app calibrates its speed at start: slow on a loaded machine
        while time.time() < deadline:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as r:
                    assert r.status == 200 and b"gradio" in r.read().lower()
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/config", timeout=10) as r:
                    config = r.read().decode()
                assert "file=opened.safetensors qvg kv 2-bit" in config  # the opened runs' list holds it
                # the serving process re-executed itself with the allocator settings that keep memory flat
                environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
                assert {b"MKL_DISABLE_FAST_MM=1", b"MALLOC_ARENA_MAX=2"} <= set(environ)
                return
            except OSError:
                time.sleep(0.5)
        pytest.fail(f"nothing served on port {port} within 300 s")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize("command", [["app.py"], ["-m", "quantwm", "app"]])
def test_app_rejects_a_bad_port_with_one_line(command):
    env = {**os.environ, "GRADIO_SERVER_PORT": "not-a-port"}
    r = subprocess.run([sys.executable, *command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["quantwm app: error: GRADIO_SERVER_PORT must be an integer port, got 'not-a-port'"]
