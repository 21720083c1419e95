"""LingBot-World-v2 through QuantWM's cache in FastVideo's own LingBotWorld2CausalFastTransformer3DModel."""
import fastvideo_checks as fc
import pytest
import torch

from quantwm.adapters.fastvideo import get_model

SPEC = get_model("lingbot-world-v2")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return fc.tiny_loaded(SPEC, tmp_path_factory.mktemp("lingbot"))


def test_tiny_model_is_fastvideos_class_loaded_from_its_folder(model, tmp_path):
    from fastvideo.models.dits.lingbotworld2.causal_fast import LingBotWorld2CausalFastTransformer3DModel as Cls

    assert type(model) is Cls and SPEC.shape(model) == (2, 2, 32)
    again = SPEC.build_tiny(0)
    assert all(torch.equal(again.state_dict()[k].to(v.dtype), v) for k, v in model.state_dict().items())


def test_bf16_through_quantwm_equals_fastvideos_kv_cache_bit_for_bit(model):
    ref, out = fc.bf16_pair(SPEC, model, SPEC.tiny_plan(8, 0))
    assert ref.latents.shape == (16, 8, 8, 8)
    assert torch.equal(ref.latents, out.latents)


def test_bf16_equal_with_sink_and_rolling_window(tmp_path):
    windowed = fc.tiny_loaded(SPEC, tmp_path, {"local_attn_size": 6, "sink_size": 2})
    assert SPEC.cache_config(windowed).max_chunks == 2 and SPEC.cache_config(windowed).sink_chunks == 1
    ref, out = fc.bf16_pair(SPEC, windowed, SPEC.tiny_plan(10, 1))
    assert torch.equal(ref.latents, out.latents)
    # the window evicted chunk 1 before chunk 4 read: sink chunk 0 and chunk 3 held
    assert out.cache_map[4]["read"]["bf16"] + out.cache_map[4]["read"]["quantized"] == [0, 1, 6, 7]


def test_quantwm_at_2_5_bits_records_shift_and_bits(model):
    shifts, bits, rel = fc.check_quantized(SPEC, model, SPEC.tiny_plan(8, 0))
    assert max(shifts) > 0


def test_window_not_whole_chunks_is_said(model):
    notes = []
    SPEC.arch(model).local_attn_size, SPEC.arch(model).sink_size = 7, 1
    try:
        cfg = SPEC.cache_config(model, notes)
    finally:
        SPEC.arch(model).local_attn_size, SPEC.arch(model).sink_size = -1, 0
    assert cfg.sink_chunks == 1 and cfg.max_chunks == 3 and "not a whole number" in notes[0]
