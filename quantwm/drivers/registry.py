"""Every run the app shows, by run id: `RunRegistry.view(run_id)` is the `views.RunView` of a run file opened
here (`open`, `add`: at most `max_opened`, the oldest dropped first) or of a built-in run in the Workbench's
results cache (an id such as "seed=0 loop quantwm kv 2-bit 32f"; ValueError when it was never generated or was
evicted); `pair` gives the views of two methods' runs against one BF16 generation, shown side by side.
`on_evict` callbacks hear of every opened run dropped (the app deletes its videos)."""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable

from ..evaluation.runfile import Run, read_run
from .views import RunView


class RunRegistry:
    def __init__(self, wb, max_opened: int = 8):
        """`wb`: the Workbench whose built-in runs this registry also shows."""
        self.wb = wb
        self.max_opened = max_opened
        self.on_evict: list[Callable[[str], None]] = []
        self._opened: OrderedDict[str, RunView] = OrderedDict()  # by run id, oldest first
        self._lock = threading.Lock()

    def open(self, path: str) -> str:
        """Open a run file (validated by `runfile.read_run`); returns the run id its views answer to."""
        run = read_run(path)
        m = run.meta
        return self.add(run, f"file={os.path.basename(str(path))} {m['method']} {m['target']} {m['bits']}-bit")

    def add(self, run: Run, run_id: str) -> str:
        """Serve the views of `run` (a `runfile.Run`, e.g. generated live) under `run_id`."""
        view = RunView(run, run_id)
        with self._lock:
            self._opened.pop(run_id, None)
            self._opened[run_id] = view
            gone = []
            while len(self._opened) > self.max_opened:  # the oldest opened run goes (and its videos)
                gone.append(self._opened.popitem(last=False)[0])
        for run_id_gone in gone:
            for callback in self.on_evict:
                callback(run_id_gone)
        return run_id

    def opened(self) -> list[str]:
        """The ids of the opened runs, oldest first."""
        return list(self._opened)

    def is_opened(self, run_id: str) -> bool:
        return str(run_id) in self._opened

    def view(self, run_id: str) -> RunView:
        """The views of an opened run or of a built-in run of the results cache (used: it and its reference move
        to the recent end)."""
        view = self._opened.get(str(run_id or ""))
        if view is not None:
            return view
        rec = self.wb.record(run_id)
        return RunView.of_records(self.wb.cfg, self.wb.record(rec.key.reference().id), rec)

    def pair(self, run_id: str, run_b: str | None) -> tuple[RunView, RunView | None]:
        """The views of run `run_id` and of `run_b`, another method's run against the same BF16 generation shown
        beside it (None or "": none); ValueError when `run_b` is not of the same BF16 generation."""
        view = self.view(run_id)
        if not run_b:
            return view, None
        other = self.view(run_b)
        if not view.same_reference(other):
            raise ValueError(f"{str(run_b)!r:.120} cannot be shown beside {str(run_id)!r:.120}: a method B must be run "
                             "against the same BF16 generation (the same world, trajectory, frames and noise)")
        return view, other

    def frame_size(self, run_id: str) -> tuple[int, int]:
        """(H, W) of a run's output frames (an opened run's, else the built-in model's)."""
        view = self._opened.get(str(run_id or ""))
        if view is not None:
            return view.frame_size()
        size = self.wb.cfg.view * self.wb.cfg.patch
        return size, size
