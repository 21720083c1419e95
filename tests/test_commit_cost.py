"""benchmarks/commit_cost.py and its counter, benchmarks/op_count.py: known snippets counted right (syncs, views,
launches, a bmm's FLOPs and bytes, a kernel launch once), the cost model's arithmetic, the dry run's every figure,
and a bad method or preset as one line and exit 2."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import commit_cost  # noqa: E402
from op_count import Kernel, TritonLaunches, counting  # noqa: E402


def test_counter_an_item_is_one_sync_and_a_view_is_a_view():
    x = torch.randn(4, 8)
    with counting() as t:
        y = x.t()
        x.sum().item()
    assert y.shape == (8, 4)
    assert t.ops == 3 and t.views == 1 and t.launches == 2 and t.metadata == 0  # t, sum, _local_scalar_dense
    assert t.syncs == [("item (aten._local_scalar_dense)", "outside quantwm")]


def test_counter_a_bmm_is_one_launch_of_2mnk_flops_over_its_bytes():
    a, b = torch.randn(2, 3, 4), torch.randn(2, 4, 5)
    with counting() as t:
        torch.bmm(a, b)
    assert (t.ops, t.launches, t.flops) == (1, 1, 2 * 2 * 3 * 4 * 5)
    assert t.bytes == 4 * (24 + 40 + 30) and t.kernels[0] == Kernel("bmm", 376, 240, torch.float32, True)
    with counting() as t:
        torch.empty(3, 3)
    assert (t.ops, t.metadata, t.launches) == (1, 1, 0)


def test_counter_names_each_kind_of_sync_once():
    x, mask = torch.randn(8, 8), torch.rand(8, 8) > 0.5
    spd = x @ x.T + 8 * torch.eye(8)
    with counting() as t:
        x[mask]                   # boolean indexing: HostSyncs and aten.index, one event
        x.cpu()                   # no ATen op on the CPU: HostSyncs alone
        x.to(x.device)            # device-resident code: not a sync
        torch.linalg.eigh(spd)    # its info check hides inside the op
        torch.linalg.cholesky(spd)  # its info check is an op of its own
        torch.nonzero(x > 0)
    names = [name for name, _ in t.syncs]
    assert names == ["__getitem__ (aten.index)", "cpu", "aten._linalg_eigh", "aten._linalg_check_errors",
                     "nonzero (aten.nonzero)"]


def test_counter_where_is_the_innermost_quantwm_frame():
    from quantwm.core.quant import check_finite

    with counting() as t:
        check_finite(torch.randn(16))
    assert t.syncs and all(w.startswith("quantwm/core/quant.py:") and w.endswith(" check_finite") for _, w in t.syncs)


def test_counter_counts_a_kernel_launch_once_and_not_the_twin_that_stands_in_for_it():
    pytest.importorskip("triton")
    from quantwm.core.backend import kernel
    from quantwm.core.quant import pack_bits_ref

    codes = torch.randint(0, 4, (4, 64), dtype=torch.uint8)
    with TritonLaunches(reference=True) as launches, counting(launches) as t:
        packed = kernel("pack_bits")(codes, 2)
    assert torch.equal(packed, pack_bits_ref(codes, 2))
    assert (t.ops, t.launches, t.triton, t.by_op["triton:pack_bits"]) == (1, 1, 1, 1) and not t.syncs
    assert t.bytes == codes.numel() + packed.numel()
    assert kernel("pack_bits") is not None and "counted" not in kernel("pack_bits").__name__  # restored on exit


def test_a_viterbi_launch_is_priced_by_its_state_updates_of_coded_rows(monkeypatch):
    """The trellis search's cost is its sequential steps' work (VITERBI_OPS a state update and sample, each coded row's
    trellis as its width sizes it, and VITERBI_STEP_OPS a step), not its few bytes of arguments; counting it reads
    nothing the commit would."""
    monkeypatch.setenv("QUANTWM_KERNELS", "triton")
    from op_count import VITERBI_OPS, VITERBI_STEP_OPS

    from quantwm.core import trellis
    from quantwm.core.backend import kernel

    x, widths, table = torch.randn(5, 40), torch.tensor([0, 2, 3, 0, 8]), trellis.tables()
    with TritonLaunches(reference=True) as launches, counting(launches) as t:
        states = kernel("trellis_viterbi")(x, widths, table, states=True)
    assert torch.equal(states, trellis.trellis_viterbi_ref(x, widths, table, states=True))
    assert (t.ops, t.triton) == (1, 1) and not t.syncs
    assert t.flops == 40 * (VITERBI_OPS * (64 + 128 + 256) + VITERBI_STEP_OPS * 3)  # 2^6, 2^7, 2^8 states


def test_dry_run_writes_every_figure(tmp_path):
    out = tmp_path / "cc.json"
    done = subprocess.run([sys.executable, "benchmarks/commit_cost.py", "--dry-run", "--methods", "kivi,quantwm",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report["cost_model"]) >= {"HOST_US_PER_LAUNCH", "KERNEL_FLOOR_US", "HBM_BW", "SYNC_DRAIN_US"}
    assert [(r["preset"], r["method"]) for r in report["rows"]] == [
        ("wan-1.3b", "kivi"), ("wan-1.3b", "quantwm"), ("lingbot-world", "kivi"), ("lingbot-world", "quantwm")]
    assert report["chunk"]["lingbot-world"]["ms"] > report["chunk"]["wan-1.3b"]["ms"] > 0
    for r in report["rows"]:
        for phase in ("commit", "attend"):
            first, mean, most = r[phase]["first"], r[phase]["mean"], r[phase]["max"]
            assert len(r[phase]["steady"]) == 3 and most["ops"] >= mean["ops"] > 0
            assert first["ops"] == first["launches"] + first["views"] + first["metadata"] + first["host_ops"]
            assert first["syncs"] == len(first["sync_calls"])
        assert r["commit"]["first"]["gpu_ms"] > 0
        assert r["commit"]["first"]["triton"] > 0 or r["method"] != "kivi"  # kivi packs with a kernel
        lines = r["commit"]["steady"][-1]["top_lines"]  # the launching ops by the source line that ran them
        assert lines and all(line.startswith(("quantwm/", "kernels/")) and n >= 1 and ms > 0
                             for line, (n, ms) in lines.items())
        assert sum(n for n, _ in lines.values()) <= r["commit"]["steady"][-1]["launches"]
        e = r["estimate"]
        assert e["commit_share"]["steady"] == pytest.approx(
            e["commit_gpu_ms"]["steady"] * r["shapes"]["layers"] / report["chunk"][r["preset"]]["ms"])
        assert e["attend_sync_share"]["steady"] >= 0 and r.get("measured") is None
    assert "share of chunk" in done.stdout and "warm attend" in done.stdout
    row = {**report["rows"][0], "measured": {"commit_ms": [2.0, 1.0, 1.5, 1.0], "attend_ms": [3.0] * 4,
                                             "sdpa_bf16_ms": [2.5] * 4, "commit_share": 0.01}}
    for phase in ("commit", "attend"):  # a CUDA run's sync-debug counts, as count_method writes them
        row[phase] = {**row[phase], "mean": {**row[phase]["mean"], "cuda_sync_debug": 1.0}}
    printed = commit_cost.table([row])  # the CUDA rows' table, which no CPU run prints
    assert "measured on CUDA" in printed and "commit 2.00/1.17" in printed and "measured share 1.00%" in printed


def test_set_passes_a_method_option_to_every_cache_counted(tmp_path):
    """--set trellis_kinds=v reaches the cache: its configuration says so, and the Keys keep their grids."""
    out = tmp_path / "cc.json"
    done = subprocess.run([sys.executable, "benchmarks/commit_cost.py", "--dry-run", "--methods", "quantwm-trellis",
                           "--preset", "wan-1.3b", "--set", "trellis_kinds=v", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "trellis_kinds='v'" in done.stdout
    (row,) = json.loads(out.read_text())["rows"]
    assert all("trellis_kinds=v" in row["configuration"][kind] for kind in "kv")
    assert row["commit"]["steady"][0]["flops"] > 0 and row["commit"]["steady"][0]["triton"] > 0


def test_cost_model_takes_the_slowest_of_floor_bytes_flops_and_per_matrix_decompositions():
    c = commit_cost
    assert c.kernel_us(Kernel("add", 8, 2, torch.float32)) == c.KERNEL_FLOOR_US
    stream = Kernel("copy_", 1e9, 0, torch.bfloat16)
    assert c.kernel_us(stream) == pytest.approx(1e9 / (c.HBM_BW * c.BW_EFFICIENCY) * 1e6)
    gemm = Kernel("mm", 0, 1e12, torch.bfloat16, matmul=True)
    assert c.kernel_us(gemm) == pytest.approx(1e12 / (c.BF16_FLOPS * c.FLOP_UTILISATION) * 1e6)
    assert c.kernel_us(Kernel("mm", 0, 1e12, torch.float32, matmul=True)) > c.kernel_us(gemm)  # no TF32
    assert c.kernel_us(Kernel("_linalg_eigh", 0, 0, torch.float32, matrices=12)) == 12 * c.EIGH_US_PER_MATRIX
    x = torch.randn(4, 8)
    with counting() as t:
        x.sum().item()
    fig = c.price(t)
    assert fig["gpu_ms"] == pytest.approx((2 * c.KERNEL_FLOOR_US + c.SYNC_DRAIN_US) / 1e3)
    assert fig["host_ms"] == pytest.approx(2 * c.HOST_US_PER_LAUNCH / 1e3) and fig["syncs"] == 1


@pytest.mark.parametrize("flag, value, message", [("--methods", "kivi,nope", "unknown method 'nope'"),
                                                  ("--preset", "wan-7b", "unknown preset 'wan-7b'"),
                                                  ("--set", "trellis_kinds", "--set expects KEY=VALUE"),
                                                  ("--set", "nope=1", "unexpected keyword argument 'nope'")])
def test_an_unknown_method_preset_or_option_is_one_line_and_exit_2(capsys, monkeypatch, flag, value, message):
    for var in ("QUANTWM_KERNELS", "TRITON_INTERPRET"):  # main sets how its process runs kernels: undone afterwards,
        monkeypatch.setenv(var, os.environ.get(var, ""))  # or a later test's subprocess in this worker inherits it
        if not os.environ[var]:
            monkeypatch.delenv(var)
    assert commit_cost.main(["--dry-run", flag, value]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
