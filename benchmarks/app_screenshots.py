"""Re-take the documentation's screenshots of the app (docs/img/app-generate.png, docs/img/app-methods.png) in
headless Chromium against a fresh app on the built-in model.

    python benchmarks/app_screenshots.py [--out-dir docs/img] [--frames 32]

Generate & play: the default world and quantwm, scrubbed to the worst frame, a pixel traced. Methods: the tab's
default methods at its default budget (2.5 bits per element). About 2 minutes on 2 CPU cores.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
ROOT = pathlib.Path(__file__).resolve().parents[1]
WAIT = 300_000  # ms
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default=str(ROOT / "docs" / "img"))
    ap.add_argument("--frames", type=int, default=32)
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from playwright.sync_api import sync_playwright

    from app import assemble as mod
    from quantwm.drivers.workbench import Workbench

    out = pathlib.Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    demo = mod.build_app(None, Workbench(), frames=a.frames)
    _, url, _ = demo.queue().launch(prevent_thread_lock=True, quiet=True, **mod.launch_options())
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1700})
        page.goto(url)
        page.locator("#generate-btn").click()
        page.wait_for_function("(document.querySelector('#run-id textarea') || {}).value?.includes('seed=')",
                               timeout=WAIT)
        page.wait_for_selector("#frame-method img", timeout=WAIT)
        img = page.locator("#frame-method img")
        box = img.bounding_box()
        img.click(position={"x": box["width"] * 0.4, "y": box["height"] * 0.6}, timeout=WAIT)
        page.wait_for_function("document.querySelector('#trace-status').innerText.includes('source')", timeout=WAIT)
        page.wait_for_timeout(1500)  # the heatmap draws
        page.screenshot(path=str(out / "app-generate.png"), full_page=True)
        print(f"wrote {out / 'app-generate.png'}")
        page.get_by_role("tab", name="Methods").click()
        page.locator("#methods-btn").click()
        page.wait_for_function("document.querySelector('#methods-status').innerText.includes('At most')",
                               timeout=WAIT)
        page.wait_for_timeout(500)
        page.locator("#methods-table").scroll_into_view_if_needed()
        page.screenshot(path=str(out / "app-methods.png"), full_page=False)
        print(f"wrote {out / 'app-methods.png'}")
        browser.close()
    demo.close()


if __name__ == "__main__":
    main()
