"""QuantWM diagnostics app: `python app.py [--trace FILE] [--host H] [--port N] [--threads N]`.

The same app as `quantwm app` and `python -m quantwm.app`; it is assembled in app/main.py from the tabs
of app/ (see that module for the options and the GRADIO_SERVER_NAME / GRADIO_SERVER_PORT convention).
"""
from app.main import build_app, launch_options, main

__all__ = ["build_app", "launch_options", "main"]

if __name__ == "__main__":
    main()
