import pytest
import torch
from safetensors.torch import save_file

from quantwm.evaluation.trace import TraceWriter, read_trace


def _writer(**kw):
    w = TraceWriter(tokens_per_frame=4, frame_grid=(2, 2), softmax_scale=0.125, model="unit", **kw)
    g = torch.Generator().manual_seed(0)
    w.record(0, torch.randn(1, 2, 3, 8, generator=g), torch.randn(2, 8, 8, generator=g), torch.randn(2, 8, 8, generator=g),
             q_hist=torch.randn(2, 5, 8, generator=g))
    return w


def test_trace_roundtrip_keeps_tensors_metadata_and_frames(tmp_path):
    w = _writer()
    w.set_frames(torch.rand(2, 4, 4, 3))
    w.extra_meta["chunk_frames"] = 1
    w.save(tmp_path / "t.safetensors")
    t = read_trace(tmp_path / "t.safetensors")
    assert list(t.layers) == [0]
    assert torch.equal(t.layers[0]["q"], w.layers[0]["q"]) and t.layers[0]["q"].shape == (2, 3, 8)
    assert t.layers[0]["q_hist"].shape == (2, 5, 8)
    assert t.frames.dtype == torch.uint8 and t.frames.shape == (2, 4, 4, 3)
    assert t.meta["quantwm_trace_version"] == "1" and t.meta["chunk_frames"] == "1"
    assert t.frame_grid == (2, 2) and t.tokens_per_frame == 4 and t.softmax_scale == 0.125


def test_trace_token_coords_are_frame_major_row_major():
    t = _writer()
    from quantwm.evaluation.trace import Trace

    tr = Trace(t.layers, {"frame_grid": "2,3"})
    assert tr.token_coords(0) == (0, 0, 0)
    assert tr.token_coords(4) == (0, 1, 1)
    assert tr.token_coords(7) == (1, 0, 1)


def test_read_trace_rejects_corrupt_and_foreign_files(tmp_path):
    bad = tmp_path / "garbage.safetensors"
    bad.write_bytes(b"\x00\x01not a safetensors file at all")
    with pytest.raises(ValueError, match="not a valid QuantWM trace"):
        read_trace(bad)
    foreign = tmp_path / "foreign.safetensors"
    save_file({"weight": torch.zeros(2)}, str(foreign))
    with pytest.raises(ValueError, match="missing metadata"):
        read_trace(foreign)
    with pytest.raises(ValueError, match="no such trace file"):
        read_trace(tmp_path / "missing.safetensors")


def test_read_trace_rejects_inconsistent_layers_and_metadata(tmp_path):
    meta = {"quantwm_trace_version": "1", "tokens_per_frame": "4", "frame_grid": "2,2", "softmax_scale": "0.1",
            "rope": "post", "model": "m"}
    cases = [
        ({"L0.q": torch.zeros(2, 3, 8), "L0.k": torch.zeros(2, 4, 8)}, meta, "lacks L0.v"),
        ({"L0.q": torch.zeros(2, 3, 8), "L0.k": torch.zeros(3, 4, 8), "L0.v": torch.zeros(3, 4, 8)}, meta, "do not agree"),
        ({"L0.q": torch.zeros(2, 3, 8), "L0.k": torch.full((2, 4, 8), float("nan")), "L0.v": torch.zeros(2, 4, 8)},
         meta, "NaN"),
        ({"L0.q": torch.zeros(2, 3, 8), "L0.k": torch.zeros(2, 4, 8), "L0.v": torch.zeros(2, 4, 8)},
         {**meta, "quantwm_trace_version": "9"}, "version"),
        ({"L0.q": torch.zeros(2, 3, 8), "L0.k": torch.zeros(2, 4, 8), "L0.v": torch.zeros(2, 4, 8)},
         {**meta, "frame_grid": "3,3"}, "does not hold"),
        ({"L0.q": torch.zeros(2, 3, 8), "L0.k": torch.zeros(2, 4, 8), "L0.v": torch.zeros(2, 4, 8), "extra": torch.zeros(1)},
         meta, "unexpected tensor"),
        ({}, meta, "no layer"),
    ]
    for i, (tensors, m, msg) in enumerate(cases):
        path = tmp_path / f"c{i}.safetensors"
        save_file(tensors, str(path), metadata=m)
        with pytest.raises(ValueError, match=msg):
            read_trace(path)


def test_trace_writer_respects_memory_budget():
    w = TraceWriter(4, (2, 2), 0.1, max_bytes=1000)
    small = torch.zeros(1, 2, 8)
    assert w.record(0, small, small, small)
    big = torch.zeros(2, 64, 8)
    assert not w.record(1, big, big, big)
    assert w.skipped == [1] and list(w.layers) == [0] and w.nbytes() <= 1000


def test_trace_writer_rejects_batches_and_bad_frames():
    w = TraceWriter(4, (2, 2), 0.1)
    with pytest.raises(ValueError, match="batch size 1"):
        w.record(0, torch.zeros(2, 1, 3, 8), torch.zeros(2, 1, 4, 8), torch.zeros(2, 1, 4, 8))
    with pytest.raises(ValueError, match="frames"):
        w.set_frames(torch.zeros(2, 4, 4))
