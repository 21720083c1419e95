"""End to end in headless Chromium: a 512-frame run file (`quantwm record --window`) opened in the app: the
overview strip and the (layer, head) table appear, the slider scrubs, a click on the strip jumps the player, a
pixel of the last chunk traces to its source and an overlay tints that frame.

The run is recorded here, at test time, from the tiny world model of tests/tiny_world.py (2 layers, 1 head, 32x32
frames, random weights) through `drivers.long_record.record_long`, the code `quantwm record --window` runs: 512
frames through a window of 8 chunks in about half a minute on one thread, where the built-in model takes ten
minutes. Nothing is committed; the file lives in the test's temporary folder.
"""
from __future__ import annotations

import os

import pytest
from test_app_browser import CHROMIUM, CHROMIUM_ARGS, RUN_ID, WAIT, check_overlay, click_frame_pixel, scrub_to, settle, wait_fn, wait_text

FRAMES = 512


@pytest.fixture(scope="module")
def long_run_page(small_trace_path, tmp_path_factory):
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing: run install.sh (Debian chromium)")
    import torch
    from playwright.sync_api import sync_playwright
    from tiny_world import tiny_world_model

    from quantwm.drivers.long_record import record_long
    from quantwm.drivers.registry import RunRegistry
    from quantwm.drivers.workbench import RunKey, Workbench

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: more threads only spin on a loaded machine
    try:
        path = tmp_path_factory.mktemp("long-run") / "long.safetensors"
        record_long(tiny_world_model(), RunKey(0, "loop", "rtn", "kv", 2, FRAMES), path, window=8, steps=1,
                    sensitivity_frames=6)
    finally:
        torch.set_num_threads(threads)
    runs = RunRegistry(Workbench())
    runs.open(str(path))
    from app import assemble

    demo = assemble.build_app(str(small_trace_path), frames=10, runs=runs)
    _, url, _ = demo.queue(default_concurrency_limit=1).launch(prevent_thread_lock=True, quiet=True,
                                                               **assemble.launch_options())
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1600})
        page.goto(url)
        page.wait_for_selector("#open-run-btn", timeout=WAIT)
        yield page
        browser.close()
    demo.close()


def click_strip(page, frame: int, frames: int) -> None:
    """Click the overview strip's thumbnail row at the column of `frame` (the strip is scaled to its box)."""
    settle(page)
    page.locator("#overview-strip").scroll_into_view_if_needed()
    wait_fn(page, "document.querySelector('#overview-strip img')?.naturalWidth > 0", timeout=WAIT)
    w, h, nw, nh = page.evaluate("(() => { const i = document.querySelector('#overview-strip img');"
                                 " return [i.clientWidth, i.clientHeight, i.naturalWidth, i.naturalHeight]; })()")
    scale = min(w / nw, h / nh)
    left, top = (w - nw * scale) / 2, (h - nh * scale) / 2
    x = (frame + 0.5) * nw / frames
    page.locator("#overview-strip img").click(position={"x": left + x * scale, "y": top + (nh - 10) * scale},
                                              timeout=WAIT)


def test_a_512_frame_run_file_shows_its_strip_scrubs_jumps_and_traces_its_last_chunk(long_run_page):
    page = long_run_page
    page.locator("#open-run-btn").click()
    wait_fn(page, f"{RUN_ID}.startsWith('file=long.safetensors')", timeout=WAIT)
    page.wait_for_selector("#frame-method img", timeout=WAIT)
    wait_text(page, "#overview-status", "512 frames")
    assert "rolling window of 8 chunk(s)" in page.locator("#overview-status").inner_text()
    page.locator("#overview-strip").scroll_into_view_if_needed()  # its image loads lazily, once in view
    wait_fn(page, "document.querySelector('#overview-strip img')?.naturalWidth > 0", timeout=WAIT)
    assert page.evaluate("document.querySelector('#overview-strip img').naturalWidth") == 1024
    table = page.locator("#layer-table").inner_text()
    assert "place shift" in table and "PSNR, only this layer quantized" in table
    page.wait_for_selector("#layer-heatmap img, #layer-heatmap .js-plotly-plot", timeout=WAIT)
    scrub_to(page, 300)  # the slider reaches a frame deep into the run
    click_strip(page, 510, FRAMES)  # the last chunk: frames 510 and 511
    wait_text(page, "#frame-info", "Frame 510")
    settle(page)
    factor = page.evaluate("document.querySelector('#frame-method img').naturalWidth") // 32
    text = click_frame_pixel(page, 21, 10, factor=factor)  # pixel (21, 10) -> token row 1, col 2 (8 px a token)
    assert text.startswith("Query frame 510, row 1, col 2") and "rtn source" in text, text
    page.wait_for_selector("#trace-heatmap .js-plotly-plot", timeout=WAIT)
    check_overlay(page, "flicker map")  # the overlays too, on the last chunk's frame
    assert "Frame 510" in page.locator("#frame-info").inner_text()
