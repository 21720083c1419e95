"""The diagnostics app's entry point: `python app.py`, `quantwm app` or `python -m quantwm.app`.

Options: --trace FILE, --host, --port, --threads. The server address follows Gradio's conventions:
`--host` / `--port` when given, else `GRADIO_SERVER_NAME` / `GRADIO_SERVER_PORT`, else 127.0.0.1:7860.
The address is checked before gradio is imported (gradio itself fails at import on a malformed
GRADIO_SERVER_PORT); a bad option or file prints one line and exits 2.
"""
from __future__ import annotations

import argparse
import os
import sys


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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="quantwm app", description=__doc__.splitlines()[0])
    ap.add_argument("--trace", help="a QuantWM trace file (.safetensors)")
    ap.add_argument("--port", type=int, default=None, help="default: $GRADIO_SERVER_PORT, else 7860")
    ap.add_argument("--host", default=None, help="default: $GRADIO_SERVER_NAME, else 127.0.0.1")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads for generation (default 1)")
    a = ap.parse_args(argv)
    try:
        host, port = server_address(a.host, a.port)
        os.environ["GRADIO_SERVER_PORT"] = str(port)  # what gradio reads at import: now a valid integer
        from quantwm.evaluation.workbench import Workbench

        from .assemble import build_app, launch_options

        app = build_app(a.trace, Workbench(threads=a.threads))
    except ValueError as e:
        print(f"quantwm app: error: {e}", file=sys.stderr)
        sys.exit(2)
    app.queue(default_concurrency_limit=1).launch(server_name=host, server_port=port, **launch_options())
