"""`python -m quantwm.app` (installed) or `python -m app` (in the checkout): the diagnostics app."""
from .main import main

main()
