"""QuantWM diagnostics app: `python app.py [--trace FILE] [--host H] [--port N] [--threads N]`.

The same app as `quantwm app` and `python -m quantwm.app`: app/main.py is the entry point (options, and
the GRADIO_SERVER_NAME / GRADIO_SERVER_PORT convention), app/assemble.py builds the page from the tabs.
"""
from app.main import main

if __name__ == "__main__":
    main()
