"""Layer sensitivity (quantwm/world/sensitivity.py) and the cache's per-layer option it runs on (CacheConfig.layers)."""
import json

import pytest
import torch
from tiny_world import TINY, tiny_world_model

from quantwm.core.cache import CacheConfig, KVCache
from quantwm.world.evaluate import place_shift_rate
from quantwm.world.generate import generate
from quantwm.world.sensitivity import MODES, head_shift, layer_sensitivity


@pytest.fixture(scope="module")
def tiny_model():
    return tiny_world_model()


def test_cache_config_layers_validates():
    assert CacheConfig("rtn", layers=[2, 0, 2]).layers == (0, 2)
    for bad in ((-1,), "0", 1, (0.5,)):
        with pytest.raises(ValueError, match="layers must be None"):
            CacheConfig("rtn", layers=bad)
    with pytest.raises(ValueError, match="out of range: the cache has 2 layers"):
        KVCache(CacheConfig("rtn", layers=(0, 2)), 2)


def test_cache_layers_keeps_other_layers_full_precision_and_counts_them():
    cache = KVCache(CacheConfig("rtn", sink_chunks=0, recent_chunks=0, layers=(1,)), 2)
    g = torch.Generator().manual_seed(0)
    for layer in range(2):
        x = torch.randn(1, 2, 16, 64, generator=g)
        cache.write(layer, x, x, 0), cache.commit(layer, 0)
    assert not cache.quantizes_layer(0) and cache.quantizes_layer(1)
    assert [s.quantized for s in cache.inspect(0)] == [False] and [s.quantized for s in cache.inspect(1)] == [True]
    mem = cache.memory()
    assert mem.by_component["k.full"] == 16 * 2 * 64 * 4  # layer 0's float32 chunk, counted as stored
    assert mem.cache_bytes == 16 * 2 * 64 * 2 * 2 + cache.quantized_bytes()  # K and V of layer 0 at BF16
    assert mem.span_bits_per_element < 16


def test_quantizing_no_layer_equals_bf16_exactly(tiny_model):
    ref = generate(tiny_model, 1, "loop", 8, CacheConfig(), steps=1)
    none = generate(tiny_model, 1, "loop", 8, CacheConfig("quantwm", budget=2.5, layers=()), steps=1)
    some = generate(tiny_model, 1, "loop", 8, CacheConfig("quantwm", budget=2.5, layers=(1,)), steps=1)
    assert torch.equal(none.frames, ref.frames) and not torch.equal(some.frames, ref.frames)


def test_head_shift_counts_each_heads_own_jumps(tiny_model):
    run = generate(tiny_model, 0, "loop", 8, CacheConfig("rtn", k_bits=2, v_bits=2), steps=1)
    shift, place = head_shift(run)
    assert [len(x) for x in shift] == [TINY.heads] * TINY.layers
    overall, per_layer = place_shift_rate(run)  # one head: each layer's figure is its head's
    assert [x[0] for x in place] == pytest.approx(per_layer)
    with pytest.raises(ValueError, match="no probed chunk"):
        head_shift(generate(tiny_model, 0, "loop", 4, CacheConfig("rtn"), steps=1, probe=False))


def test_layer_sensitivity_has_one_row_per_layer_and_mode_and_the_allocation(tiny_model):
    r = layer_sensitivity(tiny_model, "quantwm", seeds=[0], n_frames=8, steps=1, budget=(2.5, 2.5))
    assert [(x["mode"], x["layer"]) for x in r["rows"]] == [(m, layer) for m in MODES for layer in range(2)]
    for x in r["rows"]:
        assert x["d_psnr"] == pytest.approx(x["psnr"] - r["all"]["psnr"])
    assert [a["layer"] for a in r["allocation"]] == [0, 1]
    for a in r["allocation"]:
        k = a["k_bits"]
        assert len(k["mean"]) == TINY.heads and 0 <= k["min"][0] <= k["mean"][0] <= k["max"][0] <= 8
        assert len(a["place_shift_rate"]) == TINY.heads and all(0 <= p <= s <= 1 for p, s in
                                                                 zip(a["place_shift_rate"], a["shift_rate"]))
    with pytest.raises(ValueError):
        layer_sensitivity(tiny_model, "rtn", seeds=[0], n_frames=8, steps=1, budget=(1.0, 1.0))


def test_cli_eval_layer_sensitivity_prints_and_writes_the_table(tmp_path, capsys):
    from quantwm.cli import main

    out = tmp_path / "e.json"
    assert main(["eval", "--methods", "rtn", "--seeds", "0", "--frames", "8", "--steps", "1", "--layer-sensitivity",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "rtn: layer sensitivity" in text and "| all_but | 3     |" in text
    r = json.loads(out.read_text())["layer_sensitivity"]["rtn"]
    assert len(r["rows"]) == 2 * 4 and r["allocation"][0]["k_bits"] is None  # one grid for all channels
    assert main(["eval", "--methods", "quantwm", "--budget", "3", "--seeds", "0", "--frames", "6", "--steps", "1",
                 "--layer-sensitivity", "--figure", str(tmp_path / "sens")]) == 0
    assert (tmp_path / "sens.png").stat().st_size > 0 and "place shift by head" in capsys.readouterr().out
    assert main(["eval", "--methods", "rtn", "--seeds", "0", "--window", "1", "--layer-sensitivity"]) == 2
    assert "without --window" in capsys.readouterr().err
