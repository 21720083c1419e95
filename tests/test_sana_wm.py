"""diffusers' SANA-WM stage-2 refiner, unmodified, over the QuantWM cache (quantwm.adapters.sana_wm).

A tiny random refiner (tests/tiny_sana.py) is saved with `save_pretrained` and loaded back in BF16 with
`SanaWMLTX2Refiner.from_pretrained`, as a user loads the released one; the stock pipeline is the reference.
"""
from __future__ import annotations

import pytest
import torch
from tiny_sana import tiny_sana_refiner

from quantwm.adapters.sana_wm import SanaWMCacheAdapter, sana_wm_kv_cache
from quantwm.core.cache import CacheConfig, KVCache

PROMPT = "a cat walks on the beach at dusk"


@pytest.fixture(scope="module")
def refiner(tmp_path_factory):
    from diffusers import SanaWMLTX2Refiner

    path = tmp_path_factory.mktemp("sana_wm_refiner")
    tiny_sana_refiner().save_pretrained(path)
    pipe = SanaWMLTX2Refiner.from_pretrained(path, dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def refine(pipe, stage1, cache=None):
    """The stock call (1 sink frame, blocks of 3, a window of 5 frames: the history trim cuts a block)."""
    def call():
        return pipe(stage1, PROMPT, fps=8.0, generator=torch.Generator().manual_seed(1), kv_max_frames=5,
                    output_type="latent")
    if cache is None:
        return call()
    with SanaWMCacheAdapter(pipe.transformer, cache):
        return call()


@pytest.fixture(scope="module")
def stage1():
    return torch.randn(1, 8, 13, 4, 4, generator=torch.Generator().manual_seed(0)).bfloat16()  # 1 sink + 4 blocks


def test_bf16_through_quantwm_equals_the_stock_refiner(refiner, stage1):
    reference = refine(refiner, stage1)
    cache = sana_wm_kv_cache(refiner.transformer, CacheConfig("bf16", sink_chunks=0, track_queries=True))
    out = refine(refiner, stage1, cache)
    assert out.dtype == torch.bfloat16 and torch.equal(out, reference)
    # The window holds 4 frames (64 tokens) of history: blocks 2 and 3 (the trim cut block 2) plus block 4, the
    # last captured, not yet committed; block 1 was evicted.
    assert [s.index for s in cache.inspect(0)] == [1, 2, 3] and cache.seq_len(0) == 3 * 48
    assert not torch.allclose(cache.query_stats(0).float(), torch.eye(64).expand(2, 64, 64))  # queries observed


def test_quantwm_refines_close_to_bf16_in_fewer_bytes(refiner, stage1):
    reference = refine(refiner, stage1)
    bf16 = sana_wm_kv_cache(refiner.transformer, CacheConfig("bf16", sink_chunks=0))
    refine(refiner, stage1, bf16)
    cache = sana_wm_kv_cache(refiner.transformer, CacheConfig("quantwm", sink_chunks=0))
    out = refine(refiner, stage1, cache)
    err = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
    assert 0 < err < 0.1
    assert any(s.quantized for s in cache.inspect(0)) and cache.nbytes() < bf16.nbytes()
    assert torch.equal(out[:, :, :4], reference[:, :, :4])  # the sink and block 1 see no quantized history


def test_a_second_refinement_needs_an_empty_cache(refiner, stage1):
    cache = sana_wm_kv_cache(refiner.transformer, CacheConfig("bf16", sink_chunks=0))
    first = refine(refiner, stage1, cache)
    with SanaWMCacheAdapter(refiner.transformer, cache) as adapter:
        with pytest.raises(ValueError, match="one pipeline call per cache"):
            refiner(stage1, PROMPT, fps=8.0, generator=torch.Generator().manual_seed(1), kv_max_frames=5,
                    output_type="latent")
        adapter.reset()
        again = refiner(stage1, PROMPT, fps=8.0, generator=torch.Generator().manual_seed(1), kv_max_frames=5,
                        output_type="latent")
    assert torch.equal(first, again) and adapter.cache is cache  # the same cache, emptied by reset() and refilled


def test_the_processors_are_restored_and_bad_input_is_refused(refiner):
    before = [b.attn1.processor for b in refiner.transformer.transformer_blocks]
    with SanaWMCacheAdapter(refiner.transformer, sana_wm_kv_cache(refiner.transformer)):
        assert all(b.attn1.processor is not p for b, p in zip(refiner.transformer.transformer_blocks, before))
    assert [b.attn1.processor for b in refiner.transformer.transformer_blocks] == before
    with pytest.raises(ValueError, match="one per block"):
        SanaWMCacheAdapter(refiner.transformer, KVCache(CacheConfig(layout="BLHD"), n_layers=5))
    with pytest.raises(ValueError, match="layout='BLHD', rope='post'"):
        SanaWMCacheAdapter(refiner.transformer, KVCache(CacheConfig(), n_layers=2))
    with pytest.raises(ValueError, match="expected a SanaWMLTX2RefinerTransformer3DModel"):
        SanaWMCacheAdapter(torch.nn.Linear(2, 2), sana_wm_kv_cache(refiner.transformer))


# ---- recording BF16 vs quantwm into a run file, and the app's views of it ---------------------------------------
@pytest.fixture(scope="module")
def recorded(tmp_path_factory, stage1):
    """A tiny refiner with an LTX-2 VAE saved as a diffusers folder, stage-1 latents on disk, a recorded run."""
    from safetensors.torch import save_file

    from quantwm.cli import main
    from quantwm.evaluation.runfile import read_run

    root = tmp_path_factory.mktemp("sana_wm_run")
    tiny_sana_refiner(vae=True).save_pretrained(root / "refiner")
    save_file({"latents": stage1.float()}, str(root / "stage1.safetensors"))
    out = root / "run.safetensors"
    assert main(["record", "--model", "sana-wm", "--base", str(root / "refiner"), "--latents",
                 str(root / "stage1.safetensors"), "--prompt", PROMPT, "--kv-max-frames", "5", "--logit-layers", "1",
                 "--logit-heads", "0,1", "--seed", "1", "--out", str(out)]) == 0
    return root, read_run(out)


def test_a_sana_wm_run_records_both_refinements_with_probes_and_key_positions(recorded):
    from diffusers import SanaWMLTX2Refiner
    from safetensors.torch import load_file

    from quantwm.adapters.sana_wm import _decode

    root, run = recorded
    f = run.facts
    assert (f.chunk_start, f.context_frames, f.chunk_frames, f.latent_grid, f.vae_spatial, f.vae_temporal) == \
        (1, 1, 3, (4, 4), 32, 8)
    assert run.bf16.shape == (97, 128, 128, 3) and not torch.equal(run.bf16, run.method)
    pipe = SanaWMLTX2Refiner.from_pretrained(root / "refiner")  # the stock pipeline, the same call
    pipe.set_progress_bar_config(disable=True)
    z = load_file(str(root / "stage1.safetensors"))["latents"]
    stock = pipe(z, PROMPT, fps=16.0, kv_max_frames=5, output_type="latent", generator=torch.Generator().manual_seed(1))
    assert torch.equal(run.bf16, _decode(pipe.vae, stock))  # BF16 through QuantWM = the stock refiner, decoded
    assert sorted(run.top1) == [0, 1, 2, 3] and sorted(run.positions) == [0, 1, 2, 3]
    tpf = 16
    assert run.positions[0].tolist() == list(range(tpf))  # block 0 sees the sink only
    # Block 3 (frames 10-12) sees the sink (frame 0) and the window's last 4 frames (6-9).
    assert run.positions[3].tolist() == list(range(tpf)) + list(range(6 * tpf, 10 * tpf))
    assert run.logits[3][0].shape == (1, 2, 3 * tpf, 5 * tpf)


def test_the_app_views_of_a_sana_wm_run_map_sources_to_their_latent_frames(recorded):
    import numpy as np

    from quantwm.drivers.views import RunView

    _, run = recorded
    view = RunView(run, "sana")
    assert view.frame_view(0)["jumps"] is None and view.frame_view(0)["context"]  # the sink: never generated
    assert view.frame_view(96)["jumps"].shape == (4, 4)
    t = 1 + 8 * 10  # the first output frame of latent frame 11 (block 3)
    r = view.pixel_trace(t, 40, 72, layer=1, head=1)
    assert r["query"] == (11, 2, 1)
    for key in ("source_bf16", "source_method"):
        assert r[key][0] in (0, 6, 7, 8, 9)  # the sink or a frame in the window
    heat = r["logits_bf16"]
    assert heat.shape == (10, 16) and np.isnan(heat[1:6]).all() and np.isfinite(heat[[0, 6, 7, 8, 9]]).all()
    summary = view.compare()["summary"]
    assert 0 <= summary["shift_rate"] <= 1 and summary["span_bits_per_element"] > 2


def test_sana_wm_record_refuses_bad_input(recorded, tmp_path, capsys):
    from quantwm.adapters.sana_wm import record_sana_wm
    from quantwm.cli import main

    root, _ = recorded
    with pytest.raises(ValueError, match="no latents in a safetensors file"):
        record_sana_wm(root / "refiner", tmp_path / "none.safetensors", PROMPT)
    with pytest.raises(ValueError, match="must exceed the sink"):
        record_sana_wm(root / "refiner", torch.zeros(1, 8, 13, 4, 4), PROMPT, kv_max_frames=1)
    with pytest.raises(ValueError, match="needs at least the sink"):
        record_sana_wm(root / "refiner", torch.zeros(1, 8, 4, 4, 4), PROMPT)
    with pytest.raises(ValueError, match="not a diffusers SanaWMLTX2Refiner folder"):
        record_sana_wm(tmp_path, torch.zeros(1, 8, 13, 4, 4), PROMPT)
    assert main(["record", "--model", "sana-wm", "--out", str(tmp_path / "x.safetensors")]) == 2
    assert "needs --base, --latents, --prompt" in capsys.readouterr().err


def test_the_apps_pixel_trace_handler_draws_a_sana_wm_run(recorded):
    from app import world_handlers as wh
    from quantwm.drivers.registry import RunRegistry
    from quantwm.drivers.workbench import Workbench

    root, _ = recorded
    runs = RunRegistry(Workbench())
    rid = runs.open(str(root / "run.safetensors"))
    assert wh.open_run_handler(runs, rid, files=False)["frame_hw"] == (128, 128)  # the page's pixel boxes follow it
    r = wh.trace_pixel_handler(runs, rid, 1 + 8 * 10, 40, 72, 1, 1)
    assert r["status"].startswith("Query frame 11, row 2, col 1") and r["figure"] is not None, r["status"]
    assert r["bf16_source"].shape == r["method_source"].shape  # thumbnails of the source frames
    assert "not generated with probes" in wh.trace_pixel_handler(runs, rid, 0, 40, 72, 1, 1)["status"]


def test_a_short_last_block_is_recorded_and_read_back(recorded, tmp_path):
    from quantwm.adapters.sana_wm import record_sana_wm
    from quantwm.drivers.views import RunView
    from quantwm.evaluation.runfile import read_run, write_run

    root, _ = recorded
    z = torch.randn(1, 8, 12, 4, 4, generator=torch.Generator().manual_seed(3))  # sink + 3 blocks of 3 + one of 2
    run = record_sana_wm(root / "refiner", z, PROMPT, kv_max_frames=5, logit_layers=[0], logit_heads=[0])
    write_run(tmp_path / "short.safetensors", run)
    back = read_run(tmp_path / "short.safetensors")
    assert sorted(back.top1) == [0, 1, 2, 3] and back.top1[3][0].shape == (2, 2, 2 * 16)
    r = RunView(back, "short").pixel_trace(1 + 8 * 10, 8, 8, layer=0, head=0)  # latent frame 11, the last
    assert r["query"] == (11, 0, 0) and r["source_bf16"][0] in (0, 6, 7, 8, 9)
