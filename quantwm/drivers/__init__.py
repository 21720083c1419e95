"""Drivers (layer 4): what runs the model and the measures for the app and the command line.

`workbench.py` hosts the built-in world model and its results cache of rollouts (`runs.py`: run ids and compact
records); `views.py` shows one run, built-in or opened from a run file, through one class (`RunView`);
`registry.py` maps run ids to their views and keeps the run files opened; `studies.py` compares runs (a method
against BF16, Keys vs Values, every method at one budget); `run_figures.py` prints a run's figures; `frontier.py`
sweeps every method's budget knobs (`quantwm frontier`). docs/architecture.md has the layers.
"""
