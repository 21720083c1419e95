"""The studies over the built-in model's runs (quantwm/drivers/studies.py): what their speed-ups leave unchanged, and
the Methods rows' VBench flicker score."""
import threading
from dataclasses import replace

import pytest
import torch

from quantwm.drivers import studies
from quantwm.drivers.workbench import RunKey, Workbench
from quantwm.evaluation import diagnostics as D
from quantwm.evaluation.vbench import temporal_flickering

FRAMES = 10
KEY = RunKey(seed=5, trajectory="loop", method="kivi", target="kv", frames=FRAMES, budget=2.5)
TINY = 1e-39  # a float32 denormal


@pytest.fixture(scope="module")
def wb():
    return Workbench()


def test_the_attention_error_is_the_same_with_denormals_flushed(wb):
    """`attention_error` flushes denormals while it runs (7x faster on a CPU): the same value, to the last bit, as
    the diagnostic computed without the flush; the flag is back off afterwards, and threads already running (the
    rollouts') never had it."""
    ref, rec = wb.pair(KEY)
    plain = D.probed_attention_error(rec.probes, rec.k_exact, rec.k_stored, rec.v_exact, rec.v_stored,
                                     wb.cfg.chunk_frames * wb.cfg.tokens_per_frame)
    rec.metrics.pop("attn_out_rel_err", None)
    assert studies.attention_error(wb, rec) == plain
    assert float(torch.tensor([TINY]) * 1) != 0  # flushing off again on this thread
    go, seen = threading.Event(), []
    other = threading.Thread(target=lambda: go.wait() and seen.append(float(torch.tensor([TINY]) * 1)))
    other.start()  # a thread already running, as the rollouts' are
    with studies.denormals_flushed():
        inside = float(torch.tensor([TINY]) * 1)
        go.set()
        other.join()
    if torch.set_flush_denormal(False):  # a CPU that has the flag: flushed inside the block, on this thread only
        assert inside == 0
    assert len(seen) == 1 and seen[0] != 0


def test_methods_rows_carry_vbench_flicker_of_their_own_frames(wb):
    """Each Methods row's `vbench_flicker` and BF16's (`reference_vbench`) are VBench's temporal-flickering score of
    the run's frames from the last context frame on, as `quantwm eval` takes it; computed once per record."""
    rows = studies.methods_table(wb, KEY, ["kivi", "rtn"])
    ctx = wb.cfg.context_frames
    for row in rows:
        frames = wb.record(replace(KEY, method=row["method"]).id).frames
        assert row["vbench_flicker"] == temporal_flickering(frames[ctx - 1:]), row["method"]
    bf16 = wb.record(KEY.reference().id)
    assert studies.reference_vbench(wb, KEY) == temporal_flickering(bf16.frames[ctx - 1:])
    assert bf16.metrics["vbench_flicker"] == studies.reference_vbench(wb, KEY)
