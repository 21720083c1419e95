"""Run files: write, read and validate; the app's views on an opened run match the built-in run's."""
import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from app import world_handlers as wh
from quantwm.drivers import studies
from quantwm.drivers.views import make_run
from quantwm.drivers.workbench import RunKey
from quantwm.evaluation.runfile import RunFacts, read_run, run_memory, write_run

pytestmark = pytest.mark.usefixtures("shared_rollouts")  # conftest.py: each rollout made once per process

FRAMES = 10


@pytest.fixture(scope="module")
def recorded(wb, tmp_path_factory):
    key = RunKey(seed=6, method="qvg", frames=FRAMES)
    path = tmp_path_factory.mktemp("run") / "qvg.safetensors"
    write_run(path, make_run(wb, key, logit_layers=[1, 2], logit_heads=[0]))
    return key, path


def test_a_run_file_round_trips_and_its_views_match_the_built_in_run(wb, runs, recorded):
    key, path = recorded
    run = read_run(path)
    assert run.facts.latent_grid == (8, 8) and run.facts.pixels_per_token == 8 and run.facts.vae_temporal == 1
    assert run.meta["method"] == "qvg" and run.meta["logit_layers"] == [1, 2] and sorted(run.top1) == [2, 3, 4]
    assert run_memory(run.meta).figures() == wb.record(key.id).memory.figures()
    rid = runs.open(str(path))
    assert rid == "file=qvg.safetensors qvg kv 2-bit" and rid in runs.opened()
    opened, built_in = runs.view(rid), runs.view(key.id)
    for t in (1, FRAMES - 1):
        a, b = opened.frame_view(t, 1, 0), built_in.frame_view(t, 1, 0)
        assert np.array_equal(a["bf16"], b["bf16"]) and np.array_equal(a["method"], b["method"])
        assert (a["jumps"] is None) == (b["jumps"] is None)
        if a["jumps"] is not None:
            assert np.array_equal(a["jumps"], b["jumps"])
    for x, y, layer in ((20, 50, 1), (63, 0, 2)):
        a, b = opened.pixel_trace(FRAMES - 1, x, y, layer, 0), built_in.pixel_trace(FRAMES - 1, x, y, layer, 0)
        assert a["query"] == b["query"] and a["source_bf16"] == b["source_bf16"]
        assert a["source_method"] == b["source_method"] and a["jumped"] == b["jumped"]
        np.testing.assert_allclose(a["logits_method"], b["logits_method"], atol=0.05)  # stored as fp16
    e = opened.energy()
    assert np.allclose(e[0]["eigenvalues"], built_in.energy()[0]["eigenvalues"], rtol=1e-4)
    cmp, ref = opened.compare(), studies.compare(wb, key)
    assert cmp["summary"] == pytest.approx(ref["summary"]) and cmp["series"]["tdiff"] == ref["series"]["tdiff"]
    assert cmp["memory"] == ref["memory"]
    with pytest.raises(ValueError, match="holds attention logits for layers \\[1, 2\\]"):
        opened.pixel_trace(FRAMES - 1, 1, 1, 0, 0)
    with pytest.raises(ValueError, match="not generated with probes"):
        opened.pixel_trace(1, 1, 1, 1, 0)


def test_the_handlers_show_an_opened_run_like_a_generated_one(runs, recorded):
    key, path = recorded
    r = wh.open_run_handler(runs, str(path))
    generated = wh.generate_handler(runs, key.seed, key.trajectory, key.method, key.target, key.bits, key.frames)
    assert r["status"].split("): ", 1)[1] == generated["status"].split("): ", 1)[1]  # the same numbers
    assert r["summary"] == generated["summary"] and r["worst_frames"] == generated["worst_frames"]
    assert r["run_id"].startswith("file=") and "opened" in r["status"] and os.path.isfile(r["bf16_video"])
    assert r["frames"] == FRAMES and r["figure"] is not None
    scrub = wh.scrub_handler(runs, r["run_id"], FRAMES - 1, list(wh.OVERLAYS))
    assert scrub["bf16"].shape == (256, 256, 3) and "top-1 moved" in scrub["status"]
    tr = wh.click_pixel_handler(runs, r["run_id"], FRAMES - 1, [4 * 20, 4 * 50], 1, 0)
    assert tr["status"].startswith(f"Query frame {FRAMES - 1}, row 6, col 2") and "qvg source" in tr["status"]
    assert "top 8" in wh.energy_handler(runs, r["run_id"], 0)["status"]
    traced = wh.trace_pixel_handler(runs, r["run_id"], FRAMES - 1, 20, 50, 1, 0)["result"]
    ex = wh.export_handler(runs, r["run_id"], FRAMES - 1, "all", "all", ["svg"], traced)  # a recorded run exports too
    assert sorted(f.rsplit("/", 1)[-1].split("-")[0] for f in ex["files"]) == ["frames", "maps", "trace"]
    assert any(f.endswith(f"-frame{FRAMES - 1}-x20-y50-layer1-head0.svg") for f in ex["files"])
    assert wh.export_energy_handler(runs, r["run_id"], 1, ["svg"])["files"]
    picked = wh.trace_pixel_handler(runs, r["run_id"], FRAMES - 1, 20, 50, "all", "all")["result"]  # among the logged
    assert picked["layer"] in (1, 2) and picked["head"] in r["logit_heads"]
    assert "holds attention logits for layers [1, 2]" in wh.trace_pixel_handler(runs, r["run_id"], FRAMES - 1, 1, 1, 0,
                                                                                "all")["status"]
    assert "holds attention logits for layers [1, 2]" in wh.trace_pixel_handler(runs, r["run_id"], FRAMES - 1, 1, 1, 0,
                                                                                0)["status"]
    for bad, needle in ((None, "no run file"), ("/nope.safetensors", "does not exist")):
        assert needle in wh.open_run_handler(runs, bad)["status"]


def test_latent_token_mapping_for_a_video_vae():
    """Wan's causal VAE: 8x spatial, 4x temporal (latent frame 0 -> output frame 0), 2x2 patches."""
    f = RunFacts("wan", 30, 12, 128, (30, 52), 3, 0, vae_spatial=8, patch=2, vae_temporal=4)
    assert f.pixels_per_token == 16 and f.output_frames(21) == 81
    assert [f.latent_frame(t) for t in (0, 1, 4, 5, 8, 80)] == [0, 1, 1, 2, 2, 20]
    assert [f.first_output_frame(i) for i in (0, 1, 2, 20)] == [0, 1, 5, 77]
    assert f.pixel_to_token(831, 479) == (29, 51) and f.pixel_to_token(16, 15) == (0, 1)
    with pytest.raises(ValueError, match="outside the 832x480 frame"):
        f.pixel_to_token(832, 0)


def test_a_run_file_without_memory_reads_the_same_figures_from_bits_and_megabytes(recorded):
    """Files written before `memory` (and other recorders'): bits_per_element and memory_mb give the same
    CacheMemory figures, so an opened run's status line reads the same."""
    _, path = recorded
    meta = read_run(path).meta
    old = run_memory({k: v for k, v in meta.items() if k != "memory"})
    assert old.figures() == pytest.approx(run_memory(meta).figures()) and old.summary() == run_memory(meta).summary()
    assert meta["memory_mb"] == {"bf16": old.bf16_mb, "stored": old.cache_mb}


def test_bad_run_files_are_refused_naming_the_problem(recorded, tmp_path):
    _, path = recorded
    tensors = load_file(str(path))
    from safetensors import safe_open
    with safe_open(str(path), "pt") as fh:
        meta = fh.metadata()

    def variant(name, tensors=tensors, meta=meta):
        p = tmp_path / f"{name}.safetensors"
        save_file(tensors, str(p), metadata=meta)
        return p

    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00" * 100)
    run_meta = json.loads(meta["run"])
    cases = [
        (garbage, "unreadable safetensors"),
        (tmp_path / "missing.safetensors", "no such run file"),
        (variant("version", meta={**meta, "quantwm_run_version": "9"}), "quantwm_run_version"),
        (variant("nometa", meta={**meta, "run": json.dumps({k: v for k, v in run_meta.items() if k != "heads"})}),
         "lacks heads"),
        (variant("noframes", tensors={k: v for k, v in tensors.items() if k != "frames.method"}), "frames.method"),
        (variant("shape", tensors={**tensors, "stats": tensors["stats"][:, :2].contiguous()}), "stats must be finite"),
        (variant("range", tensors={**tensors, "probe.2.top1_quant": tensors["probe.2.top1_quant"] + 10_000}),
         "points outside"),
        (variant("nan", tensors={**tensors, "probe.3.logits_exact": tensors["probe.3.logits_exact"] * torch.nan}),
         "NaN or Inf"),
        (variant("memory", meta={**meta, "run": json.dumps({**run_meta, "memory": {"bf16_bytes": 1}})}),
         "bad memory figures"),
    ]
    for p, needle in cases:
        with pytest.raises(ValueError, match="not a valid QuantWM run|no such run file") as e:
            read_run(p)
        assert needle in str(e.value), (p, str(e.value))


def test_record_and_app_refuse_bad_input_with_exit_2(tmp_path, capsys, app_start):
    """`quantwm record` and the app's start (their `main`s, which the commands run) refuse with one line."""
    from quantwm.cli import main

    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"nope")
    for args, needle in ((["record", "--frames", "7", "--out", str(tmp_path / "x")], "frames must"),
                         (["record", "--seed", "100000", "--out", str(tmp_path / "x")], "[0, 100000)")):
        assert main(args) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], lines
    code, err = app_start(["--run", str(bad), "--port", "7998"])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "not a valid QuantWM run" in lines[0], err
