"""diffusers' WanTransformer3DModel through the QuantWM cache: equivalence, fidelity, traces, bytes."""
import pytest
import torch

from quantwm.adapters import TraceCapture
from quantwm.adapters.diffusers_wan import (
    WanCacheAdapter,
    wan_block_causal,
    wan_kv_cache,
    wan_rope_at,
)
from quantwm.core.cache import CacheConfig, KVCache
from quantwm.core.methods import get_method, known_methods
from quantwm.evaluation.analyze import analyze_trace
from quantwm.evaluation.metrics import rel_err
from quantwm.evaluation.trace import read_trace

diffusers = pytest.importorskip("diffusers")

FRAMES, CHANNELS, HEIGHT, WIDTH = 2, 4, 8, 16  # a chunk: 2 latent frames of 4x8 = 32 tokens
N_CHUNKS = 6


@pytest.fixture(scope="module")
def wan():
    torch.manual_seed(0)
    return diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64, in_channels=CHANNELS,
        out_channels=CHANNELS, text_dim=16, freq_dim=32, ffn_dim=128, num_layers=2, rope_max_seq_len=64).eval()


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, CHANNELS, FRAMES * N_CHUNKS, HEIGHT, WIDTH, generator=g)  # clean latents, all chunks
    noise = torch.randn(x.shape, generator=g)
    text = torch.randn(1, 8, 16, generator=g)
    return x, noise, text


def _generate(model, inputs, cache, capture=None, n_chunks=N_CHUNKS, attn_out=None):
    """Per chunk: one denoising pass (t=500) on a noisy chunk, then the clean pass (t=0) that commits.

    Returns (denoising-pass outputs, clean-pass outputs), each (1, C, frames, H, W) over all chunks.
    attn_out: a list that receives every layer's raw attention output (B, L, H*D) per pass.
    """
    x, noise, text = inputs
    hooks = [] if attn_out is None else [
        b.attn1.to_out[0].register_forward_pre_hook(lambda m, a, i=i: attn_out.append((i, a[0].clone())))
        for i, b in enumerate(model.blocks)]
    den, clean = [], []
    try:
        with torch.no_grad(), WanCacheAdapter(model, cache, capture) as w:
            for i in range(n_chunks):
                sl = slice(i * FRAMES, (i + 1) * FRAMES)
                with w.chunk(i):
                    den.append(model(0.5 * x[:, :, sl] + 0.5 * noise[:, :, sl], torch.tensor([500.0]), text).sample)
                with w.chunk(i, commit=True):
                    clean.append(model(x[:, :, sl], torch.tensor([0.0]), text).sample)
    finally:
        for h in hooks:
            h.remove()
    return torch.cat(den, 2), torch.cat(clean, 2)


def _single_pass(model, inputs):
    x, _, text = inputs
    with torch.no_grad(), wan_block_causal(model, FRAMES):
        return model(x, torch.tensor([0.0]), text).sample


def test_wan_rope_at_offset_equals_the_full_sequence_slice(wan, inputs):
    x = inputs[0]
    cos, sin = wan.rope(x)
    tpf = (HEIGHT // 2) * (WIDTH // 2)
    c2, s2 = wan_rope_at(wan.rope, x[:, :, 4:6], frame_offset=4)
    assert torch.equal(c2, cos[:, 4 * tpf:6 * tpf]) and torch.equal(s2, sin[:, 4 * tpf:6 * tpf])
    assert not torch.equal(wan_rope_at(wan.rope, x[:, :, 4:6], 0)[0], c2)
    with pytest.raises(ValueError, match="RoPE table"):
        wan_rope_at(wan.rope, x[:, :, :2], frame_offset=63)


def test_the_caches_frame_shift_is_the_models_rope_between_frames(wan):
    cache = wan_kv_cache(wan, CacheConfig("quantwm"), (HEIGHT // 2, WIDTH // 2))
    shift = cache.frame_shift
    assert shift.tokens_per_frame == (HEIGHT // 2) * (WIDTH // 2) and abs(shift.theta - 10000) < 1e-3
    M = shift.matrix(1)  # frame 0 -> 1: the temporal pairs turn by the table's frame-1 angles, rows/columns not
    t = wan.rope.t_dim
    assert torch.allclose(torch.diagonal(M)[:t], wan.rope.freqs_cos[1, :t].double(), atol=1e-6)
    assert torch.allclose(torch.diagonal(M)[t:], torch.ones(M.shape[0] - t, dtype=torch.float64))
    assert wan_kv_cache(wan, CacheConfig("quantwm")).frame_shift is None


def test_chunked_bf16_matches_block_causal_single_pass(wan, inputs):
    ref = _single_pass(wan, inputs)
    _, clean = _generate(wan, inputs, wan_kv_cache(wan, CacheConfig("bf16")))
    diff = (clean - ref).abs().max().item()
    print(f"\nbf16 chunked vs block-causal single pass: max abs diff {diff:.3g} (output scale {ref.abs().max().item():.3g})")
    assert diff <= 1e-5, diff
    with torch.no_grad():  # the mask matters: an unmasked pass over the same sequence is far off
        full = wan(inputs[0], torch.tensor([0.0]), inputs[2]).sample
    assert (full - ref).abs().max().item() > 1e-3


@pytest.mark.parametrize("layout", ["BHLD", "BLHD"])
def test_pre_rope_cache_and_both_layouts_match_the_post_rope_run(wan, inputs, layout):
    _, post = _generate(wan, inputs, wan_kv_cache(wan, CacheConfig("bf16")), n_chunks=3)
    grid = (HEIGHT // 2, WIDTH // 2)
    _, pre = _generate(wan, inputs, wan_kv_cache(wan, CacheConfig("bf16", rope="pre", layout=layout), grid), n_chunks=3)
    assert (pre - post).abs().max().item() <= 1e-5


def test_adapter_restores_processors_and_rope_on_exit(wan, inputs):
    x, _, text = inputs
    originals = [b.attn1.processor for b in wan.blocks]
    with torch.no_grad():
        before = wan(x[:, :, :4], torch.tensor([0.0]), text).sample
    with pytest.raises(RuntimeError, match="boom"):
        with WanCacheAdapter(wan, wan_kv_cache(wan)) as w:
            assert all(b.attn1.processor is not p for b, p in zip(wan.blocks, originals))
            with w.chunk(0), torch.no_grad():
                wan(x[:, :, :2], torch.tensor([0.0]), text)
            raise RuntimeError("boom")
    assert all(b.attn1.processor is p for b, p in zip(wan.blocks, originals))
    assert not wan.rope._forward_hooks
    with torch.no_grad():
        assert torch.equal(wan(x[:, :, :4], torch.tensor([0.0]), text).sample, before)


@pytest.mark.parametrize("method", known_methods())
def test_every_registry_method_generates_through_the_adapter(wan, inputs, method):
    if get_method(method).pre_rope:  # defined on pre-RoPE keys: the adapter's pre-RoPE cache
        cache = wan_kv_cache(wan, CacheConfig(method, rope="pre"), (HEIGHT // 2, WIDTH // 2))
    else:
        cache = wan_kv_cache(wan, CacheConfig(method))
    den, clean = _generate(wan, inputs, cache, n_chunks=4)
    assert torch.isfinite(den).all() and torch.isfinite(clean).all()
    assert [len(st.chunks) for st in cache.layers] == [4, 4]
    quantized = [c.index for c in cache.layers[0].chunks if c.quantized]
    if method == "bf16":
        assert quantized == []
    else:
        assert quantized == [1, 2] and cache.bits_per_element() > 2
        if getattr(cache.k_method, "n_centroids", 0) != 256:  # the papers' 256 BF16 centroids outweigh short chunks
            assert cache.bits_per_element() < 16


def test_quantwm_differs_from_bf16_no_more_than_the_trace_analysis_predicts(wan, inputs, tmp_path):
    """The trace of the bf16 run's last chunk predicts, per layer, the relative MSE of the attention output
    that quantizing its history causes (isolated, history only). Layer 0 sees the same Q and exact K/V in
    both runs, so its in-run error must stay below the prediction; the model output, where attention
    enters the residual stream through a gate, must too."""
    last = N_CHUNKS - 1
    cap = TraceCapture(chunks=[last], model="tiny-wan")
    a_bf16 = []
    den_bf16, _ = _generate(wan, inputs, wan_kv_cache(wan, CacheConfig("bf16")), cap, attn_out=a_bf16)
    path = cap.save(tmp_path / "tiny_wan.safetensors")[0]
    predicted = analyze_trace(read_trace(path), ["quantwm"], target="kv")["methods"]["quantwm"]
    a_q = []
    den_q, _ = _generate(wan, inputs, wan_kv_cache(wan, CacheConfig("quantwm")), attn_out=a_q)
    n_layers = len(wan.blocks)
    last_pass = slice(-2 * n_layers, -n_layers)  # the last chunk's denoising pass (then its clean pass)
    in_run = [rel_err(q, b) for (_, q), (_, b) in zip(a_q[last_pass], a_bf16[last_pass])]
    pred = [r["out_rel_err"] for r in predicted["layers"]]
    sl = slice(last * FRAMES, None)
    out_err = rel_err(den_q[:, :, sl], den_bf16[:, :, sl])
    print(f"\nattention rel MSE per layer: in-run {[f'{e:.4g}' for e in in_run]}, "
          f"predicted {[f'{e:.4g}' for e in pred]}; model output rel MSE {out_err:.4g} "
          f"(max abs {(den_q[:, :, sl] - den_bf16[:, :, sl]).abs().max().item():.4g}); "
          f"predicted mean {predicted['mean']['out_rel_err']:.4g}")
    assert 0 < in_run[0] <= pred[0]
    assert 0 < out_err <= predicted["mean"]["out_rel_err"]


def test_captured_trace_opens_in_analyze_cli_and_app(wan, inputs, tmp_path, capsys):
    import json

    from app.handlers import analyze_handler
    from quantwm.cli import main

    cap = TraceCapture(chunks=[2, 3], layers=[1], pass_kind="commit", model="tiny-wan")
    _generate(wan, inputs, wan_kv_cache(wan, CacheConfig("bf16")), cap, n_chunks=4)
    frames = torch.rand(4 * FRAMES, 32, 64, 3)
    cap.set_frames(frames)
    paths = cap.save(tmp_path / "wan_{chunk}.safetensors")
    assert [p.name for p in paths] == ["wan_2.safetensors", "wan_3.safetensors"]
    t = read_trace(paths[1])
    assert list(t.layers) == [1] and t.frame_grid == (4, 8) and t.meta["chunk_frames"] == "2"
    assert t.layers[1]["k"].shape == (2, 3 * FRAMES * 32, 64) and t.layers[1]["q"].shape == (2, FRAMES * 32, 64)
    assert t.frames.shape == (8, 32, 64, 3)
    out = tmp_path / "report.json"
    assert main(["analyze", "--trace", str(paths[1]), "--methods", "bf16,quantwm", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["methods"]["bf16"]["mean"]["out_rel_err"] == 0
    assert report["methods"]["quantwm"]["mean"]["out_rel_err"] > 0
    status, _, rows = analyze_handler(str(paths[1]), ["quantwm"], "kv", 2)
    assert "tiny-wan" in status and rows and rows[0][0] == "quantwm"


def test_bad_use_raises_value_errors_that_name_the_problem(wan, inputs):
    x, _, text = inputs
    with pytest.raises(ValueError, match="WanTransformer3DModel"):
        WanCacheAdapter(torch.nn.Linear(2, 2), wan_kv_cache(wan))
    with pytest.raises(ValueError, match="3 layers, the model 2 blocks"):
        WanCacheAdapter(wan, KVCache(CacheConfig(), 3))
    with pytest.raises(ValueError, match="frame_grid"):
        wan_kv_cache(wan, CacheConfig(rope="pre"))
    with pytest.raises(ValueError, match="frames_per_chunk"):
        with wan_block_causal(wan, 0):
            pass
    adapter = WanCacheAdapter(wan, wan_kv_cache(wan))
    with pytest.raises(ValueError, match="enter the adapter"):
        adapter.chunk(0)
    with torch.no_grad(), adapter as w:
        with pytest.raises(ValueError, match="no chunk position set"):
            wan(x[:, :, :2], torch.tensor([0.0]), text)
        with pytest.raises(ValueError, match="skips ahead"), w.chunk(1):
            wan(x[:, :, :2], torch.tensor([0.0]), text)
    pre = wan_kv_cache(wan, CacheConfig(rope="pre"), frame_grid=(2, 2))
    with torch.no_grad(), WanCacheAdapter(wan, pre) as w, w.chunk(0):
        with pytest.raises(ValueError, match="4x8 tokens per frame"):
            wan(x[:, :, :2], torch.tensor([0.0]), text)


def test_wan13b_bf16_cache_bytes_per_latent_frame_and_quantwm_6x_smaller():
    """Bytes counted from the stored tensors of one Wan-1.3B layer (12 heads x 128, 1560 tokens per latent
    frame, a 3-frame chunk), times 30 layers: every layer stores the same shapes."""
    layers, frames = 30, 3
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, 12, frames * 1560, 128, generator=g).to(torch.bfloat16) for _ in range(2))
    per_frame = {}
    for method in ("bf16", "quantwm"):
        cache = KVCache(CacheConfig(method, sink_chunks=0, recent_chunks=0), 1)  # the chunk is quantized on commit
        cache.write(0, k, v, 0)
        cache.commit(0, 0)
        per_frame[method] = cache.nbytes() * layers / frames
    print(f"\nWan-1.3B bytes per latent frame: bf16 {per_frame['bf16']:,.0f}, quantwm {per_frame['quantwm']:,.0f} "
          f"({per_frame['bf16'] / per_frame['quantwm']:.2f}x smaller)")
    assert per_frame["bf16"] == 30 * 2 * 1560 * 12 * 128 * 2  # 287,539,200 bytes
    assert per_frame["bf16"] / per_frame["quantwm"] >= 6
