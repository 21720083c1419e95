"""Matrix-Game-2 through QuantWM's cache in FastVideo's own CausalMatrixGame2WanModel."""
import fastvideo_checks as fc
import pytest
import torch

from quantwm.adapters.fastvideo import get_model

SPEC = get_model("matrix-game-2")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return fc.tiny_loaded(SPEC, tmp_path_factory.mktemp("matrixgame"))


def test_tiny_model_is_fastvideos_class_loaded_from_its_folder(model):
    from fastvideo.models.dits.matrixgame2.causal_model import CausalMatrixGame2WanModel as Cls

    assert type(model) is Cls and SPEC.shape(model) == (2, 2, 32) and SPEC.chunk_frames(model) == 3
    assert all(blk.action_model is not None for blk in model.blocks)  # keyboard/mouse conditioning in every block
    again = SPEC.build_tiny(0)
    assert all(torch.equal(again.state_dict()[k].to(v.dtype), v) for k, v in model.state_dict().items())


def test_bf16_through_quantwm_equals_fastvideos_kv_cache_bit_for_bit(model):
    ref, out = fc.bf16_pair(SPEC, model, SPEC.tiny_plan(9, 0))
    assert ref.latents.shape == (16, 9, 8, 8) and torch.isfinite(ref.latents).all()
    assert torch.equal(ref.latents, out.latents)
    assert out.cache_map[2]["read"]["bf16"] == list(range(6))


def test_bf16_equal_with_sink_and_rolling_window(model):
    model.set_causal_attention_window(local_attn_size=9, sink_size=3)  # FastVideo's own setter (self and action)
    try:
        cfg = SPEC.cache_config(model)
        assert cfg.max_chunks == 2 and cfg.sink_chunks == 1
        ref, out = fc.bf16_pair(SPEC, model, SPEC.tiny_plan(15, 1))
    finally:
        model.set_causal_attention_window(local_attn_size=SPEC.tiny_arch()["local_attn_size"], sink_size=0)
    assert torch.equal(ref.latents, out.latents)
    # the window evicted chunks 1 and 2 before chunk 4 read: sink chunk 0 and chunk 3 held
    assert out.cache_map[4]["read"]["bf16"] == [0, 1, 2, 9, 10, 11]


def test_quantwm_at_2_5_bits_records_shift_and_bits(model):
    shifts, bits, rel = fc.check_quantized(SPEC, model, SPEC.tiny_plan(9, 0))
    assert max(shifts) > 0


def test_global_attention_is_refused_as_fastvideo_refuses_it(model):
    model.set_causal_attention_window(local_attn_size=-1)
    try:
        with pytest.raises(ValueError, match="needs a window"):
            SPEC.rollout(model, SPEC.tiny_plan(3, 0), None)
    finally:
        model.set_causal_attention_window(local_attn_size=SPEC.tiny_arch()["local_attn_size"])
