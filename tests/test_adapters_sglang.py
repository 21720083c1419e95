"""The QuantWM cache behind SGLang's causal KV contract, driven by SGLang's own code from the pinned wheel.

install.sh installs sglang==0.5.23 with --no-deps (its dependencies would replace torch), so `import sglang`
fails on psutil here: the contract module (`causal_attention_cache.py`) and the hook registry
(`sglang/srt/plugins/hook_registry.py`) need only torch and the standard library, and are loaded from the
installed files on their own (`quantwm.adapters.sglang_cache.load_sglang_module`). The stage classes import
the whole runtime, so the hooks are applied to stand-ins below that have the same methods and signatures.
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from quantwm.adapters import sglang_plugin as plugin
from quantwm.adapters.sglang_cache import QuantWMCausalKVCache, load_contract, load_sglang_module
from quantwm.core.cache import CacheConfig

contract = load_contract()
hooks = load_sglang_module("sglang.srt.plugins.hook_registry")


def test_the_contract_is_sglangs_own_file():
    assert contract.__file__.endswith("sglang/multimodal_gen/runtime/layers/kvcache/causal_attention_cache.py")
    assert "def update_and_get_attention_kv" in open(contract.__file__).read()


def dense_cache(heads, dim, cache_size, **kw):
    shape = [1, cache_size, heads, dim]
    return contract.CausalSelfAttentionKVCache(
        k=torch.zeros(shape, dtype=torch.bfloat16), v=torch.zeros(shape, dtype=torch.bfloat16),
        global_end_index=torch.zeros(1, dtype=torch.long), local_end_index=torch.zeros(1, dtype=torch.long),
        cache_size=cache_size, **kw)


def ours(heads, dim, cache_size, method="bf16", bits=2, **kw):
    return QuantWMCausalKVCache(config=CacheConfig(method=method, k_bits=bits, v_bits=bits), batch_size=1,
                                cache_size=cache_size, num_heads=heads, head_dim=dim, dtype=torch.bfloat16,
                                device="cpu", **kw)


def drive(pairs, *, chunks=12, passes=3, tokens=12, heads=4, dim=16, slices=None, recent=None, pin=False, seed=0):
    """Feed the same K/V through (reference, ours) pairs; yield both views of every call.

    slices: per pair, (cache_head_start, n_heads) of the heads that pair's rank writes (None: every head)."""
    g = torch.Generator().manual_seed(seed)
    for c in range(chunks):
        for p in range(passes):
            k = torch.randn(1, tokens, heads, dim, generator=g).bfloat16()
            v = torch.randn(1, tokens, heads, dim, generator=g).bfloat16()
            for i, (ref, mine) in enumerate(pairs):
                first, n = (slices[i] if slices else (None, heads))
                part = slice(first or 0, (first or 0) + n)
                kw = dict(key=k[:, :, part], value=v[:, :, part], current_chunk_start=c * tokens,
                          cache_head_start=first, recent_window_tokens=recent)
                yield c, p, ref.update_and_get_attention_kv(**kw), mine.update_and_get_attention_kv(**kw)
        if pin:
            for ref, mine in pairs:
                ref.pin_current_chunk(tokens), mine.pin_current_chunk(tokens)


def assert_equal_views(calls):
    n = 0
    for c, p, a, b in calls:
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v), f"chunk {c} pass {p}"
        assert (a.local_start_index, a.local_end_index, a.visible_local_end, a.visible_global_end) == \
            (b.local_start_index, b.local_end_index, b.visible_local_end, b.visible_global_end)
        n += 1
    return n


def test_bf16_equals_sglang_dense_cache_with_sink_sliding_window_and_passes():
    pair = (dense_cache(4, 16, 60, sink_tokens=12), ours(4, 16, 60, sink_tokens=12))
    assert assert_equal_views(drive([pair])) == 36
    assert pair[1].global_end_index.item() == 12 * 12 and pair[1].local_end_index.item() == 60
    assert len(pair[1].store.spans(0)) == 5  # evicted chunks left the store: sink + 4 window chunks (one current)


def test_bf16_equals_sglang_for_two_ulysses_head_slices():
    # Ulysses: every rank caches its own slice of the heads (2 of 4), told where it starts.
    pairs = [(dense_cache(2, 16, 48, sink_tokens=12), ours(2, 16, 48, sink_tokens=12)) for _ in range(2)]
    assert assert_equal_views(drive(pairs, slices=[(0, 2), (2, 2)])) == 72


def test_bf16_equals_sglang_for_tensor_parallel_head_slices_of_one_cache():
    # Megatron-style: the cache holds every head, each rank's calls write only its slice.
    pairs = [(dense_cache(4, 16, 48, sink_tokens=12), ours(4, 16, 48, sink_tokens=12)) for _ in range(2)]
    assert assert_equal_views(drive(pairs, slices=[(0, 2), (2, 2)])) == 72


def test_bf16_equals_sglang_with_token_granular_windows():
    # The buffer (50) is no multiple of the chunk (12) and the recent window (17) cuts inside a chunk.
    pair = (dense_cache(4, 16, 50, sink_tokens=12), ours(4, 16, 50, sink_tokens=12))
    assert assert_equal_views(drive([pair], recent=17)) == 36
    pair = (dense_cache(4, 16, 70, sink_tokens=12, attention_window_size=41),
            ours(4, 16, 70, sink_tokens=12, attention_window_size=41))
    assert assert_equal_views(drive([pair])) == 36


def test_bf16_equals_sglang_with_pinned_and_global_sinks_and_growth():
    # LongLive2's path: a global sink, chunks pinned after their clean pass, a buffer that may grow.
    kw = dict(sink_tokens=6, global_sink_tokens=12)
    pair = (dense_cache(4, 16, 48, **kw), ours(4, 16, 48, **kw))
    assert assert_equal_views(drive([pair], pin=True)) == 36
    pair = (dense_cache(4, 16, 24, allow_growth=True), ours(4, 16, 24, allow_growth=True))
    assert assert_equal_views(drive([pair], chunks=5)) == 15
    assert pair[1].cache_size == pair[0].cache_size > 24


def test_reset_starts_a_new_video():
    pair = (dense_cache(4, 16, 60, sink_tokens=12), ours(4, 16, 60, sink_tokens=12))
    assert_equal_views(drive([pair], chunks=4))
    for cache in pair:
        cache.reset_indices()
    assert pair[1].nbytes() == 0
    assert assert_equal_views(drive([pair], chunks=6, seed=1)) == 18


@pytest.mark.parametrize("method", ["rtn", "kivi", "qvg", "quantwm"])
def test_quantized_methods_report_stored_bytes(method):
    dense = dense_cache(2, 64, 96, sink_tokens=16)
    mine = ours(2, 64, 96, method=method, sink_tokens=16)
    errors = [((a.k.float() - b.k.float()).norm() / a.k.float().norm()).item()
              for _, _, a, b in drive([(dense, mine)], chunks=10, tokens=16, heads=2, dim=64)]
    # Held at the end: tokens [0, 16) (sink) and the last 80 (chunks 5-9); chunk 8 is the recent one, 9 current.
    spans = mine.store.spans(0)
    assert [s.index for s in spans] == [0, 5, 6, 7, 8, 9]
    assert [s.quantized for s in spans] == [False, True, True, True, False, False]
    chunk = 16 * 2 * 64  # elements of one chunk's K (or V)
    parts = mine.store.bytes_by_component()
    assert parts["k.full"] + parts["v.full"] == 3 * 2 * chunk * 2  # three chunks' K and V in BF16
    quantized = mine.nbytes() - 3 * 2 * chunk * 2
    assert quantized > 0 and mine.bits_per_element() == pytest.approx(8 * quantized / (3 * 2 * chunk))
    assert mine.resident_nbytes() == mine.nbytes()  # no head slices: nothing staged beside the store
    assert max(errors) < 0.6  # the same tokens in the same order, quantized
    assert max(errors) > 0 or method == "qvg"  # QVG's 256 centroids hold a 32-stream span's tokens exactly


def test_queries_reach_the_statistics_and_a_calibration_file_seeds_them(tmp_path):
    cache = ours(2, 64, 96, method="quantwm", sink_tokens=16)
    cache.stash_queries(torch.randn(1, 16, 2, 64).bfloat16() * 3)
    cache.update_and_get_attention_kv(key=torch.randn(1, 16, 2, 64).bfloat16(),
                                      value=torch.randn(1, 16, 2, 64).bfloat16(), current_chunk_start=0)
    assert not torch.allclose(cache.store.query_stats(0).double(), torch.eye(64).expand(2, 64, 64).double())
    S = torch.eye(64).repeat(4, 1, 1) * torch.arange(1, 5).view(4, 1, 1)
    save_file({"L0.S": S, "L1.S": S.clone()}, str(tmp_path / "stats.safetensors"))
    stats = plugin.load_query_stats(str(tmp_path / "stats.safetensors"))
    rank1 = ours(2, 64, 96, method="quantwm", query_stats=stats[1], head_offset=2)  # Ulysses rank 1: heads 2, 3
    rank1.update_and_get_attention_kv(key=torch.randn(1, 16, 2, 64).bfloat16(),
                                      value=torch.randn(1, 16, 2, 64).bfloat16(), current_chunk_start=0)
    assert torch.allclose(rank1.store.query_stats(0)[:, 0, 0].double(), torch.tensor([3.0, 4.0], dtype=torch.float64))
    tp = ours(4, 64, 96, method="quantwm", query_stats=stats[0])  # tensor parallel: a full-head cache, heads 2, 3
    tp.stash_queries(torch.randn(1, 16, 2, 64).bfloat16())
    view = tp.update_and_get_attention_kv(key=torch.randn(1, 16, 2, 64).bfloat16(),
                                          value=torch.randn(1, 16, 2, 64).bfloat16(), current_chunk_start=0,
                                          cache_head_start=2)
    assert view.k.shape == (1, 16, 2, 64) and tp.store.spans(0)[0].bhd == (1, 2, 64)  # the store keeps the slice
    assert tp.store.query_stats(0).shape == (2, 64, 64)
    kw = dict(batch_size=1, kv_cache_size=96, num_attention_heads=2, attention_head_dim=64, dtype=torch.bfloat16,
              device="cpu")
    with pytest.raises(ValueError, match="lacks block 2"):
        plugin.make_caches(plugin.PluginConfig(), 3, query_stats=stats, **kw)
    (tmp_path / "bad.safetensors").write_bytes(b"not a file")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        plugin.load_query_stats(str(tmp_path / "bad.safetensors"))


def test_a_wrong_call_fails_with_a_clear_message():
    cache = ours(4, 16, 60, sink_tokens=12)
    kv = dict(key=torch.zeros(1, 12, 4, 16).bfloat16(), value=torch.zeros(1, 12, 4, 16).bfloat16())
    cache.update_and_get_attention_kv(**kv, current_chunk_start=0)
    cache.update_and_get_attention_kv(**kv, current_chunk_start=12)
    with pytest.raises(ValueError, match="chunk start 0 goes backwards"):
        cache.update_and_get_attention_kv(**kv, current_chunk_start=0)
    with pytest.raises(ValueError, match="chunk start 36 skips ahead"):
        cache.update_and_get_attention_kv(**kv, current_chunk_start=36)
    with pytest.raises(ValueError, match="writes 6 tokens, the chunk has 12"):
        cache.update_and_get_attention_kv(key=kv["key"][:, :6], value=kv["value"][:, :6], current_chunk_start=12)
    with pytest.raises(ValueError, match="requires cache_head_start"):
        cache.update_and_get_attention_kv(key=kv["key"][:, :, :2], value=kv["value"][:, :, :2],
                                          current_chunk_start=24)
    with pytest.raises(ValueError, match="lies inside the current chunk"):
        cache.update_and_get_attention_kv(**kv, current_chunk_start=18)
    with pytest.raises(ValueError, match="must be 0 \\(the first write of a video\\)"):
        ours(4, 16, 60).update_and_get_attention_kv(**kv, current_chunk_start=12)
    tp = ours(4, 16, 60)
    tp.update_and_get_attention_kv(key=kv["key"][:, :, :2], value=kv["value"][:, :, :2], current_chunk_start=0,
                                   cache_head_start=0)
    with pytest.raises(ValueError, match="keeps heads \\[0, 2\\) \\(one rank's slice\\)"):
        tp.update_and_get_attention_kv(key=kv["key"][:, :, :2], value=kv["value"][:, :, :2], current_chunk_start=0,
                                       cache_head_start=2)
    with pytest.raises(ValueError, match="must be finite|NaN|non-finite"):
        cache.update_and_get_attention_kv(key=kv["key"] * float("nan"), value=kv["value"], current_chunk_start=24)


def test_config_from_environment_and_file(tmp_path):
    assert plugin.read_config({}) is None
    cfg = plugin.read_config({"QUANTWM_KV_METHOD": "quantwm", "QUANTWM_KV_BITS": "4", "QUANTWM_KV_V_BITS": "2"})
    assert (cfg.method, cfg.k_bits, cfg.v_bits, cfg.target) == ("quantwm", 4, 2, "kv")
    path = tmp_path / "quantwm.json"
    path.write_text(json.dumps({"method": "rtn", "bits": 2, "recent_chunks": 2}))
    cfg = plugin.read_config({"QUANTWM_KV_CONFIG": str(path), "QUANTWM_KV_TARGET": "k"})
    assert (cfg.method, cfg.k_bits, cfg.recent_chunks, cfg.target) == ("rtn", 2, 2, "k")


@pytest.mark.parametrize("environ, message", [
    ({"QUANTWM_KV_METHOD": "quantvm"}, "unknown method 'quantvm'; known methods: .*quantwm"),
    ({"QUANTWM_KV_METHOD": "rtn", "QUANTWM_KV_BITS": "7"}, "unsupported bits=7"),
    ({"QUANTWM_KV_METHOD": "rtn", "QUANTWM_KV_BITS": "2.5"}, "bits must be an integer"),
    ({"QUANTWM_KV_METHOD": "rtn", "QUANTWM_KV_TARGTE": "k"}, "unknown setting QUANTWM_KV_TARGTE"),
    ({"QUANTWM_KV_METHOD": "rtn", "QUANTWM_KV_TARGET": "q"}, "target must be one of k, v, kv"),
    ({"QUANTWM_KV_CONFIG": "/nonexistent.json"}, "cannot read it as JSON"),
    ({"QUANTWM_KV_METHOD": "kivi-pre"}, "quantizes keys before RoPE"),
    ({"QUANTWM_KV_METHOD": "quantwm+jensen"}, "logit bias that SGLang's attention backends do not apply"),
])
def test_a_bad_setting_stops_the_worker_with_one_line(environ, message):
    with pytest.raises(ValueError, match=message):
        plugin.read_config(environ)
    registry = fresh_registry()
    with pytest.raises(SystemExit, match="quantwm SGLang plugin: .*" + message):
        plugin.register(registry, hooks.HookType.AROUND, environ)
    assert not registry._hooks


def fresh_registry():
    """SGLang's HookRegistry with its own empty tables (as the diffusion runtime rebinds them)."""
    return type("Registry", (hooks.HookRegistry,), {"_hooks": defaultdict(list), "_patched": set()})


# ---- the hooks, applied by SGLang's HookRegistry to stand-ins of the stage and the attention -----------------
class CausalDMDDenoisingStage:
    """Stand-in: the real stage's `_allocate_causal_kv_cache` signature and the attribute it reads."""

    num_transformer_blocks = 3

    def _allocate_causal_kv_cache(self, *, batch_size, kv_cache_size, num_attention_heads, attention_head_dim,
                                  dtype, device, use_int_indices=False, sink_tokens=0, global_sink_tokens=0,
                                  attention_window_size=None, allow_growth=False):
        return ["dense"] * self.num_transformer_blocks


class SanaWMStreamingDenoisingStage(CausalDMDDenoisingStage):
    """A stage the plugin does not cover."""


def _apply_rotary_emb(x, cos, sin, is_neox_style=False):  # what the attention module's globals provide
    return x * cos + sin


class LocalAttention(torch.nn.Module):
    """Stand-in for SGLang's LocalAttention: (B, L, H, D) in and out, softmax scale D**-0.5."""

    def __init__(self, head_dim):
        super().__init__()
        self.softmax_scale = head_dim ** -0.5

    def forward(self, q, k, v):
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2).float(), k.transpose(1, 2).float(),
                                                               v.transpose(1, 2).float(), scale=self.softmax_scale)
        return out.transpose(1, 2).to(q.dtype)


class CausalWanSelfAttention(torch.nn.Module):
    """Stand-in with the real forward's signature and body: rotate, write into the cache, attend with self.attn."""

    def __init__(self, head_dim=64):
        super().__init__()
        self.attn = LocalAttention(head_dim)

    def forward(self, q, k, v, freqs_cis, block_mask, kv_cache=None, current_start=0, cache_start=None):
        cos, sin = freqs_cis
        roped_query, roped_key = _apply_rotary_emb(q, cos, sin), _apply_rotary_emb(k, cos, sin)
        if kv_cache.can_direct_current_attention(roped_key.shape[1]):
            return self.attn(roped_query, roped_key, v)
        view = kv_cache.update_and_get_attention_kv(key=roped_key, value=v, current_chunk_start=current_start)
        return self.attn(roped_query, view.k, view.v)


def test_register_installs_its_hooks_through_sglangs_registry(monkeypatch):
    registry = fresh_registry()
    assert plugin.register(registry, hooks.HookType.AROUND, {}) is False and registry._hooks == {}
    environ = {"QUANTWM_KV_METHOD": "quantwm", "QUANTWM_KV_BITS": "2"}
    assert plugin.register(registry, hooks.HookType.AROUND, environ) is True
    assert set(registry._hooks) == set(plugin.ALLOCATION_HOOKS + plugin.QUERY_HOOKS)
    assert all(h[0] is hooks.HookType.AROUND for target in registry._hooks for h in registry._hooks[target])

    here = sys.modules[__name__].__name__
    monkeypatch.setattr(CausalDMDDenoisingStage, "_allocate_causal_kv_cache",
                        CausalDMDDenoisingStage._allocate_causal_kv_cache)
    monkeypatch.setattr(CausalWanSelfAttention, "forward", CausalWanSelfAttention.forward)
    standins = {plugin.ALLOCATION_HOOKS[0]: f"{here}.CausalDMDDenoisingStage._allocate_causal_kv_cache",
                plugin.QUERY_HOOKS[1]: f"{here}.CausalWanSelfAttention.forward"}
    for real, standin in standins.items():
        registry._apply_target(standin, registry._hooks[real])  # SGLang's own patching code

    kw = dict(batch_size=1, kv_cache_size=64, num_attention_heads=2, attention_head_dim=64,
              dtype=torch.bfloat16, device="cpu", sink_tokens=16)
    caches = CausalDMDDenoisingStage()._allocate_causal_kv_cache(**kw)
    assert len(caches) == 3 and all(isinstance(c, QuantWMCausalKVCache) for c in caches)
    assert caches[0].config.method == "quantwm" and caches[0].sink_tokens == 16
    assert SanaWMStreamingDenoisingStage()._allocate_causal_kv_cache(**kw) == ["dense"] * 3

    attn, q = CausalWanSelfAttention(), torch.randn(1, 16, 2, 64).bfloat16()
    k, v = torch.randn(1, 16, 2, 64).bfloat16(), torch.randn(1, 16, 2, 64).bfloat16()
    out = attn.forward(q, k, v, (torch.ones(1), torch.zeros(1)), None, kv_cache=caches[0], current_start=0)
    assert out.shape == (1, 16, 2, 64)
    S = caches[0].store.query_stats(0).double()  # E[q q^T] per head, of the rotated queries
    rotated = (q.double() * 1 + 0).transpose(1, 2)[0]  # the stand-in's RoPE with cos 1, sin 0: (H, N, D)
    assert torch.allclose(S, rotated.transpose(-1, -2) @ rotated / 16, rtol=1e-3, atol=1e-3)


def hooked_attention(monkeypatch):
    """The stand-in attention with the plugin's query hook applied by SGLang's registry."""
    registry = fresh_registry()
    plugin.register(registry, hooks.HookType.AROUND, {"QUANTWM_KV_METHOD": "quantwm"})
    monkeypatch.setattr(CausalWanSelfAttention, "forward", CausalWanSelfAttention.forward)
    registry._apply_target(f"{__name__}.CausalWanSelfAttention.forward", registry._hooks[plugin.QUERY_HOOKS[1]])
    return CausalWanSelfAttention()


def generate(attn, cache, chunks=8, tokens=16, passes=2):
    g = torch.Generator().manual_seed(3)
    outs = []
    for c in range(chunks):
        for _ in range(passes):
            q, k, v = (torch.randn(1, tokens, 2, 64, generator=g).bfloat16() for _ in range(3))
            outs.append(attn(q, k, v, (torch.ones(1), torch.zeros(1)), None, kv_cache=cache,
                             current_start=c * tokens))
    return torch.stack(outs).float()


def test_fused_kernels_attend_over_the_stored_spans_when_the_view_is_the_whole_store(monkeypatch):
    attn = hooked_attention(monkeypatch)
    monkeypatch.setenv("QUANTWM_KERNELS", "ref")
    decoded = ours(2, 64, 512, method="quantwm", sink_tokens=16)
    reference = generate(attn, decoded, chunks=5)  # chunks 3 and 4 read quantized spans
    monkeypatch.setenv("QUANTWM_KERNELS", "triton")  # the kernels under TRITON_INTERPRET=1 (conftest.py)
    fused = ours(2, 64, 512, method="quantwm", sink_tokens=16)
    out = generate(attn, fused, chunks=5)
    assert decoded.fused_calls == 0 and fused.fused_calls == 10
    assert any(s.quantized for s in fused.store.inspect(0))
    assert torch.isfinite(out).all() and "attn" not in attn.__dict__  # the interception ends with the call
    assert ((out - reference).norm() / reference.norm()).item() < 2e-2  # BF16 outputs of two attention paths
    # A buffer of 56 tokens cuts inside a chunk of 16: the view hides stored tokens, so the decoded view serves.
    windowed = ours(2, 64, 56, method="quantwm", sink_tokens=16)
    assert torch.isfinite(generate(attn, windowed, chunks=5)).all() and windowed.fused_calls < 10


def test_sglang_finds_the_plugin_by_its_entry_point():
    from importlib.metadata import entry_points

    (entry,) = [e for e in entry_points(group="sglang.multimodal_gen.plugins") if e.name == "quantwm"]
    assert entry.load() is plugin.register


def test_the_benchmark_runs_every_cache_through_the_contract(tmp_path, capsys):
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import sglang_kv

    from quantwm.evaluation.synthetic import make_synthetic_trace

    path = tmp_path / "trace.safetensors"
    make_synthetic_trace(seed=100_001, n_layers=1, n_heads=2, head_dim=64, grid=(4, 4), cached_frames=12).save(path)
    assert sglang_kv.main(["--trace", str(path)]) == 0
    rows = {line.split("  ")[0].strip(): line for line in capsys.readouterr().out.splitlines()[2:]}
    assert "skipped: needs CUDA" in rows["qvg int2 (SGLang)"]
    dense, ours = rows["dense (SGLang BF16)"].split()[-5:], rows["quantwm 2-bit"].split()[-5:]
    assert float(dense[2]) == 0 and float(dense[3]) == 0  # the reference against itself
    assert 2 <= float(ours[0]) < 16 and float(ours[1]) < float(dense[1]) and 0 < float(ours[2]) < 1


def test_query_stats_command_writes_the_calibration_file_from_a_trace(tmp_path, capsys):
    from quantwm.cli import main
    from quantwm.evaluation.synthetic import make_synthetic_trace
    from quantwm.evaluation.trace import read_trace

    trace = tmp_path / "trace.safetensors"
    make_synthetic_trace(seed=100_002, n_layers=2, n_heads=2, head_dim=64, grid=(4, 4), cached_frames=6).save(trace)
    out = tmp_path / "stats.safetensors"
    assert main(["query-stats", "--trace", str(trace), "--out", str(out)]) == 0
    assert "S for 2 layers, (2, 64, 64) each" in capsys.readouterr().out
    stats = plugin.load_query_stats(str(out))
    hist = read_trace(trace).layers[1]["q_hist"].double()
    assert sorted(stats) == [0, 1] and torch.allclose(stats[1], hist.transpose(1, 2) @ hist / hist.shape[1],
                                                      rtol=1e-5, atol=1e-6)
    (tmp_path / "bad.safetensors").write_bytes(b"\0" * 10)
    assert main(["query-stats", "--trace", str(tmp_path / "bad.safetensors"), "--out", str(out)]) == 2
