"""The device check: everything a lent GPU should tell us, in one run, within a time budget.

    bash benchmarks/gpu_check.sh                 # on a CUDA GPU: at most 8 minutes by its own clock
    bash benchmarks/gpu_check.sh --dry-run       # the same steps on the CPU at tiny shapes (CI runs this)
    bash benchmarks/gpu_check.sh --steps "kernel bench,live rollout"   # only these steps (e.g. one that failed)

Steps, each in its own process with its own time limit, skipped with a message once the budget is spent (on the
dry run, each on one CPU thread):

1. `cuda tests`: the kernel and attention tests (every kernel compiled, the fused path against the reference
   for every method); on the CPU (dry run) a small subset under the Triton interpreter.
2. `cuda tier`: tests/test_fake_cuda.py on real CUDA tensors (every method on K, V, KV at 2 bits and a budget,
   pre-RoPE, loud tokens, windows, re-aimed S, the adapters, a rollout; host reads counted by site); on the CPU
   (dry run) a subset on fake `cuda` tensors.
3. `warm attend`: `benchmarks/warm_attend.py`, a warm `quantwm` cache at a 2.5-bit budget attended under
   `torch.cuda.set_sync_debug_mode("error")` (no host sync, no kernel view built), then captured in a CUDA graph
   and replayed against an eager attend (on the CPU: the sync count only).
4. `commit cost`: `benchmarks/commit_cost.py` for quantwm and kivi at 2.5 bits at Wan-1.3B shapes: each commit's
   ATen ops, kernel launches and host syncs per layer, its cost estimated by the script's stated model, and on
   CUDA the commit timed with CUDA events beside a BF16 SDPA over the same cache (issue 42).
5. `trellis encode`: `benchmarks/trellis_gain.py --encode-time`, one span of Wan-1.3B's shape (12 heads x 4680
   tokens x 128, widths 0-8 at random) coded as quantwm-trellis codes its Values, by its Triton kernels (the
   Viterbi searches, the grid-or-trellis choice with the stretch, the packing), timed after the compile (a
   layer's commit codes two such spans); the dry run: 1 x 64 x 32 on the CPU path.
6. `kernel bench`: `quantwm selfcheck --model wan-1.3b` (the command a user runs; its timing is
   quantwm/evaluation/kernel_timing.py, which `benchmarks/kernel_bench.py` runs too): which path every method
   takes, every kernel checked against its reference on first use, and the timing at Wan-1.3B shapes (12 heads
   x 128, chunks of 4680 queries, caches of 8K/32K/64K tokens): BF16 SDPA (the flash backend on CUDA), dequantize-then-SDPA, the fused 2-bit
   kernel, its 8-bit paths (INT8 and e4m3 QKᵀ, e4m3 PV), and the cost of quantizing a committed chunk as a share
   of the chunk's attention time. The dry run: the tiny preset at 1 head x 64, chunks of 32 tokens, caches of 96
   and 128 tokens (every path, a quantized span at each length).
7. `real shapes`: `benchmarks/real_shapes.py`, a randomly initialised Wan-1.3B-sized transformer generating
   chunk by chunk through the cache (bytes, peak memory, time per chunk).
8. `live rollout`: a random Self-Forcing model (diffusers Wan classes, 2 layers at Wan-1.3B's 12 heads x 128 and
   its 480x832 frames) recorded BF16 vs quantwm through the live backend's recorder, written as a run file
   and read back.

Prints one table (step, status, seconds, the figures that matter) and writes one JSON (`--out`, default
out/gpu_check/gpu_check.json) with every step's figures and the tail of its output. Exit code 1 when a step
failed; a step skipped for lack of budget is reported, not failed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 480  # 8 minutes on the device, by this script's own clock
DRY_BUDGET_S = 360
MIN_STEP_S = 20  # a step that cannot have this long is skipped


def steps(out: Path, dry: bool) -> list[dict]:
    """(name, command, its own limit in seconds) for each step; `dry`: CPU, tiny shapes."""
    py = sys.executable
    tests = ["tests/test_kernels.py", "tests/test_attention.py"]
    return [
        {"name": "cuda tests", "limit": 120 if dry else 140,
         "cmd": [py, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-x",
                 *(["tests/test_kernels.py", "-k", "pack_bits or kmeans_assign"] if dry else tests)]},
        {"name": "cuda tier", "limit": 60 if dry else 60,  # issue 42: the fake-CUDA tier, on real CUDA tensors
         "cmd": [py, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "tests/test_fake_cuda.py",
                 *(["-k", "kivi or quantwm-alloc"] if dry else [])]},
        {"name": "warm attend", "limit": 60 if dry else 50,
         "cmd": [py, "benchmarks/warm_attend.py", *(["--dry-run"] if dry else [])]},
        {"name": "commit cost", "limit": 60 if dry else 90,  # issue 42: a commit's cost, counted, priced and timed
         "cmd": [py, "benchmarks/commit_cost.py", "--preset", "wan-1.3b", "--methods",
                 "quantwm,kivi" if dry else "quantwm,quantwm-trellis-v,kivi", "--budget", "2.5",
                 "--json", str(out / "commit_cost.json"), *(["--dry-run"] if dry else [])]},
        {"name": "trellis encode", "limit": 30 if dry else 60,  # quantwm-trellis's search, choice and packing, one span timed
         "cmd": [py, "benchmarks/trellis_gain.py", "--encode-time",
                 *(["--shape", "1,64,32"] if dry else ["--device", "cuda", "--shape", "12,4680,128"])]},
        {"name": "kernel bench", "limit": 150 if dry else 180,  # the user's own check: `quantwm selfcheck`
         "cmd": [py, "-m", "quantwm", "selfcheck", "--model", "tiny" if dry else "wan-1.3b",
                 *(["--heads", "1", "--chunk-tokens", "32", "--lengths", "96,128"] if dry else ["--lengths", "8192,32768,65536"]),
                 "--json", str(out / "kernel_bench.json")]},
        {"name": "real shapes", "limit": 120 if dry else 70,
         "cmd": [py, "benchmarks/real_shapes.py", "--json", str(out / "real_shapes.json"),
                 *(["--reduced", "--steps", "1", "--layers", "2", "--chunks", "3", "--methods", "quantwm", "--threads", "1"] if dry
                   else ["--steps", "2"])]},
        {"name": "live rollout", "limit": 120 if dry else 60,
         "cmd": [py, "benchmarks/gpu_check.py", "--live-rollout", str(out / "live.safetensors"),
                 *(["--dry-run"] if dry else [])]},
    ]


def run_steps(out: Path, dry: bool, budget: float, only: list[str] | None = None) -> list[dict]:
    """Run the steps (`only`: those named, in the script's order), each within its limit and the budget left."""
    out.mkdir(parents=True, exist_ok=True)
    start, results = time.perf_counter(), []
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if dry:  # tiny shapes: a second CPU thread only spins against other work (a test suite's other worker)
        env["OMP_NUM_THREADS"] = "1"
    for step in steps(out, dry):
        if only is not None and step["name"] not in only:
            continue
        left = budget - (time.perf_counter() - start)
        limit = min(step["limit"], left)
        row = {"name": step["name"], "command": " ".join(step["cmd"][1:])}
        if limit < MIN_STEP_S:
            results.append({**row, "status": "skipped", "seconds": 0.0,
                            "note": f"skipped: {left:.0f} s of the {budget:.0f} s budget left"})
            print(f"[gpu_check] {step['name']}: skipped, budget spent", flush=True)
            continue
        print(f"[gpu_check] {step['name']}: {row['command']} (limit {limit:.0f} s)", flush=True)
        t = time.perf_counter()
        try:
            done = subprocess.run(step["cmd"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
            rc, text = done.returncode, done.stdout + done.stderr
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired as e:  # what it printed so far (bytes, whatever text= says)
            rc, status, text = None, "timed out", _text(e.stdout) + _text(e.stderr)
        row.update(status=status, rc=rc, seconds=round(time.perf_counter() - t, 1), tail=text[-3000:])
        row["figures"] = figures(step["name"], out, text)
        results.append(row)
    return results


def _text(x) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")


def figures(name: str, out: Path, text: str) -> dict:
    """The figures of one step that the table shows, from its JSON or its output."""
    try:
        if name in ("cuda tests", "cuda tier"):
            last = [line for line in text.splitlines() if " passed" in line or " failed" in line or " error" in line]
            return {"summary": last[-1].strip("= ") if last else "no summary"}
        if name == "warm attend":
            return {"checks": [line for line in text.splitlines() if line.startswith(("ok", "FAILED", "skip"))]}
        if name == "commit cost":  # per method: steady commit ms per layer (measured on CUDA, else None), the
            rows = json.loads((out / "commit_cost.json").read_text())["rows"]  # estimate, syncs, share of the chunk
            return {r["method"]: {"measured_ms": round(statistics.fmean(r["measured"]["commit_ms"][1:]), 3)
                                  if r.get("measured") else None,
                                  "estimated_ms": round(r["estimate"]["commit_gpu_ms"]["steady"], 3),
                                  "syncs": r["commit"]["mean"]["syncs"],
                                  "share": round(r["estimate"]["commit_share"]["steady"], 4)} for r in rows}
        if name == "trellis encode":  # seconds for one span: a Wan-1.3B layer's commit codes two (Keys, Values)
            line = next(line for line in text.splitlines() if " coded in " in line)
            return {"span": line.split(" coded in ")[0].removeprefix("one span of "),
                    "seconds": float(line.split(" coded in ")[1].split()[0])}
        if name == "kernel bench":
            rows = json.loads((out / "kernel_bench.json").read_text())["rows"]
            return {f"{r['path']} @ {r['cache_tokens']}": round(r["vs_bf16"], 3) for r in rows}
        if name == "real shapes":
            rows = json.loads((out / "real_shapes.json").read_text())
            return {r["method"]: {k: r[k] for k in ("quantized_bytes_per_latent_frame", "seconds_per_chunk")
                                  if k in r} for r in rows}
        if name == "live rollout":  # its one JSON line, among the libraries' warnings
            return json.loads(next(line for line in reversed(text.splitlines()) if line.startswith("{")))
    except (OSError, ValueError, KeyError, IndexError, StopIteration) as e:
        return {"unreadable": f"{type(e).__name__}: {e}"}
    return {}


def live_rollout(path: str, dry: bool) -> dict:
    """Record a random Self-Forcing model (BF16 vs quantwm) as the live backend does, write and read back the
    run file; returns its facts."""
    import diffusers
    import torch

    from quantwm.adapters.self_forcing import record_self_forcing
    from quantwm.evaluation.runfile import read_run, write_run

    device = "cuda" if torch.cuda.is_available() and not dry else "cpu"
    heads, head_dim, (h, w) = (2, 64, (32, 64)) if dry else (12, 128, (480, 832))
    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim, in_channels=16,
        out_channels=16, text_dim=64, freq_dim=32, ffn_dim=4 * heads * head_dim if not dry else 128, num_layers=2,
        rope_max_seq_len=1024).eval()
    vae = diffusers.AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                     temperal_downsample=[False, True, True]).eval()
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model, vae = model.to(device, dtype), vae.to(device, torch.float32)
    text = torch.randn(1, 8, 64, generator=torch.Generator().manual_seed(1))
    t = time.perf_counter()
    run = record_self_forcing(None, None, text.to(device, dtype), "quantwm", latent_frames=12, height=h, width=w,
                              logit_layers=[1], logit_heads=[0], device=device, models=(model, vae))
    seconds = time.perf_counter() - t
    write_run(path, run)
    back = read_run(path)
    flips = torch.cat([(e != q).flatten() for e, q in back.top1.values()]).float()
    return {"device": device, "frames": int(back.method.shape[0]), "frame_hw": list(back.method.shape[1:3]),
            "bits_per_element": round(float(back.meta["bits_per_element"]), 3),
            "top1_shift_probed": round(float(flips.mean()), 4), "seconds": round(seconds, 1)}


def table(results: list[dict]) -> str:
    lines = [f"{'step':<14} {'status':<10} {'seconds':>8}  figures"]
    for r in results:
        figs = r.get("note") or json.dumps(r.get("figures", {}))[:400]
        lines.append(f"{r['name']:<14} {r['status']:<10} {r['seconds']:>8.1f}  {figs}")
    return "\n".join(lines)


def main(argv=None) -> int:
    names = [s["name"] for s in steps(Path("."), False)]  # the same names on a dry run
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="the same steps on the CPU at tiny shapes")
    ap.add_argument("--budget", type=float, help=f"seconds in all (default {BUDGET_S}; dry run {DRY_BUDGET_S})")
    ap.add_argument("--out", default=str(ROOT / "out" / "gpu_check"), help="folder for the JSON and step outputs")
    ap.add_argument("--steps", help="only these steps, comma-separated names (e.g. to rerun one that failed): "
                    + ", ".join(names))
    ap.add_argument("--live-rollout", metavar="PATH", help=argparse.SUPPRESS)  # the live-rollout step, in its own process
    a = ap.parse_args(argv)
    if a.live_rollout:
        print(json.dumps(live_rollout(a.live_rollout, a.dry_run)))
        return 0
    only = None
    if a.steps is not None:
        only = [n.strip() for n in a.steps.split(",") if n.strip()]
        unknown = [n for n in only if n not in names]
        if unknown or not only:
            ap.error(f"--steps: unknown step(s) {', '.join(map(repr, unknown)) or '(none given)'}; "
                     f"the steps are: {', '.join(names)}")
    import torch

    if not a.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; use --dry-run to check the script on the CPU", file=sys.stderr)
        return 2
    budget = a.budget or (DRY_BUDGET_S if a.dry_run else BUDGET_S)
    device = "cpu (dry run)" if a.dry_run else torch.cuda.get_device_name(0)
    print(f"gpu_check on {device}, torch {torch.__version__}, budget {budget:.0f} s", flush=True)
    out = Path(a.out)
    t = time.perf_counter()
    results = run_steps(out, a.dry_run, budget, only)
    report = {"device": device, "torch": torch.__version__, "dry_run": a.dry_run, "budget_s": budget,
              "seconds": round(time.perf_counter() - t, 1), "steps": results}
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    print(table(results))
    print(f"total {report['seconds']:.0f} s of {budget:.0f} s; wrote {out / 'gpu_check.json'}")
    return 1 if any(r["status"] in ("failed", "timed out") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
