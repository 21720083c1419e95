"""quantwm.world.long_rollout and generate.rollout: long rollouts through a rolling window, streamed frame by frame."""
import json
import math

import pytest
import torch

from quantwm.cli import main
from quantwm.core.cache import CacheConfig
from quantwm.world.evaluate import place_shift_rate
from quantwm.world.generate import DEFAULT_WEIGHTS, ChunkStep, generate, load_world_model, rollout
from quantwm.world.long_rollout import CURVES, DRIFT, PlaceMemory, evaluate_long, summarise


@pytest.fixture(scope="module")
def model():
    return load_world_model(DEFAULT_WEIGHTS)


def test_rollout_window_holds_sink_plus_window_and_probes_see_positions(model):
    """With max_chunks = sink + window the cache never holds more than that plus the current chunk, and each probe
    records the absolute positions of the tokens it saw: the sink's, then the window's most recent chunks."""
    cfg = model.cfg
    chunk = cfg.chunk_frames * cfg.tokens_per_frame
    steps = list(rollout(model, 0, "loop", 12, CacheConfig("rtn", max_chunks=3), steps=1))
    assert [s.chunk for s in steps] == list(range(6)) and all(s.frames.shape[0] == cfg.chunk_frames for s in steps)
    last = steps[-1].probe
    assert last.n_cached == 3 * chunk  # sink + 2 window chunks (the chunk itself is not cached)
    assert last.positions[:chunk].tolist() == list(range(chunk))  # the sink
    assert last.positions[chunk:].tolist() == list(range(3 * chunk, 5 * chunk))  # chunks 3 and 4
    assert steps[-1].cache.seq_len(0) == 3 * chunk  # after the last commit: sink + 2 most recent
    # generate (the same loop, collected) with the window: place shift reads each probe's own positions
    run = generate(model, 0, "loop", 12, CacheConfig("rtn", max_chunks=3), steps=1)
    assert torch.equal(run.frames, torch.cat([s.frames for s in steps]))
    rate, per_layer = place_shift_rate(run)
    assert 0 <= rate <= 1 and len(per_layer) == cfg.layers


def test_evaluate_long_streams_one_line_per_generated_frame(model, tmp_path):
    stream = tmp_path / "frames.jsonl"
    r = evaluate_long(model, ["rtn"], seeds=[0, 1], n_frames=12, steps=1, window=2, stream=stream, curve_frames=4)
    all_lines = [json.loads(x) for x in stream.read_text().splitlines()]
    lines = [x for x in all_lines if x["seed"] == 0]
    generated = 12 - model.cfg.context_frames
    assert [x["frame"] for x in lines] == list(range(model.cfg.context_frames, 12))
    # each seed's summary from its own lines; the means over both seeds are the report's
    per = r["methods"]["rtn"]["per_seed"]
    assert [p["seed"] for p in per] == [0, 1]
    for p in per:
        mine = [x for x in all_lines if x["seed"] == p["seed"]]
        alone = summarise({k: [[x[k] for x in mine]] for k in CURVES}, model.cfg.context_frames)
        assert p["mean"] == pytest.approx(alone["mean"], nan_ok=True)
        assert p["first_frame_below_threshold"] == alone["first_frame_below_threshold"]
    per_frame = [(a["psnr"] + b["psnr"]) / 2 for a, b in zip(lines, [x for x in all_lines if x["seed"] == 1])]
    assert r["methods"]["rtn"]["per_frame"]["psnr"] == pytest.approx(per_frame)
    lines = [x for x in all_lines if x["seed"] == 0]
    assert {x["method"] for x in lines} == {"rtn"} and all(x["cached_tokens"] <= 3 * 128 for x in lines)
    e = r["methods"]["rtn"]
    assert len(e["per_frame"]["psnr"]) == generated
    assert e["windowed"]["frames"] == [4, 8] and len(e["windowed"]["psnr"]) == 2
    assert set(e["drift"]) == set(DRIFT) and 0 < e["mean"]["bits_per_element"] < 16
    assert {"revisit_psnr", "bf16_revisit_psnr"} <= set(lines[0]) and "revisited_frames" in e["mean"]
    assert r["config"]["window"] == 2 and r["config"]["stream"] == str(stream)


def test_summarise_finds_the_threshold_frame_and_the_slope():
    """PSNR falling 1 dB a frame from 40 dB: frame 14 is the first under 30 dB; the MSE's slope is positive, the
    flat tdiff's is zero, and the quarters tell the same."""
    psnr = [40.0 - i for i in range(16)]
    curves = {"psnr": [psnr], "ssim": [[0.9] * 16], "tdiff": [[0.01] * 16], "shift_rate": [[0.1] * 16],
              "place_shift_rate": [[0.01 * i for i in range(16)]]}
    s = summarise(curves, first_frame=4, threshold_db=30.0, curve_frames=8)
    assert s["first_frame_below_threshold"] == 4 + 11
    assert s["drift"]["mse"]["slope_per_100_frames"] > 0 and s["drift"]["tdiff"]["slope_per_100_frames"] == 0
    assert s["drift"]["place_shift_rate"]["slope_per_100_frames"] == pytest.approx(1.0)
    assert s["drift"]["mse"]["last_quarter"] > s["drift"]["mse"]["first_quarter"]
    assert s["windowed"]["frames"] == [4, 12] and s["windowed"]["tdiff"] == [0.01, 0.01]
    assert s["windowed"]["psnr"][0] == pytest.approx(-10 * math.log10(sum(10 ** (-p / 10) for p in psnr[:8]) / 8))
    assert summarise({k: [[100.0] * 3] for k in curves}, 4)["first_frame_below_threshold"] is None


def test_cli_eval_window_writes_stream_and_report(tmp_path, capsys):
    stream, out = tmp_path / "s.jsonl", tmp_path / "e.json"
    assert main(["eval", "--methods", "rtn", "--seeds", "0", "--frames", "8", "--steps", "1", "--window", "1",
                 "--stream", str(stream), "--json", str(out), "--figure", str(tmp_path / "curves")]) == 0
    text = capsys.readouterr().out
    assert (tmp_path / "curves.png").stat().st_size > 0 and (tmp_path / "curves.svg").is_file()
    assert "through a window of 1 chunk(s)" in text and "first frame below 30 dB" in text
    assert len(stream.read_text().splitlines()) == 4
    r = json.loads(out.read_text())
    assert not math.isnan(r["methods"]["rtn"]["mean"]["psnr"])
    assert main(["eval", "--methods", "rtn", "--seeds", "0", "--stream", str(stream)]) == 2
    assert "--stream needs --window" in capsys.readouterr().err
    assert main(["eval", "--methods", "rtn", "--seeds", "0", "--figure", str(tmp_path / "x")]) == 2
    assert "--figure needs --window" in capsys.readouterr().err


def test_place_memory_compares_a_revisited_patch_with_the_runs_earlier_view():
    """A static camera: every frame shows the same 4 places. With a gap of 1 frame, a place last shown 1 frame ago is
    not a revisit; with a gap of 0 it is, and its error is the MSE against the run's latest view of that place."""
    frames = torch.zeros(2, 16, 16, 3)
    places = torch.tensor([[0, 0], [0, 1], [1, 0], [1, 1]]).repeat(6, 1)  # 6 frames x 4 tokens of 8x8 pixels
    mem = PlaceMemory(gap=1, patch=8)
    step = lambda c, fr: ChunkStep(c, fr, fr, None, None, places, None)  # noqa: E731
    assert all(math.isnan(x) for x in mem.update(step(0, frames)))  # frames 0, 1: nothing seen before
    assert all(math.isnan(x) for x in mem.update(step(1, frames + 0.5)))  # last seen 1 frame ago: not a revisit
    mem.gap = 0
    assert mem.update(step(2, frames + 0.1)) == pytest.approx([0.16, 0.0])  # against frame 3 (0.5), then frame 4
