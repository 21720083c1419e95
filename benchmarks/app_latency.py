"""Time from pressing Generate to the first side-by-side result (both videos, the plot and the frames) on the
built-in world model, through the app's real API, plus what a second user waits for a scrub meanwhile, the
Key-vs-Value study on several seeds and the Methods table.

    python benchmarks/app_latency.py [--frames 32] [--method quantwm] [--seed 0] [--threads 1] [--budget 2.5]
                                     [--kv-seeds 4]

Targets on 2 CPU cores (issue 34): Generate under 20 s for 32 frames at the page's default (a budget of 2.5 bits
per element); Key vs Value on 4 seeds under 120 s; the Methods tab at one budget for the methods its page ticks at
first (read from the built page, `study_handlers.default_methods`) under 60 s. Prints one line per measurement,
with the machine's load average: the figures move with what else it runs. The two studies also give the CPU
seconds this process (the server, its rollouts and the client) spent on them, which other jobs move much less.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import tempfile
import time

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
ROOT = pathlib.Path(__file__).resolve().parents[1]


def load() -> str:
    """What else the machine is doing: its 1-minute load average against its cores (each measurement shares them)."""
    return f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=32)
    ap.add_argument("--method", default="quantwm")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--budget", type=float, default=2.5, help="the budget of every tab (bits per element)")
    ap.add_argument("--kv-seeds", type=int, default=4, help="worlds the Key-vs-Value study runs on")
    a = ap.parse_args()

    import sys

    sys.path.insert(0, str(ROOT))
    from gradio_client import Client

    from app import assemble as mod
    from quantwm.drivers.workbench import Workbench
    from quantwm.evaluation.synthetic import make_synthetic_trace

    trace = os.path.join(tempfile.mkdtemp(), "syn.safetensors")
    make_synthetic_trace(seed=0, n_layers=2, n_heads=4).save(trace)
    t0 = time.perf_counter()
    wb = Workbench(threads=a.threads)
    demo = mod.build_app(trace, wb, frames=a.frames)
    _, url, _ = demo.queue(default_concurrency_limit=1).launch(prevent_thread_lock=True, quiet=True,
                                                               **mod.launch_options())
    print(f"app start (model load, page build, server): {time.perf_counter() - t0:.2f} s on {wb.describe_device()}, "
          f"{wb.workers} rollout(s) at a time; {load()}")
    user, second = Client(url, verbose=False), Client(url, verbose=False)

    def generate(seed, method):
        t = time.perf_counter()
        out = user.predict(seed, "loop", method, "kv", 2, a.frames, a.budget, "budget", api_name="/generate")
        user.predict(out[1], out[5]["value"], [], "all", "all", api_name="/show_frame")
        return time.perf_counter() - t, out

    dt, out = generate(a.seed, a.method)
    print(f"Generate -> first side-by-side result, {a.frames} frames, {a.method} (BF16 + method, videos, plot, "
          f"frames), within {a.budget:g} bits: {dt:.2f} s  [target < 20 s]; {load()}")
    print(f"  {out[0]}")
    dt, _ = generate(a.seed, a.method)
    print(f"same settings again (cached): {dt:.3f} s")

    job = user.submit(a.seed + 1, "loop", a.method, "kv", 2, a.frames, a.budget, "budget", api_name="/generate")
    time.sleep(1.0)  # the generation (several seconds) is under way
    busy = not job.done()
    t = time.perf_counter()
    second.predict(out[1], a.frames - 1, ["flicker map", "top-1 jumps"], "all", "all", api_name="/scrub")
    scrub = time.perf_counter() - t
    running = busy and not job.done()
    job.result()
    print(f"second user's scrub while a generation runs: {scrub:.3f} s (generation still running: {running})")

    dt, cpu, updates, (status, *_) = timed(lambda: user.submit(a.seed + 3, "loop", "kivi", a.budget, a.frames, a.kv_seeds,
                                                          api_name="/key_vs_value"))
    print(f"Key vs Value, kivi and quantwm, {a.kv_seeds} seeds, {a.frames} frames: {dt:.2f} s  [target < 120 s] "
          f"({cpu:.1f} s of CPU); progress reported in {updates} of the status polls; {load()}")
    print(f"  {status}")

    methods = page_default(demo, "methods-choice")
    dt, cpu, updates, (status, table, _) = timed(lambda: user.submit(a.seed + 2, "loop", "kv", a.frames, methods, a.budget,
                                                                api_name="/methods_table"))
    print(f"Methods at {a.budget:g} bits per element, the page's default choice ({len(methods)}: {', '.join(methods)}), "
          f"{a.frames} frames: {dt:.2f} s  [target < 60 s] ({cpu:.1f} s of CPU); progress reported in {updates} of the "
          f"status polls; {load()}")
    print(f"  {status}")
    header = table["headers"]
    for row in table["data"]:
        print("  " + "  ".join(f"{c} {v}" for c, v in zip(header, row) if c != "configuration"))
    demo.close()


def timed(submit) -> tuple[float, float, int, tuple]:
    """Submit a job (`submit()`) and wait for it: (seconds, CPU seconds of this process, status polls that carried
    progress, its result)."""
    t, cpu, updates = time.perf_counter(), time.process_time(), 0
    job = submit()
    while not job.done():  # the progress updates the page shows, counted
        updates += job.status().progress_data is not None
        time.sleep(0.5)
    return time.perf_counter() - t, time.process_time() - cpu, updates, job.result()


def page_default(demo, elem_id: str) -> list:
    """The value a component of the built page opens with (its `elem_id`)."""
    return next(c["props"]["value"] for c in demo.config["components"] if c["props"].get("elem_id") == elem_id)


if __name__ == "__main__":
    main()
