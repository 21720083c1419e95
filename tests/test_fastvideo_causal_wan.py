"""Self-Forcing / Causal-Forcing through QuantWM's cache in FastVideo's own CausalWanTransformer3DModel."""
import fastvideo_checks as fc
import pytest
import torch
from safetensors import safe_open

from quantwm.adapters.attention import ChunkedAttention
from quantwm.adapters.fastvideo import get_model
from quantwm.adapters.fastvideo.causal_wan import SelfForcing
from quantwm.core.cache import KVCache

SPEC = get_model("self-forcing")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return fc.tiny_loaded(SPEC, tmp_path_factory.mktemp("causal_wan"))


def test_tiny_model_is_fastvideos_class_loaded_from_its_diffusers_named_folder(model, tmp_path):
    from fastvideo.models.dits.causal_wanvideo import CausalWanTransformer3DModel as Cls

    assert type(model) is Cls and SPEC.shape(model) == (2, 2, 32) and SPEC.chunk_frames(model) == 2
    again = SPEC.build_tiny(0)
    folder = SPEC.save(again, tmp_path / "transformer")
    with safe_open(str(folder / "diffusion_pytorch_model.safetensors"), "pt") as f:
        names = set(f.keys())
    # the checkpoint's diffusers names, not FastVideo's own
    assert {"blocks.0.attn1.to_q.weight", "blocks.1.attn1.norm_k.weight", "blocks.0.ffn.net.0.proj.weight",
            "blocks.0.norm2.weight", "patch_embedding.weight"} <= names
    assert not any(".to_q." in n and ".attn" not in n for n in names)
    assert len(names) == len(again.state_dict()) and "reverse_param_names_mapping" not in again.__dict__
    assert all(torch.equal(again.state_dict()[k].to(v.dtype), v) for k, v in model.state_dict().items())


def test_bf16_through_quantwm_equals_fastvideos_kv_cache_bit_for_bit(model):
    ref, out = fc.bf16_pair(SPEC, model, SPEC.tiny_plan(8, 0))
    assert ref.latents.shape == (16, 8, 8, 8) and torch.isfinite(ref.latents).all()
    assert torch.equal(ref.latents, out.latents)
    assert out.cache_map[3]["read"]["bf16"] == [0, 1, 2, 3, 4, 5]


def test_bf16_equal_with_sink_and_rolling_window(tmp_path):
    windowed = fc.tiny_loaded(SPEC, tmp_path, {"local_attn_size": 6, "sink_size": 2})
    assert SPEC.cache_config(windowed).max_chunks == 2 and SPEC.cache_config(windowed).sink_chunks == 1
    ref, out = fc.bf16_pair(SPEC, windowed, SPEC.tiny_plan(10, 1))
    assert torch.equal(ref.latents, out.latents)
    # the window evicted chunk 1 before chunk 4 read: sink chunk 0 and chunk 3 held
    assert out.cache_map[4]["read"]["bf16"] == [0, 1, 6, 7]


def test_bf16_equal_under_relativistic_rope_with_sink_and_window(tmp_path):
    window = {"local_attn_size": 6, "sink_size": 2}
    rel = fc.tiny_loaded(SPEC, tmp_path / "rel", {**window, "rope_cache_policy": "relativistic"})
    cfg = SPEC.cache_config(rel)
    assert cfg.rope == "pre"
    plan = SPEC.tiny_plan(10, 2)
    ref = SPEC.rollout(rel, plan, None)
    out = SPEC.rollout(rel, plan, ChunkedAttention(KVCache(cfg, SPEC.shape(rel)[0], rope=SPEC.key_rope(rel))))
    assert torch.equal(ref.latents, out.latents)
    # the policy matters once the window rolls: the same weights under absolute RoPE give another video
    absolute = SPEC.rollout(fc.tiny_loaded(SPEC, tmp_path / "abs", window), plan, None)
    assert torch.equal(absolute.latents[:, :6], ref.latents[:, :6])
    assert not torch.equal(absolute.latents[:, 6:], ref.latents[:, 6:])
    with pytest.raises(ValueError, match="rope=spec.key_rope"):
        SPEC.rollout(rel, plan, ChunkedAttention(KVCache(SPEC.cache_config(rel, rope="post"), 2)))


def test_global_attention_refuses_past_21_frames_like_fastvideo(model):
    plan = SPEC.tiny_plan(22, 0)
    with pytest.raises(ValueError, match="21-latent-frame KV window"):  # FastVideo's own refusal
        SPEC.rollout(model, plan, None)
    with pytest.raises(ValueError, match="at most 21 latent frames"):
        SPEC.rollout(model, plan, ChunkedAttention(KVCache(SPEC.cache_config(model), 2)))


def test_quantwm_at_2_5_bits_records_shift_and_bits(model):
    shifts, bits, rel = fc.check_quantized(SPEC, model, SPEC.tiny_plan(8, 0))
    assert max(shifts) > 0


def test_causal_forcing_is_the_same_model():
    assert type(get_model("causal-forcing")) is type(SPEC) is SelfForcing
    assert SPEC.aliases == ("causal-forcing",)
