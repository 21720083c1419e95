"""The diagnostics app's entry point: `python app.py`, `quantwm app` or `python -m quantwm.app`.

Options: --trace FILE, --run FILE (repeatable: recorded runs, `quantwm record`), --weights FILE, --model
self-forcing --checkpoint FILE --base DIR (generate live on a CUDA GPU; refused without one), --host,
--port, --threads, and the per-request limits (--max-frames,
--max-methods, --max-upload-mb, --cache-mb, --memory-mb, --max-seconds; by default derived from this
machine's memory and its measured speed, see `quantwm.evaluation.limits`). The server address follows
Gradio's conventions: `--host` / `--port` when given, else `GRADIO_SERVER_NAME` / `GRADIO_SERVER_PORT`, else
127.0.0.1:7860. The address is checked before gradio is imported (gradio itself fails at import on a
malformed GRADIO_SERVER_PORT); a bad option or file prints one line and exits 2.

Every file the app writes (videos, exported figures, Gradio's copies of served files) lives under one
temporary folder of this process, removed at shutdown.

Memory stays flat over a long session: Gradio runs handlers on a pool of up to 40 worker threads, and two native
allocators kept memory per thread that a finished generation had used (MKL's fast memory manager keeps buffers
per calling thread; glibc gives threads malloc arenas of their own), so resident memory grew by a few MB for
every worker thread that ever generated. Both read their settings when the process starts, so on Linux `main`
re-executes the process once with `SERVER_ENV` set (variables the user set are kept).
"""
from __future__ import annotations

import argparse
import atexit
import os
import signal
import sys

# MKL: plain malloc/free instead of per-thread buffer pools; glibc: two malloc arenas shared by every thread.
SERVER_ENV = {"MKL_DISABLE_FAST_MM": "1", "MALLOC_ARENA_MAX": "2"}


def restart_with_server_env(env=os.environ) -> None:
    """Re-execute this process with `SERVER_ENV` (see the module docstring) unless it already has it; returns
    only when nothing needs to change (or not on Linux, where these allocators do not apply)."""
    missing = {k: v for k, v in SERVER_ENV.items() if k not in env}
    if not missing or not sys.platform.startswith("linux"):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**env, **missing})


def server_address(host: str | None, port: int | None, env=os.environ) -> tuple[str, int]:
    """Where to serve: explicit --host/--port win, then GRADIO_SERVER_NAME/GRADIO_SERVER_PORT, then defaults."""
    host = host or env.get("GRADIO_SERVER_NAME") or "127.0.0.1"
    if port is None:
        raw = env.get("GRADIO_SERVER_PORT")
        try:
            port = int(raw) if raw else 7860
        except ValueError:
            raise ValueError(f"GRADIO_SERVER_PORT must be an integer port, got {raw!r}") from None
    if not 0 < port < 65536:
        raise ValueError(f"port must lie in 1..65535, got {port}")
    return host, port


def live_model(a, cuda_available=None):
    """The live backend's model (`--model self-forcing`), loaded on the GPU; ValueError without CUDA or with
    missing or bad files."""
    import torch

    missing = [n for n, v in (("--checkpoint", a.checkpoint), ("--base", a.base)) if not v]
    if missing:
        raise ValueError(f"--model {a.model} needs {', '.join(missing)}")
    if not (torch.cuda.is_available() if cuda_available is None else cuda_available):
        raise ValueError(f"--model {a.model} generates live on a CUDA GPU, and this machine has none; record a run "
                         "elsewhere (quantwm record --model self-forcing --device cuda) and open it with --run FILE")
    from quantwm.adapters.self_forcing import SelfForcingLive, load_self_forcing

    models = load_self_forcing(a.checkpoint, a.base, "cuda", torch.bfloat16)
    return SelfForcingLive(models, "cuda", a.height, a.width, a.base, f"CUDA ({torch.cuda.get_device_name(0)})")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="quantwm app", description=__doc__.splitlines()[0])
    ap.add_argument("--trace", help="a QuantWM trace file (.safetensors)")
    ap.add_argument("--run", action="append", default=[], metavar="FILE",
                    help="a run file (`quantwm record`) to open in Generate & play (repeatable)")
    ap.add_argument("--weights", help="world-model weights (default: the built-in model shipped with the package)")
    ap.add_argument("--model", choices=("builtin", "self-forcing"), default="builtin",
                    help="self-forcing: also generate live with Self-Forcing's Wan2.1 generator on a CUDA GPU "
                         "(--checkpoint, --base)")
    ap.add_argument("--checkpoint", help="self-forcing: the released generator checkpoint (.pt)")
    ap.add_argument("--base", help="self-forcing: a local diffusers Wan2.1 folder (transformer/config.json, vae/)")
    ap.add_argument("--height", type=int, default=480, help="self-forcing: video height (default 480)")
    ap.add_argument("--width", type=int, default=832, help="self-forcing: video width (default 832)")
    ap.add_argument("--port", type=int, default=None, help="default: $GRADIO_SERVER_PORT, else 7860")
    ap.add_argument("--host", default=None, help="default: $GRADIO_SERVER_NAME, else 127.0.0.1")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads for generation (default 1)")
    lim = ap.add_argument_group("limits per request (default: derived from this machine)")
    lim.add_argument("--max-frames", type=int, help="frames one generation may ask for")
    lim.add_argument("--max-methods", type=int, help="methods in one comparison")
    lim.add_argument("--max-upload-mb", type=float, help="size of an uploaded trace file")
    lim.add_argument("--cache-mb", type=float, help="the shared results cache (default: half the memory planned with)")
    lim.add_argument("--memory-mb", type=float, help="memory to plan with (default: 60%% of what is available)")
    lim.add_argument("--max-seconds", type=float, default=120.0,
                     help="how long one generation may hold the queue, from the measured speed (default 120)")
    lim.add_argument("--file-age", type=int, default=1800,
                     help="seconds Gradio keeps its copies of served files (videos, frames) before deleting "
                          "them (default 1800; all are deleted at shutdown)")
    return ap


def main(argv: list[str] | None = None, restart: bool = True) -> None:
    """The app's process: `restart=False` skips the one re-execution that sets `SERVER_ENV` (for callers
    that are not the process's own entry point)."""
    a = parser().parse_args(argv)
    try:
        host, port = server_address(a.host, a.port)
        os.environ["GRADIO_SERVER_PORT"] = str(port)  # what gradio reads at import: now a valid integer
        if a.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {a.threads}")
        if a.file_age < 1:
            raise ValueError(f"--file-age must be >= 1 second, got {a.file_age}")
        if a.trace and not os.path.isfile(a.trace):
            raise ValueError(f"--trace {a.trace}: no such file")
        if restart:  # once the options above are known good: a bad one is refused without a second start
            restart_with_server_env()
        live = live_model(a) if a.model != "builtin" else None
        from .media import TempFiles

        files = TempFiles()
        atexit.register(files.close)
        os.environ.setdefault("GRADIO_TEMP_DIR", os.path.join(files.root, "gradio"))
        from quantwm.drivers.registry import RunRegistry
        from quantwm.drivers.workbench import Workbench
        from quantwm.evaluation.limits import Limits

        from . import world_handlers

        world_handlers.use_files(files)
        wb = Workbench(a.weights, threads=a.threads)  # bad weights and bad run files stop the start here, with
        runs = RunRegistry(wb)  # their reason, before the speed calibration and gradio's import (seconds)
        for path in a.run:
            runs.open(path)
        wb.set_limits(Limits.from_machine(
            wb.cfg, len(wb.methods()), wb.calibrate(), memory_mb=a.memory_mb, max_seconds=a.max_seconds,
            max_frames=a.max_frames, max_methods=a.max_methods, max_upload_mb=a.max_upload_mb, cache_mb=a.cache_mb))
        print(f"quantwm app: {wb.limits.describe()}", flush=True)
        from .assemble import build_app, launch_options

        app = build_app(a.trace, delete_cache=(max(1, a.file_age // 6), a.file_age), live=live, runs=runs)
    except ValueError as e:
        print(f"quantwm app: error: {e}", file=sys.stderr)
        sys.exit(2)
    # SIGTERM ends the process like Ctrl-C, so the temporary folder is removed then too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    app.queue(default_concurrency_limit=1).launch(server_name=host, server_port=port, **launch_options(wb))
