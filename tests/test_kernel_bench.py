"""benchmarks/kernel_bench.py runs end to end on the CPU with its tiny preset (the GPU figures come from the device)."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

_spec = importlib.util.spec_from_file_location("kernel_bench", Path(__file__).parents[1] / "benchmarks" / "kernel_bench.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_bench_tiny_preset_prints_every_path_for_every_cache_length(tmp_path, capsys):
    out = tmp_path / "bench.json"
    bench.main(["--preset", "tiny", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    lengths = sorted({r["cache_tokens"] for r in rows})
    assert lengths == [192, 320]
    for L in lengths:
        paths = {r["path"]: r for r in rows if r["cache_tokens"] == L}
        assert set(paths) == {"bf16", "dequant+sdpa", "fused", "fused int8", "fused e4m3", "quantize chunk (quantwm)"}
        assert paths["bf16"]["vs_bf16"] == 1.0
        for name in ("dequant+sdpa", "fused", "fused int8", "fused e4m3"):
            assert paths[name]["ms"] > 0 and paths[name]["bytes"] < paths["bf16"]["bytes"]  # 2-bit spans read less
        assert math.isfinite(paths["quantize chunk (quantwm)"]["ms"])
    assert "fused" in capsys.readouterr().out
