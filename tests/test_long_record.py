"""The streamed long run file (quantwm/drivers/long_record.py) and the writer it streams through (runfile.RunWriter)."""
import json
import os
from dataclasses import replace

import pytest
import torch
from tiny_world import TINY, tiny_world_model

from quantwm.core.cache import CacheConfig
from quantwm.drivers.long_record import record_long
from quantwm.drivers.views import RunView
from quantwm.drivers.workbench import RunKey
from quantwm.evaluation.runfile import Run, RunFacts, RunWriter, read_run, write_run
from quantwm.world.generate import generate

FRAMES = 14  # 2 context frames and 6 generated chunks of 2


@pytest.fixture(scope="module")
def tiny():
    return tiny_world_model()


@pytest.fixture(scope="module")
def long_run(tiny, tmp_path_factory):
    key = RunKey(0, "loop", "rtn", "kv", 2, FRAMES)
    path = tmp_path_factory.mktemp("long") / "long.safetensors"
    meta = record_long(tiny, key, path, window=2, logit_layers=(1,), logit_heads=(0,), steps=1)
    return key, path, meta


def _uint8(frames):
    return (frames * 255).round().to(torch.uint8)


def test_run_writer_writes_the_file_write_run_writes(tmp_path):
    g = torch.Generator().manual_seed(0)
    facts = RunFacts("t", 2, 1, 4, (2, 2), 1, 1, patch=8)
    frames = [torch.randint(0, 256, (3, 16, 16, 3), generator=g, dtype=torch.uint8) for _ in range(2)]
    top1 = {c: tuple(torch.randint(0, 4 * c, (2, 1, 4), generator=g).int() for _ in range(2)) for c in (1, 2)}
    logits = {c: tuple(torch.randn(1, 1, 4, 4 * c, generator=g).half() for _ in range(2)) for c in (1, 2)}
    stats = torch.randn(2, 1, 4, 4, generator=g)
    meta = {"method": "rtn", "target": "kv", "bits": 2, "bits_per_element": 2.5,
            "memory_mb": {"bf16": 1.0, "stored": 0.25}, "logit_layers": [1], "logit_heads": [0], "source": {"a": 1}}
    write_run(tmp_path / "a.safetensors", Run(facts, meta, *frames, stats, top1, logits))
    with RunWriter(tmp_path / "b.safetensors", facts) as w:
        for t in range(3):
            w.add_frames(frames[0][t:t + 1], frames[1][t:t + 1])
        for c in (2, 1):  # any order: probed_chunks comes out sorted
            w.add_probe(c, *top1[c], logits[c])
        w.close(stats, meta)
    a, b = read_run(tmp_path / "a.safetensors"), read_run(tmp_path / "b.safetensors")
    assert a.meta == b.meta and a.facts == b.facts
    assert torch.equal(a.bf16, b.bf16) and torch.equal(a.method, b.method) and torch.equal(a.stats, b.stats)
    for c in (1, 2):
        assert all(torch.equal(x, y) for x, y in zip(a.top1[c] + a.logits[c], b.top1[c] + b.logits[c]))
    assert sorted(os.listdir(tmp_path)) == ["a.safetensors", "b.safetensors"]  # no scratch file left


def test_run_writer_refuses_bad_frames_and_leaves_nothing_on_error(tmp_path):
    facts = RunFacts("t", 1, 1, 4, (2, 2), 1, 1, patch=8)
    with pytest.raises(ValueError, match="uint8"):
        with RunWriter(tmp_path / "x.safetensors", facts) as w:
            w.add_frames(torch.zeros(1, 16, 16, 3, dtype=torch.uint8), torch.zeros(1, 16, 16, 3))
    with pytest.raises(ValueError, match="probed twice"):
        with RunWriter(tmp_path / "x.safetensors", facts) as w:
            w.add_probe(1, torch.zeros(1, 1, 4), torch.zeros(1, 1, 4))
            w.add_probe(1, torch.zeros(1, 1, 4), torch.zeros(1, 1, 4))
    assert os.listdir(tmp_path) == []


def test_record_long_writes_the_windowed_rollout_chunk_by_chunk(tiny, long_run):
    key, path, meta = long_run
    run = read_run(path)  # the app's loader
    kept = dict(sink_chunks=1, max_chunks=3)
    ref = generate(tiny, 0, "loop", FRAMES, CacheConfig(**kept), steps=1, probe=False)
    rec = generate(tiny, 0, "loop", FRAMES, replace(key.cache_config(), **kept), steps=1)
    assert torch.equal(run.bf16, _uint8(ref.frames)) and torch.equal(run.method, _uint8(rec.frames))
    assert not torch.equal(run.bf16, run.method)
    assert sorted(run.top1) == [p.chunk for p in rec.probes] == list(range(1, FRAMES // 2))
    chunk_tokens = TINY.chunk_frames * TINY.tokens_per_frame
    last = FRAMES // 2 - 1
    assert len(run.positions[last]) == 3 * chunk_tokens  # the sink and the window of 2 chunks, not all 6 before
    assert run.positions[last][chunk_tokens] == (last - 2) * chunk_tokens  # the window starts after an eviction
    for c, (e, _) in run.top1.items():
        assert torch.equal(e, torch.stack(rec.probes[c - 1].top1_exact).long())
        le, lq = run.logits[c]  # (1, 1, N, n_cached): layer 1, head 0
        assert le.shape == (1, 1, chunk_tokens, len(run.positions[c]))
        assert (le[0, 0].argmax(-1) == e[1, 0]).float().mean() > 0.9  # float16 may break a near tie
    # the numbers the app shows are those its view computes from the float frames of the same rollouts
    view = RunView(run, "x", frames=(ref.frames, rec.frames))
    series, summary = view.series(), view.summary()
    for k in ("psnr", "tdiff", "warp_error", "shift_rate"):
        assert [None if v is None else pytest.approx(v, rel=1e-4, abs=1e-6) for v in series[k]] == meta["series"][k]
    assert meta["series"]["identical"] == series["identical"]
    for k in ("psnr", "ssim", "tdiff", "warp_error", "shift_rate"):
        assert meta["summary"][k] == pytest.approx(summary[k], rel=1e-4), k
    assert len(meta["long"]["curves"]["psnr"]) == FRAMES - TINY.context_frames
    assert meta["long"]["window"] == 2 and meta["long"]["windowed"]["frames"][0] == TINY.context_frames
    assert [len(h["place_shift_rate"]) for h in meta["head_table"]] == [TINY.heads] * TINY.layers
    assert meta["head_table"][0]["k_bits"] is None  # rtn: one width for every channel
    assert all(json.dumps(run.meta[k]) == json.dumps(meta[k]) for k in ("long", "head_table", "series", "summary"))


def test_record_long_refuses_bad_settings(tiny, tmp_path):
    key = RunKey(0, "loop", "rtn", "kv", 2, FRAMES)
    for kw, needle in ((dict(window=0), "window must be"), (dict(window=1, logit_layers=(5,)), "logit layer 5")):
        with pytest.raises(ValueError, match=needle):
            record_long(tiny, key, tmp_path / "x.safetensors", **kw)
    assert os.listdir(tmp_path) == []


def test_cli_record_window_refuses_what_it_cannot_do(tmp_path, capsys):
    from quantwm.cli import main

    for args, needle in ((["--sensitivity-frames", "8"], "needs --window"),
                         (["--model", "sana-wm", "--window", "2"], "built-in model")):
        assert main(["record", *args, "--out", str(tmp_path / "x")]) == 2
        assert needle in capsys.readouterr().err
