"""Assembles the QuantWM diagnostics app: `gr.Blocks` from the tabs of this package around the compute side
(`quantwm.drivers.workbench.Workbench`: the built-in world model, loaded once, and
`quantwm.drivers.registry.RunRegistry`: every run shown, built-in or opened); the numerical work lives in
quantwm/. With no trace given, the trace tab analyses the built-in synthetic world trace (made at
start-up, no downloads). Started by app/main.py.
"""
from __future__ import annotations

import os
import tempfile
import threading
from functools import partial
from importlib import resources
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402
from gradio import processing_utils  # noqa: E402

from quantwm.core.methods import known_methods  # noqa: E402
from quantwm.drivers.registry import RunRegistry  # noqa: E402
from quantwm.drivers.workbench import Workbench  # noqa: E402
from quantwm.evaluation.figures import FORMATS  # noqa: E402
from quantwm.evaluation.synthetic import make_synthetic_trace  # noqa: E402
from quantwm.evaluation.trace import read_trace  # noqa: E402

from . import handlers  # noqa: E402
from . import overview_handlers as oh  # noqa: E402
from . import study_handlers as sh  # noqa: E402
from . import world_handlers as wh
from .analysis_tab import build_analysis_tab  # noqa: E402
from .overview_panel import build_overview_panel  # noqa: E402
from .playback_tab import build_playback_tab  # noqa: E402
from .studies_tab import build_energy_tab, build_key_value_tab, build_methods_tab  # noqa: E402

PAGE_JS = resources.files(__package__).joinpath("page.js").read_text()
# The Key-vs-Value tab's default baseline: the one whose rows best show "smaller Key error, bigger damage" on
# held-out worlds (docs/world-model.md, "The Key-vs-Value experiment").
KV_BASELINE = "kivi"
# The frames' and videos' labels sit above them, not over their top rows (Gradio floats a label badge over the media
# of a fixed-height block: the block grows by the label instead).
PANELS = ("#frame-bf16", "#frame-method", "#frame-method-b", "#video-bf16", "#video-method", "#video-method-b")
CSS = ("#frame-bf16 img, #frame-method img, #frame-method-b img { image-rendering: pixelated; }\n"
       f"{', '.join(PANELS)} {{ height: auto !important; }}\n"
       f"{', '.join(p + ' > [data-testid=block-label]' for p in PANELS)} {{ position: static; }}")


def default_trace(path: str | None, directory: str | None = None) -> str:
    """The trace the Trace analysis tab opens with: `path` (checked now) or the synthetic world trace, made in
    `directory` (the app's temporary folder, removed at shutdown)."""
    if path:
        read_trace(path)  # fail at start-up, clearly, on a bad file
        return path
    out = os.path.join(tempfile.mkdtemp(prefix="trace-", dir=directory), "synthetic-world.safetensors")
    make_synthetic_trace(seed=0, n_layers=2, n_heads=4).save(out)
    return out


def launch_options(wb: Workbench | None = None) -> dict:
    """What launch() needs besides the Blocks: the page script (plot click, video sync), CSS, error messages
    for API clients, and the upload limit (Gradio refuses larger uploads itself)."""
    opts = {"js": PAGE_JS, "css": CSS, "show_error": True}
    if wb is not None:
        opts["max_file_size"] = int(wb.limits.max_upload_mb * 2 ** 20)
    return opts


def save_image_once(img, cache_dir: str, name: str = "image", format: str = "webp") -> str:
    """Gradio's `processing_utils.save_pil_to_cache`, writing each image once and whole. Gradio stores an image a
    handler returns under a folder named by the hash of its bytes, and rewrote that file in place whenever the same
    image came again: a browser fetching it meanwhile got fewer or more bytes than the length it was promised, a
    broken image that stayed broken (a Generate draws its frames twice at once, from the run's `.then` and from the
    slider's change). Here a file that exists is left alone (the same name is the same bytes), and a new one
    appears under its name only when complete (written beside it, then renamed)."""
    data = processing_utils.encode_pil_to_bytes(img, format)
    folder = Path(cache_dir) / processing_utils.hash_bytes(data)
    folder.mkdir(exist_ok=True, parents=True)
    path = (folder / f"{name}.{format}").resolve()
    if not path.exists():
        part = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.part")
        part.write_bytes(data)
        os.replace(part, path)
    return str(path)


def _bind(fn, *args, **kwargs):
    return wh.guarded(partial(fn, *args, **kwargs))


def build_app(trace: str | None = None, workbench: Workbench | None = None, frames: int = 32,
              delete_cache: tuple[int, int] = (300, 1800), live=None, runs: RunRegistry | None = None) -> gr.Blocks:
    """The app. `delete_cache` (every, age) in seconds: Gradio's copies of served files (videos, frames)
    older than `age` are deleted every `every` seconds, and all of them when the server stops. `live`: a
    real model's backend for generating on demand (`adapters.self_forcing.SelfForcingLive`; app/main.py
    `--model self-forcing`). `runs`: the run registry (with run files already opened), else one made over
    `workbench`."""
    processing_utils.save_pil_to_cache = save_image_once  # every image a component returns (see its docstring)
    trace_path = default_trace(trace, wh.app_files().root)
    runs = runs or RunRegistry(workbench or Workbench())
    wb = runs.wb
    wh.track_evictions(runs)
    facts = wb.model_facts()
    methods = wb.methods()  # what the built-in model can run (the trace tab takes every method)
    check = wb.limits.check_upload
    with gr.Blocks(title="QuantWM", delete_cache=delete_cache) as demo:
        gr.Markdown("# QuantWM: where 2-bit KV caches make video world models flicker\n"
                    f"Built-in world model: {facts['layers']} layers, {facts['heads']} heads x {facts['head_dim']}, "
                    f"{facts['frame_size']}x{facts['frame_size']} frames. **Device: {wb.describe_device()}**. "
                    f"{wb.limits.describe()} One generation runs at a time; others wait in the queue.",
                    elem_id="header")
        with gr.Tab("Generate & play"):
            controls = build_playback_tab(_bind(wh.generate_handler, runs), _bind(wh.scrub_handler, runs),
                                          _bind(wh.trace_pixel_handler, runs), _bind(wh.click_pixel_handler, runs),
                                          _bind(wh.export_handler, runs), methods, facts, FORMATS,
                                          min(frames, wb.limits.max_frames), wb.limits.max_frames,
                                          _bind(wh.open_run_handler, runs), runs.opened(),
                                          None if live is None else {
                                              "kind": live.kind, "device": live.device_name,
                                              "latent_frames": live.LATENT_FRAMES,
                                              "generate": _bind(wh.live_generate_handler, runs, live)})
            build_overview_panel(controls, _bind(oh.overview_handler, runs), _bind(oh.strip_click_handler, runs))
        with gr.Tab("Query energy"):
            build_energy_tab(_bind(wh.energy_handler, runs), controls, facts["layers"],
                             _bind(wh.export_energy_handler, runs), FORMATS)
        with gr.Tab("Key vs Value"):
            baselines = [m for m in methods if m != "bf16" and not m.startswith("quantwm")]
            build_key_value_tab(_bind(sh.key_value_handler, runs), controls, baselines, KV_BASELINE)
        with gr.Tab("Methods"):
            build_methods_tab(_bind(sh.methods_handler, runs), _bind(sh.export_methods_handler, runs), methods,
                              controls, FORMATS)
        with gr.Tab("Trace analysis"):
            # every method, the pre-RoPE ones included: a trace carries its own RoPE (the built-in model's does not)
            build_analysis_tab(partial(handlers.analyze_handler, check_upload=check), known_methods(), trace_path,
                               wh.guarded(partial(handlers.trace_inspect_handler, check_upload=check)),
                               wh.guarded(partial(handlers.trace_energy_handler, check_upload=check)),
                               wh.guarded(partial(handlers.trace_click_handler, check_upload=check)),
                               os.path.basename(trace) if trace else "the built-in synthetic world trace (2 layers, "
                               "4 heads; made at start-up)")
    return demo
