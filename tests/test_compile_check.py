"""benchmarks/compile_check.py: the fused kernel compiles to a cubin for Hopper and Ampere on this CPU-only
machine (Triton's compiler and ptxas, no GPU), and the launcher refuses the 8-bit path where fp8 is missing; the
allocator's kernels compile for Hopper (the interpreter let them read a plain global a GPU compile refuses)."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def compiled(tmp_path, targets: str, only: str) -> list[dict]:
    """The rows of `benchmarks/compile_check.py --targets targets --only only`, which must exit 0."""
    out = tmp_path / "compile.json"
    done = subprocess.run([sys.executable, "benchmarks/compile_check.py", "--targets", targets, "--json", str(out),
                           "--only", only], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(out.read_text())["rows"]


def test_span_attention_compiles_for_sm90_and_sm80_and_lowp_is_refused_before_sm89(tmp_path):
    rows = {(r["variant"].split()[-1], r["sm"]): r for r in compiled(
        tmp_path, "90,80", "span_attention quantwm lowp=None,span_attention quantwm lowp=int8")}
    assert set(rows) == {("lowp=None", 90), ("lowp=int8", 90), ("lowp=None", 80), ("lowp=int8", 80)}
    for key in (("lowp=None", 90), ("lowp=int8", 90), ("lowp=None", 80)):
        assert rows[key]["status"] == "ok" and 0 < rows[key]["reg"] <= 255, rows[key]
    assert rows[("lowp=int8", 80)]["status"] == "refused" and "8.9 or newer" in rows[("lowp=int8", 80)]["error"]


def test_the_allocators_kernels_and_the_trellis_search_compile_for_sm90_without_spilling(tmp_path):
    rows = compiled(tmp_path, "90", "pack_channels,pack_channels sums,unshrink_channels,channel_errors,allocate_levels,"
                    "trellis_viterbi,trellis_choice")
    assert sorted(r["variant"] for r in rows) == ["allocate_levels", "channel_errors", "pack_channels",
                                                  "pack_channels states", "pack_channels sums", "trellis_choice",
                                                  "trellis_choice unbias", "trellis_viterbi", "trellis_viterbi states",
                                                  "trellis_viterbi window", "unshrink_channels"]
    assert all(r["status"] == "ok" and 0 < r["reg"] <= 255 and r["stack"] == 0 for r in rows), rows
