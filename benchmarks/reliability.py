"""Reliability of the real app under load, malformed requests and long use (a benchmark, not a timed test).

    python benchmarks/reliability.py [--clients 4] [--fuzz 200] [--generations 50] [--seed 0]

Starts `python -m quantwm.app` in a subprocess (its own temporary folder, a small results cache so that
eviction happens within the run) and talks to it only through its API (`gradio_client`), then prints:

1. **Concurrent users**: `--clients` scripted clients at once, each generating its own world, scrubbing it
   and tracing a pixel. Each client's numbers are checked against the same run computed in this process
   (a run is deterministic), its scrub and trace against its own run id.
2. **Fuzzer** (seeded): `--fuzz` malformed requests spread over every endpoint the app lists, each with one
   or more parameters replaced by wrong types, out-of-range or huge numbers, NaN/Inf, huge strings, stale
   run ids, empty and garbage files. Counts the requests answered by a clear error (the status names the
   problem, or Gradio refuses the value with a message), those accepted (the fuzzed value happened to be
   valid), and crashes: a request that got no answer, or a dead server. The server must answer a normal
   request afterwards.
3. **Memory**: the server's resident memory after a warm-up that fills the results cache, every 5 of
   `--generations` further generations of new worlds (each scrubbed, as a user would), and at the end; the
   growth after the warm-up must stay under 3%.
4. **Disk**: bytes in the app's temporary folder after the warm-up, after the generations, and after
   shutdown (where it must be gone).
"""
from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from quantwm.app.media import folder_bytes as disk_bytes

FRAMES = 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


class App:
    def __init__(self, cache_mb: float, port: int):
        self.tmp = tempfile.mkdtemp(prefix="quantwm-reliability-")
        env = {**os.environ, "TMPDIR": self.tmp, "GRADIO_ANALYTICS_ENABLED": "False"}
        env.pop("GRADIO_TEMP_DIR", None)
        self.url = f"http://127.0.0.1:{port}/"
        self.proc = subprocess.Popen([sys.executable, "-m", "quantwm.app", "--port", str(port), "--cache-mb",
                                      str(cache_mb), "--max-seconds", "60"], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.log: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()
        t0 = time.time()
        while time.time() - t0 < 180:
            if self.proc.poll() is not None:
                raise RuntimeError("the app exited at start-up:\n" + "".join(self.log))
            try:
                urllib.request.urlopen(self.url, timeout=2)
                return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError("the app did not start within 180 s")

    def _drain(self):
        for line in self.proc.stdout:
            self.log.append(line)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9


def client(url):
    from gradio_client import Client

    return Client(url, verbose=False)


# ---- 1. concurrent users ----------------------------------------------------------------------------------
def concurrent_users(url: str, n: int) -> tuple[int, list[str]]:
    from quantwm.drivers import studies
    from quantwm.drivers.workbench import RunKey, Workbench

    methods = ["quantwm", "kivi", "qvg", "rtn"]
    keys = [RunKey(seed=500 + i, trajectory="loop", method=methods[i % 4], frames=FRAMES) for i in range(n)]
    results, problems = {}, []

    def user(i, key):
        try:
            c = client(url)
            g = c.predict(key.seed, key.trajectory, key.method, key.target, key.bits, key.frames, sizing="bits",
                          world="photo", method_b="none", api_name="/generate")
            scrub = c.predict(g[1], FRAMES - 1, ["flicker map"], "all", "all", api_name="/scrub")
            trace = c.predict(g[1], FRAMES - 1, 10, 20, 1, 0, api_name="/trace_pixel")
            results[i] = (g, scrub, trace)
        except Exception as e:  # noqa: BLE001 - reported
            problems.append(f"client {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=user, args=(i, k)) for i, k in enumerate(keys)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    wb = Workbench()
    served = 0
    for i, key in enumerate(keys):
        if i not in results:
            continue
        g, scrub, trace = results[i]
        want = studies.compare(wb, key)["summary"]
        ok = (g[1] == key.id and f"PSNR vs BF16 {want['psnr']:.2f} dB" in g[0]
              and scrub[0].startswith(f"Frame **{FRAMES - 1}**") and trace[-1]["query"] == [FRAMES - 1, 2, 1])
        served += ok
        if not ok:
            problems.append(f"client {i}: wrong results: {g[0][:120]} / {scrub[0][:60]} / {trace[-1]}")
    return served, problems


# ---- 2. fuzzer --------------------------------------------------------------------------------------------
def garbage_files(root: str, rng: random.Random) -> list[str]:
    paths = []
    for name, data in (("empty.safetensors", b""), ("garbage.safetensors", bytes(rng.getrandbits(8) for _ in range(4096))),
                       ("header.safetensors", (2 ** 62).to_bytes(8, "little") + b"{}"),
                       ("text.safetensors", b'{"not": "a trace"}' * 100)):
        p = os.path.join(root, name)
        with open(p, "wb") as f:
            f.write(data)
        paths.append(p)
    return paths


def bad_values(rng: random.Random, files: list[str]) -> list:
    return [None, "", "abc", -1, -10 ** 9, 10 ** 9, 10 ** 18, 1e308, math.nan, math.inf, -math.inf, 2.5, True,
            [], [1, 2], {"a": 1}, "x" * 100_000, "seed=999 loop quantwm kv 2-bit 10f",
            "seed=0 loop quantwm kv 2-bit 100000f", "seed=-1 loop x kv 2-bit 10f", "all", "\x00\xff",
            rng.choice(files)]


def call_raw(url: str, name: str, data: list, timeout: float = 300) -> tuple[str, object]:
    """One request over Gradio's HTTP API (JSON with NaN/Inf literals allowed, as a hand-written client might
    send): ("complete", outputs), ("error", message), ("http", status and detail)."""
    import json

    import httpx

    body = json.dumps({"data": data}, allow_nan=True)
    r = httpx.post(f"{url}gradio_api/call{name}", content=body, headers={"Content-Type": "application/json"},
                   timeout=timeout)
    if r.status_code != 200:
        return "http", f"{r.status_code} {r.text[:200]}"
    event_id = r.json()["event_id"]
    event = None
    with httpx.stream("GET", f"{url}gradio_api/call{name}/{event_id}", timeout=timeout) as resp:
        for line in resp.iter_lines():
            if line.startswith("event:"):
                event = line.split(":", 1)[1].strip()
            elif line.startswith("data:") and event in ("complete", "error"):
                payload = line.split(":", 1)[1].strip()
                return event, json.loads(payload) if payload not in ("", "null") else None
    return "none", None


def upload(url: str, path: str) -> dict:
    import httpx

    with open(path, "rb") as f:
        r = httpx.post(f"{url}gradio_api/upload", files={"files": (os.path.basename(path), f)}, timeout=60)
    r.raise_for_status()
    return {"path": r.json()[0], "meta": {"_type": "gradio.FileData"}, "orig_name": os.path.basename(path)}


def fuzz(url: str, n: int, rng: random.Random, tmp: str, good_run: str) -> dict:
    api = client(url).view_api(return_format="dict", print_info=False)["named_endpoints"]
    files = garbage_files(tmp, rng)
    uploaded = {p: upload(url, p) for p in files}
    valid = {"seed": 0, "trajectory": "loop", "method": "quantwm", "target": "kv", "bits": 2, "frames": FRAMES,
             "run_id": good_run, "frame": FRAMES - 1, "overlays": [], "layer": 0, "head": 0, "x": 5, "y": 5,
             "formats": ["png"], "baseline": "kivi", "methods": ["rtn"], "path": None, "query": 0}
    counts = {"requests": 0, "error_message": 0, "accepted": 0, "crash": 0}
    crashes, accepted, per_endpoint = [], [], {}
    names = sorted(api)
    for i in range(n):
        name = names[i % len(names)]
        params = [p["parameter_name"] for p in api[name]["parameters"]]
        args = {p: valid.get(p) for p in params}
        for p in rng.sample(params, k=max(1, min(len(params), rng.choice([1, 1, 2, 3])))):
            args[p] = rng.choice(bad_values(rng, files))
        for p, v in args.items():  # garbage files travel as uploads (any parameter may get one)
            if isinstance(v, str) and v in uploaded:
                args[p] = uploaded[v]
        counts["requests"] += 1
        per_endpoint[name] = per_endpoint.get(name, 0) + 1
        try:
            kind, out = call_raw(url, name, list(args.values()))
        except Exception as e:  # noqa: BLE001 - no answer: a crash
            kind, out = "crash", f"{type(e).__name__}: {e}"
        first = out[0] if kind == "complete" and isinstance(out, list) and out else out
        if kind == "complete" and isinstance(first, str) and first.startswith("**Error:**"):
            counts["error_message"] += 1
        elif kind in ("error", "http") and out:  # Gradio refused the value (type, range, choices) with a message
            counts["error_message"] += 1
        elif kind == "complete":
            counts["accepted"] += 1
            accepted.append(f"{name} {args!r:.160}: {str(first)[:120]}")
        else:
            counts["crash"] += 1
            crashes.append(f"{name} {args!r:.160}: {kind} {str(out)[:200]}")
    return {**counts, "endpoints": len(per_endpoint), "crashes": crashes, "accepted_requests": accepted}


# ---- 3/4. memory and disk over many generations -----------------------------------------------------------
def generations(url: str, seeds: range, pid: int | None = None, every: int = 5, trail: list | None = None) -> int:
    """Generate (and scrub) each seed in turn; with `pid`, the server's resident MB every `every` runs goes
    to `trail`."""
    c = client(url)
    failures = 0
    for i, s in enumerate(seeds):
        if pid is not None and i % every == 0:
            trail.append(rss_mb(pid))
        g = c.predict(s, "loop", "quantwm", "kv", 2, FRAMES, world="photo", method_b="none", api_name="/generate")
        if g[0].startswith("**Error"):
            failures += 1
            continue
        c.predict(g[1], FRAMES - 1, ["flicker map", "top-1 jumps"], "all", "all", api_name="/scrub")
    return failures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--fuzz", type=int, default=200)
    ap.add_argument("--generations", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=12, help="generations that fill the results cache first")
    ap.add_argument("--cache-mb", type=float, default=150.0, help="the app's results cache (small: eviction happens)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    rng = random.Random(a.seed)
    t0 = time.time()
    app = App(a.cache_mb, free_port())
    limits = next((line.strip() for line in app.log if "Limits per request" in line), "")
    print(f"app started in {time.time() - t0:.0f} s; {limits}", flush=True)
    try:
        t = time.time()
        served, problems = concurrent_users(app.url, a.clients)
        print(f"1. concurrent users: {served}/{a.clients} served with their own correct results "
              f"({time.time() - t:.0f} s)", flush=True)
        for p in problems:
            print("   ", p)
        rss = rss_mb(app.proc.pid)
        t = time.perf_counter()
        huge = client(app.url).predict(0, "loop", "quantwm", "kv", 2, 100000, world="photo", method_b="none",
                                       api_name="/generate")[0]
        print(f"   frames=100000: answered in {time.perf_counter() - t:.2f} s, resident memory {rss:.0f} -> "
              f"{rss_mb(app.proc.pid):.0f} MB: {huge}", flush=True)
        good_run = f"seed=500 loop quantwm kv 2-bit {FRAMES}f"
        t = time.time()
        fuzz_dir = tempfile.mkdtemp(prefix="quantwm-fuzz-")
        f = fuzz(app.url, a.fuzz, rng, fuzz_dir, good_run)
        shutil.rmtree(fuzz_dir, ignore_errors=True)
        after = client(app.url).predict(0, "loop", "rtn", "kv", 2, FRAMES, world="photo", method_b="none",
                                        api_name="/generate")[0]
        print(f"2. fuzzer (seed {a.seed}): {f['requests']} malformed requests over {f['endpoints']} endpoints: "
              f"{f['error_message']} answered with an error message, {f['accepted']} accepted as valid, "
              f"{f['crash']} crashes; server alive: {app.alive()}; a normal request afterwards: "
              f"{'ok' if not after.startswith('**Error') else after} ({time.time() - t:.0f} s)", flush=True)
        for c in f["crashes"][:10]:
            print("    crash:", c)
        for c in f["accepted_requests"][:10]:
            print("    accepted:", c)
        generations(app.url, range(1000, 1000 + a.warmup))
        rss0, disk0 = rss_mb(app.proc.pid), disk_bytes(app.tmp)
        t = time.time()
        trail: list[float] = []
        failed = generations(app.url, range(2000, 2000 + a.generations), app.proc.pid, 5, trail)
        rss1, disk1 = rss_mb(app.proc.pid), disk_bytes(app.tmp)
        print(f"3. memory: resident {rss0:.0f} MB after {a.warmup} warm-up generations, {rss1:.0f} MB after "
              f"{a.generations} more ({(rss1 / rss0 - 1):+.1%}; every 5: {', '.join(f'{x:.0f}' for x in trail)}, "
              f"{rss1:.0f} MB; {failed} failed; {time.time() - t:.0f} s)")
        print(f"4. disk: temporary files {disk0 / 2 ** 20:.1f} MB after the warm-up, {disk1 / 2 ** 20:.1f} MB after "
              f"the generations", end="")
        crashed = not app.alive()
    finally:
        rc = app.stop()
    left = disk_bytes(app.tmp)
    print(f", {left / 2 ** 20:.1f} MB after shutdown (exit code {rc})")
    shutil.rmtree(app.tmp, ignore_errors=True)
    bad = crashed or f["crash"] or f["accepted"] or served < a.clients or rss1 / rss0 - 1 >= 0.03 or left > 0
    print("PASS" if not bad else "FAIL")
    return int(bool(bad))


if __name__ == "__main__":
    sys.exit(main())
