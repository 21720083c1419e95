"""LongCat-Video's continuation through QuantWM's cache in FastVideo's own LongCatTransformer3DModel: the conditioning
frames' K/V as committed chunks, the segment's denoising steps reading them."""
import fastvideo_checks as fc
import pytest
import torch

from quantwm.adapters.attention import ChunkedAttention
from quantwm.adapters.fastvideo import get_model
from quantwm.core.cache import KVCache

SPEC = get_model("longcat-video")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return fc.tiny_loaded(SPEC, tmp_path_factory.mktemp("longcat"))


@pytest.fixture(scope="module")
def plan():
    return SPEC.tiny_plan(None, 0)  # 4 conditioning frames (chunks 0, 1), a 2-frame segment (chunk 2)


@pytest.fixture(scope="module")
def reference(model, plan):
    return SPEC.rollout(model, plan, None)


def test_tiny_model_is_fastvideos_class_loaded_from_its_folder(model):
    from fastvideo.models.dits.longcat import LongCatTransformer3DModel as Cls

    assert type(model) is Cls and SPEC.shape(model) == (2, 2, 32)
    assert not any(blk.self_attn.enable_bsa for blk in model.blocks)  # the dense path
    again = SPEC.build_tiny(0)
    assert all(torch.equal(again.state_dict()[k].to(v.dtype), v) for k, v in model.state_dict().items())


def test_bf16_through_quantwm_equals_fastvideos_forward_with_kv_cache_bit_for_bit(model, plan, reference):
    cache = KVCache(SPEC.cache_config(model), SPEC.shape(model)[0])
    out = SPEC.rollout(model, plan, ChunkedAttention(cache))
    assert reference.latents.shape == (16, 6, 8, 8) and out.context_frames == 4
    assert torch.equal(reference.latents, out.latents)
    cond = SPEC._inputs(model, plan, "cpu")["latents"][0, :, :4]
    assert torch.equal(out.latents[:, :4], cond)  # the conditioning is given back as FastVideo concatenates it
    assert not torch.equal(out.latents[:, 4:], reference.latents[:, :2])
    # committed once in the conditioning pass, never rewritten: chunks 0, 1 (+ the segment, chunk 2, uncommitted)
    assert [(s.index, s.n_tokens) for s in cache.inspect(0)] == [(0, 32), (1, 32), (2, 32)]


def test_bf16_equal_with_keys_stored_before_rope_as_fastvideo_stores_them(model, plan, reference):
    L = SPEC.shape(model)[0]
    cache = KVCache(SPEC.cache_config(model, rope="pre"), L, rope=SPEC.key_rope(model))
    out = SPEC.rollout(model, plan, ChunkedAttention(cache))
    assert torch.equal(reference.latents, out.latents)


def test_conditioning_frames_are_marked_in_the_cache_map(model, plan):
    cache = KVCache(SPEC.cache_config(model), SPEC.shape(model)[0])
    out = SPEC.rollout(model, plan, ChunkedAttention(cache))
    assert out.cache_map == [{"chunk": 2, "frames": [4, 5],
                              "read": {"bf16": [0, 1, 2, 3], "quantized": [], "conditioning": [0, 1, 2, 3]}}]


def test_quantwm_at_2_5_bits_quantizes_the_conditioning_and_records_shift(model, plan, reference):
    out, cache, probe = fc.quantized(SPEC, model, plan, 2.5)
    assert out.cache_map[0]["read"]["quantized"] == [0, 1, 2, 3] == out.cache_map[0]["read"]["conditioning"]
    assert all(s.quantized for s in cache.inspect(0)[:2]) and not cache.inspect(0)[2].quantized
    # fc.check_quantized expects a probe on every chunk after the first; here only the segment (chunk 2) has
    # denoising passes, and they are the ones that read the quantized conditioning
    top1 = probe.top1()
    assert sorted(top1) == [2]
    exact, stored = top1[2]
    assert exact.shape == stored.shape == (2, 2, 32)  # (layers, heads, the segment's queries)
    assert 0 < (exact != stored).float().mean().item() <= 1
    bits = cache.memory().span_bits_per_element
    assert 1.5 < bits <= 2.5 + 1e-6, bits
    assert torch.isfinite(out.latents).all()
    rel = ((out.latents - reference.latents).norm() / reference.latents.norm()).item()
    assert 0 < rel < 0.5, rel


def test_plan_without_frames_to_generate_is_refused(model):
    with pytest.raises(ValueError, match="conditioning frames"):
        SPEC.rollout(model, SPEC.tiny_plan(4, 0), None)
