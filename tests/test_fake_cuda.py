"""The fake-CUDA tier: QuantWM's GPU paths run on `device="cuda"` tensors on a CPU-only machine (tests/fake_cuda.py):
a CPU tensor meeting a device tensor raises as on a GPU, and every host sync (a device value read on the host, a
copy from host memory to the device) is counted under the quantwm function that made it.

Covered: every method `python -m quantwm methods` lists, on Keys, Values or both, at 2 bits and at a budget,
through write/attend/commit until spans are quantized and attended warm; pre-RoPE keys, loud-token splits,
rolling windows, re-aimed query statistics, the fused path's Python side; the Wan, Self-Forcing, SANA-WM and SGLang
adapters on tiny models, and a rollout of the built-in world model.

On a machine with a GPU the same tests run on real CUDA tensors (`RealCuda`: CUDA raises its own device mismatches;
host reads and copies counted by the same rule), as benchmarks/gpu_check.py's `cuda tier` step does.

Kernels: fake tensors cannot enter Triton, so the tier runs with QUANTWM_KERNELS=ref: the cache's reference read
path (decode, SDPA) and, with `lowp`, the fused path (the kernel views each layout builds at commit, the span fold
of quantwm/core/attention.py) with `span_attention_ref` in the kernel's place. Syncs inside a C++ call (linalg's
error checks) are not seen.

Host syncs are named and counted, never hidden: a warm attend makes none (the default configuration: its NaN/Inf
check a device flag read at commit), and a commit reads
only at the sites of `SYNCS`, at most as often as it says after the first quantized span (the first may read more:
a budget chooses then). A new site fails the tier until it is named there, with its reason. A static scan keeps
every tensor constructor in quantwm/core naming its device (or in `HOST_CONSTRUCTORS`, with its reason).
"""
from __future__ import annotations

import ast
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from fake_cuda import FakeCuda, FakeCudaTensor, RealCuda
from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError

from quantwm.core.cache import CacheConfig, KVCache
from quantwm.core.methods import get_method, method_sources

B, H, N, D = 1, 2, 64, 64  # one chunk: 64 tokens of 2 heads x 64
METHODS = [name for name, _, _ in method_sources()]  # what `python -m quantwm methods` lists
# budget per method where 2.5 bits cannot hold a 64-token span of head dim 64 (codebooks' share), or a fixed format
BUDGETS = {"bf16": 16, "int8k-fp8v": 8.5, "nvfp4": 5, "quantwm-paper": 6.5, "quantwm-psac": 3.25, "qvg": 3,
           "qvg-asym": 3, "qvg-pro": 12, "span-rtn": 2.75,
           "kvquant": 2.75,  # kvquant: per-token Values at head dim 64 store at least 2.52
           "oscar": 11}  # oscar: its 64 x 64 rotation counted over one 64-token span (the budget rule's fallback)
TOKENS = {"qvg-pro": 128}  # 4 stages of 16 centroids fit 12 bits from 128 tokens on

# (site, call) -> (the most syncs one commit makes there after the first quantized span, None: as many as a
# reference's loop takes; why it syncs). "to fix": a copy from the host that a table kept on the device would avoid.
COMMIT_READ = ("quantwm/core/quant.py:DeferredChecks.passed", "__bool__")
SYNCS = {
    ("quantwm/core/quant.py:DeferredChecks.passed", "__bool__"):
        (1, "the span's value checks and the inputs' NaN/Inf flags, in one read"),
    ("quantwm/core/psac.py:holds", "tolist"):
        (1, "whether the stored PSAC basis still holds: the block's small projection, to the host"),
    ("quantwm/core/methods/allocator.py:QuantWMAlloc.key_plan", "tolist"):
        (1, "the loud-token count and whether the stored basis holds, in one read"),
    ("quantwm/core/methods/allocator.py:QuantWMAlloc.in_query_basis", "__int__"):
        (1, "a new basis priced: which candidate won"),
    ("quantwm/core/layouts/channels.py:Channels.max_bits", "__int__"):
        (1, "the widest channel, which the e4m3 path's rule reads (at commit)"),
    ("quantwm/core/kmeans.py:init_centroids", "to (upload)"):
        (8, "k-means' first centroids drawn on the host (the same draw on every device): one copy a stage"),
    ("quantwm/core/trellis.py:_width_groups", "tolist"):
        (2, "quantwm-trellis: the channels of each width, one read for Keys and Values each (a PyTorch encoder)"),
    ("quantwm/core/allocate.py:allocate_levels_ref", "__bool__"):
        (None, "the reference's greedy fill, once a step (on a GPU kernels/allocate_levels.py reads nothing)"),
    # the first quantized span only: a budget's candidates measured on it, oscar's rotation fitted, and a span whose
    # deferred checks failed (a scale dtype to widen), quantized again with immediate checks
    ("quantwm/core/quant.py:check_finite", "__bool__"): (0, "values finite, read at once"),
    ("quantwm/core/cache.py:KVCache._read_checks", "__bool__"): (0, "which inputs failed, after a failed span check"),
    ("quantwm/core/quant.py:storage_dtype", "__bool__"): (0, "a scale dtype that holds the scales, read at once"),
    ("quantwm/core/layouts/channels.py:_buffer_size", "__bool__"): (0, "the code buffer holds the widths, at once"),
    ("quantwm/core/methods/oscar.py:oscar_rotation", "cpu"): (0, "oscar's rotation, fitted on the host (eigh)"),
    ("quantwm/core/methods/oscar.py:OSCAR.rotation", "to (upload)"): (0, "... and copied to the device"),
    # the adapters and rollouts: outputs asked for on the host, inputs drawn there on purpose, constants read once
    ("quantwm/adapters/diffusers_wan.py:wan_frame_shift", "__float__"): (0, "the model's RoPE θ, once per cache"),
    ("quantwm/adapters/self_forcing.py:_rollout", "cpu"): (0, "each chunk's latents and the frames, to the host"),
    ("quantwm/adapters/self_forcing.py:_rollout", "to (upload)"): (0, "the noise, drawn on the host"),
    ("quantwm/adapters/self_forcing.py:ProbeCapture.record", "cpu"): (0, "the probes' top-1 keys, to the host"),
    ("quantwm/adapters/self_forcing.py:record_self_forcing", "cpu"): (0, "the run file's query statistics"),
    ("quantwm/adapters/sglang_cache.py:QuantWMCausalKVCache._gather", "to (upload)"):
        (0, "SGLang's window keeps positions on the host: the view's indices, each call"),
    ("quantwm/world/generate.py:rollout", "to (upload)"): (0, "each chunk's noise and ground truth, from the host"),
    ("quantwm/world/generate.py:rollout", "cpu"): (0, "each chunk's frames, returned on the host"),
    ("quantwm/world/generate.py:ProbingCache._record", "to (upload)"):
        (0, "the probe's same-place mask, from host positions (diagnostics)"),
}
# syncs made once per process, wherever the first use falls (a warm attend may make them)
ONCE = {("quantwm/core/tables.py:on_device", "to (upload)"): "a constant table copied to a device, at its first use"}



REAL = torch.cuda.is_available()  # a GPU: the same tier on real CUDA tensors (benchmarks/gpu_check.py runs it)
fake_only = pytest.mark.skipif(REAL, reason="checks the fake device itself")


@pytest.fixture
def gpu(monkeypatch):
    monkeypatch.setenv("QUANTWM_KERNELS", "ref")  # the references: the tier checks devices and host reads
    with (RealCuda() if REAL else FakeCuda()) as mode:
        yield mode


def _qkv(n: int = N):
    return tuple(torch.randn(B, H, n, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))


def _config(method: str, target: str, budget: bool, **kw) -> CacheConfig:
    if budget:
        kw["budget"] = BUDGETS.get(method, 2.5)
    if get_method(method).pre_rope:
        kw["rope"] = "pre"
    return CacheConfig(method, target=target, **kw)  # check_inputs=True: on a device, a flag read at commit


def _rope():
    from quantwm.core.rope import Rope3D

    return Rope3D(D, (8, 8))


def _quantized(cache: KVCache, layer: int = 0) -> int:
    return sum(s.quantized for s in cache.inspect(layer))


@dataclass
class Reads:
    """The host syncs of a drive: each warm attend's (over quantized spans) and each quantizing commit's."""

    warm: list[Counter] = field(default_factory=list)
    commits: list[Counter] = field(default_factory=list)


def drive(cache: KVCache, gpu: FakeCuda, chunks: int = 5, n: int = N, qkv=None) -> Reads:
    """Per chunk a denoising attend, then (but the last) the clean attend that commits it: chunk c's commit quantizes
    chunk c-1 past the sink, so 5 chunks quantize two spans and attend over them warm. `qkv(c)`: a chunk's
    (q, k, v) (default: random bf16 on the device)."""
    reads = Reads()
    for c in range(chunks):
        q, k, v = _qkv(n) if qkv is None else qkv(c)
        before, held = gpu.syncs.copy(), _quantized(cache)
        out = cache.attend(0, q, k, v, chunk=c)
        if held:
            reads.warm.append(gpu.syncs - before)
        assert out.is_cuda and out.dtype == q.dtype
        if c < chunks - 1:
            before = gpu.syncs.copy()
            cache.attend(0, q, k, v, chunk=c, commit=True)
            if _quantized(cache) > held:
                reads.commits.append(gpu.syncs - before)
    return reads


def _ours(syncs: Counter) -> Counter:
    """The syncs made in quantwm (a model's own, diffusers' or transformers', are theirs)."""
    return Counter({site: n for site, n in syncs.items() if site[0].startswith("quantwm/")})


def check_named(gpu: FakeCuda) -> None:
    unnamed = {site: n for site, n in _ours(gpu.syncs).items() if site not in SYNCS and site not in ONCE}
    assert not unnamed, f"host syncs at sites not named in SYNCS: {unnamed}"


def check_warm(warm: list[Counter], allowed=()) -> None:
    made = [{site: n for site, n in w.items() if site not in ONCE and site not in allowed} for w in warm]
    assert warm and not any(made), f"a warm attend waited on the device: {made}"


def check_syncs(gpu: FakeCuda, reads: Reads) -> None:
    """No warm attend syncs; every sync is at a site of SYNCS, and after the first quantized span a commit makes no
    more there than SYNCS allows."""
    check_warm(reads.warm)
    check_named(gpu)
    for commit in reads.commits[1:]:
        over = {site: n for site, n in commit.items() if SYNCS.get(site, (None,))[0] is not None and n > SYNCS[site][0]}
        assert not over, f"a commit synced more often than SYNCS allows: {over}"


def _tensors(obj, seen: set):
    """Every tensor reachable from obj through quantwm objects' attributes and containers."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict | list | tuple):
        for v in obj.values() if isinstance(obj, dict) else obj:
            yield from _tensors(v, seen)
    elif type(obj).__module__.startswith("quantwm") and hasattr(obj, "__dict__"):
        for v in vars(obj).values():
            yield from _tensors(v, seen)


def check_on_device(cache: KVCache) -> None:
    """Every tensor a layer's spans store (full chunks, layouts, their kernel views) is on the device."""
    for layer in range(cache.n_layers):
        held = [t for c in cache.spans(layer) for t in _tensors(c, set())]
        off = [tuple(t.shape) for t in held if not t.is_cuda]
        assert held and not off, f"layer {layer} stores tensors off the device: {off}"


# ---- the helper ------------------------------------------------------------------------------------------------

@fake_only
def test_fake_cuda_raises_where_a_cpu_tensor_meets_a_device_tensor(gpu):
    x = torch.randn(4, D, device="cuda")
    assert isinstance(x, FakeCudaTensor) and x.is_cuda and x.device == torch.device("cuda", 0)
    with pytest.raises(FakeTensorDeviceMismatchError):
        x + torch.ones(D)
    with pytest.raises(FakeTensorDeviceMismatchError):
        torch.randn(4, device="cuda", generator=torch.Generator().manual_seed(0))
    with pytest.raises(TypeError, match="numpy"):
        x.numpy()
    assert (x * torch.tensor(2.0)).is_cuda  # a 0-dim CPU tensor is a scalar to a CUDA kernel
    assert x[torch.tensor([0, 2])].is_cuda
    assert gpu.syncs == {("<outside quantwm>", "__getitem__ (upload)"): 1}  # the CPU indices, copied over
    linear = torch.nn.Linear(D, 3).to("cuda")  # nn.Module.to makes device Parameters
    assert isinstance(linear.weight, torch.nn.Parameter) and linear(x).is_cuda


def test_real_cuda_counts_host_reads_by_site_with_the_fake_rule():
    """RealCuda, the tier's counter on a machine with a GPU, watched here on the CPU device: the same calls count."""
    from quantwm.core.quant import check_finite

    with RealCuda("cpu") as real:
        x = torch.arange(6.0)
        assert float(x[2]) == 2.0 and x[x > 3].tolist() == [4.0, 5.0]
        check_finite(x)
        (x * 2).sum(), x[torch.tensor([0, 2])], x.to(torch.float64)  # device work and indexing: nothing read
    assert real.syncs == {("<outside quantwm>", "__float__"): 1, ("<outside quantwm>", "__getitem__"): 1,
                          ("<outside quantwm>", "tolist"): 1, ("quantwm/core/quant.py:check_finite", "__bool__"): 1}


@fake_only
def test_fake_cuda_counts_host_syncs_by_site_and_keeps_their_values(gpu):
    from quantwm.core.quant import check_finite

    x = torch.arange(6.0, device="cuda")
    assert float(x[2]) == 2.0 and x[x > 3].tolist() == [4.0, 5.0]
    check_finite(x)
    y = torch.arange(3).to(x.device)
    assert isinstance(y, FakeCudaTensor) and y.tolist() == [0, 1, 2]
    assert gpu.syncs == {("<outside quantwm>", "__float__"): 1, ("<outside quantwm>", "__getitem__"): 1,
                         ("<outside quantwm>", "tolist"): 2, ("<outside quantwm>", "to (upload)"): 1,
                         ("quantwm/core/quant.py:check_finite", "__bool__"): 1}


# ---- the cache, every method ------------------------------------------------------------------------------------

def _matrix():
    for method in METHODS:
        for target in ("k", "v", "kv"):
            for budget in (False, True):
                marks = []
                yield pytest.param(method, target, budget, marks=marks,
                                   id=f"{method}-{target}-" + (f"budget{BUDGETS.get(method, 2.5)}" if budget else "2bit"))


@pytest.mark.parametrize("method,target,budget", _matrix())
def test_cache_runs_on_cuda(gpu, method, target, budget):
    cache = KVCache(_config(method, target, budget), 1, rope=_rope() if get_method(method).pre_rope else None)
    reads = drive(cache, gpu, n=TOKENS.get(method, N))
    assert len(reads.commits) == (0 if method == "bf16" else 2)
    check_on_device(cache)
    if method == "bf16":  # nothing quantized: each commit reads the attends' NaN/Inf flags, once
        assert set(_ours(gpu.syncs)) <= {COMMIT_READ} and gpu.syncs[COMMIT_READ] <= cache.next_chunk(0)
    else:
        check_syncs(gpu, reads)
    assert cache.keys(0).is_cuda and cache.values(0).is_cuda and cache.memory().stored_bytes > 0  # reports read


# ---- the cache's other paths ------------------------------------------------------------------------------------

@pytest.mark.parametrize("method,budget", [("rtn", False), ("quantwm", True), ("quantwm-psac", False)],
                         ids=["rtn-2bit", "quantwm-budget2.5", "quantwm-psac-2bit"])
def test_pre_rope_cache_rotates_keys_on_the_device(gpu, method, budget):
    cache = KVCache(_config(method, "kv", budget, rope="pre"), 1, rope=_rope())
    reads = drive(cache, gpu)
    check_on_device(cache)
    assert cache.keys(0).is_cuda and cache.positions(0).shape == (5 * N,)
    check_syncs(gpu, reads)


def test_loud_tokens_are_split_and_read_on_the_device(gpu):
    from quantwm.core.layouts import TokenSplit

    def loud(c):
        q, k, v = _qkv()
        k[:, :, 5] *= 40  # one loud token a chunk (at most 2% of a span is held: one of 64)
        return q, k, v

    cache = KVCache(_config("quantwm-alloc", "kv", True), 1)
    reads = drive(cache, gpu, qkv=loud)
    split = [s for s in cache.spans(0) if isinstance(s.k_enc, TokenSplit)]
    assert len(split) == 2 and isinstance(split[0].v_enc, TokenSplit) and split[0].k_enc.index.is_cuda
    check_syncs(gpu, reads)
    check_on_device(cache)


@pytest.mark.parametrize("method", ["rtn", "quantwm", "qvg"])
def test_a_rolling_window_evicts_on_the_device(gpu, method):
    cache = KVCache(_config(method, "kv", method == "quantwm", max_chunks=3), 1)
    reads = drive(cache, gpu, chunks=6)
    assert [s.index for s in cache.inspect(0)] == [0, 3, 4, 5]  # the sink, two committed, the current chunk
    check_syncs(gpu, reads)
    cache.evict_span(0, 3)
    check_on_device(cache)


def test_query_statistics_are_re_aimed_on_the_device(gpu):
    from quantwm.core.rope import FrameShift

    cache = KVCache(_config("quantwm", "kv", True), 1, frame_shift=FrameShift(D, N // 2))  # 2 frames a chunk
    reads = drive(cache, gpu)
    check_syncs(gpu, reads)
    check_on_device(cache)
    assert cache.query_stats(0).is_cuda


def _fused():
    for method in METHODS:
        if not get_method(method).pre_rope:  # the fused path reads post-RoPE keys
            yield pytest.param(method, False, "int8", (9, 0), id=f"{method}-2bit-int8")
    for method, budget in (("quantwm", True), ("quantwm-alloc", True), ("rtn", False)):
        for lowp in ("int8", "e4m3") if budget else ("e4m3",):
            yield pytest.param(method, budget, lowp, (9, 0), id=f"{method}-{'budget2.5' if budget else '2bit'}-{lowp}")
    yield pytest.param("qvg", False, "int8", (8, 0), id="qvg-2bit-int8-sm80")  # its fp8 scales widened to fp16



@pytest.mark.parametrize("method,budget,lowp,capability", _fused())
def test_fused_path_reads_spans_on_the_device(monkeypatch, method, budget, lowp, capability):
    """lowp runs quantwm/core/attention.py's fused fold (span_attention_ref in the kernel's place) over the kernel
    views each layout builds at commit; a GPU below compute capability 8.9 gets fp8 sides widened to fp16."""
    monkeypatch.setenv("QUANTWM_KERNELS", "ref")
    with (RealCuda() if REAL else FakeCuda(capability)) as gpu:
        cache = KVCache(_config(method, "kv", budget, lowp=lowp), 1)
        reads = drive(cache, gpu)
    check_on_device(cache)
    if method == "bf16":  # nothing quantized: each commit reads the attends' NaN/Inf flags, once
        assert set(_ours(gpu.syncs)) <= {COMMIT_READ} and gpu.syncs[COMMIT_READ] <= cache.next_chunk(0)
    else:
        check_syncs(gpu, reads)


# ---- the adapters and the built-in world model ------------------------------------------------------------------

@pytest.fixture(scope="module")
def wan_models():
    pytest.importorskip("diffusers")
    from tiny_wan import tiny_wan

    return tiny_wan(latents_mean=0.1, latents_std=1.5)


@pytest.mark.parametrize("rope", ["post", "pre"])
def test_wan_adapter_generates_on_the_device(gpu, wan_models, rope):
    from quantwm.adapters.diffusers_wan import WanCacheAdapter, wan_kv_cache

    model = wan_models[0].to("cuda")
    cache = wan_kv_cache(model, _config("quantwm", "kv", True, rope=rope), (4, 8))  # latents 8x16, 2x2 patches
    text = torch.randn(1, 8, 16, device="cuda")
    warm = []
    with torch.no_grad(), WanCacheAdapter(model, cache) as wan:
        for i in range(5):
            x = torch.randn(1, 4, 2, 8, 16, device="cuda")  # a chunk: 2 latent frames of 4x8 tokens
            before, held = gpu.syncs.copy(), _quantized(cache)
            with wan.chunk(i):
                out = model(x, torch.full((1,), 500.0, device="cuda"), text).sample
            if held:
                warm.append(_ours(gpu.syncs - before))
            with wan.chunk(i, commit=True):
                model(x, torch.zeros(1, device="cuda"), text)
    assert out.is_cuda and len(warm) == 2
    check_on_device(cache)
    check_warm(warm)
    check_named(gpu)


def test_self_forcing_records_on_the_device(gpu, wan_models, monkeypatch):
    from quantwm.adapters.self_forcing import record_self_forcing

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the recorder refuses --device cuda without one
    model, vae = (m.to("cuda") for m in wan_models)
    run = record_self_forcing(None, None, torch.randn(1, 8, 16, device="cuda"), method="quantwm", latent_frames=4,
                              chunk_frames=1, height=32, width=64, device="cuda", models=(model, vae))
    assert run.meta["method"] == "quantwm" and not run.stats.is_cuda and run.method.shape == run.bf16.shape
    check_named(gpu)


def test_sana_wm_adapter_refines_on_the_device(gpu):
    pytest.importorskip("diffusers")
    from tiny_sana import tiny_sana_refiner

    from quantwm.adapters.sana_wm import SanaWMCacheAdapter, sana_wm_kv_cache

    pipe = tiny_sana_refiner().to("cuda")
    pipe.set_progress_bar_config(disable=True)
    cache = sana_wm_kv_cache(pipe.transformer, _config("quantwm", "kv", True, sink_chunks=0))
    stage1 = torch.randn(1, 8, 13, 4, 4, device="cuda")  # 1 sink frame and 4 blocks of 3
    with SanaWMCacheAdapter(pipe.transformer, cache):
        out = pipe(stage1, "a cat walks on the beach at dusk", fps=8.0, generator=torch.Generator().manual_seed(1),
                   kv_max_frames=5, output_type="latent")
    assert out.is_cuda and _quantized(cache) == 1
    check_on_device(cache)
    check_named(gpu)


def test_sglang_caches_serve_the_contract_on_the_device(gpu):
    from quantwm.adapters.sglang_plugin import PluginConfig, make_caches

    caches = make_caches(PluginConfig(method="quantwm"), 2, batch_size=1, kv_cache_size=4 * N, num_attention_heads=H,
                         attention_head_dim=D, dtype=torch.bfloat16, device="cuda", sink_tokens=N)
    warm = []
    for c in range(6):
        for p in range(2):  # the first write at a new start commits the chunk before it; the second overwrites
            q, k, v = (x.transpose(1, 2) for x in _qkv())  # (B, N, H, D)
            for cache in caches:
                before, held = gpu.syncs.copy(), _quantized(cache.store)
                cache.stash_queries(q)
                view = cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=c * N)
                if held and p:
                    warm.append(gpu.syncs - before)
    assert view.k.is_cuda and [s.index for s in caches[0].store.inspect(0)] == [0, 3, 4, 5]  # sink, 3 in the window
    assert _quantized(caches[0].store) == 1
    check_on_device(caches[0].store)
    check_warm(warm, allowed={("quantwm/adapters/sglang_cache.py:QuantWMCausalKVCache._gather", "to (upload)")})
    check_named(gpu)


def test_world_model_rolls_out_on_the_device(gpu):
    from tiny_world import tiny_world_model

    from quantwm.world.generate import generate

    run = generate(tiny_world_model().to("cuda"), 0, n_frames=10, steps=2, cache_config=_config("quantwm", "kv", True))
    assert not run.frames.is_cuda and _quantized(run.cache) == 3  # 5 chunks, the first the context
    check_on_device(run.cache)
    check_named(gpu)


# ---- the tier catches what it was built for ---------------------------------------------------------------------

def _gaussian_price_with_host_constants(weights, variances, tokens, bits):
    """query_basis.gaussian_price before 007d8f1: its rate and lower bound made by torch.full on the host, beside
    variances on the device (and a bisection of 80 steps)."""
    S, D = variances.shape
    sigma2 = (weights.double() * variances.double()).clamp_min(1e-300)
    rate = torch.full((S,), max(bits, 0.0) / tokens, dtype=torch.float64)  # no device=: the host
    lo = torch.full((S,), 1e-300, dtype=torch.float64).log()
    hi = sigma2.amax(-1).log()
    for _ in range(80):
        mid = (lo + hi) / 2
        spent = (0.5 * (sigma2.log() - mid[:, None]).clamp_min(0) / math.log(2)).sum(-1)
        lo, hi = torch.where(spent > rate, mid, lo), torch.where(spent > rate, hi, mid)
    return tokens * torch.minimum(sigma2, hi.exp()[:, None]).sum()


def test_the_tier_fails_on_a_host_constant_in_the_allocators_pricing(gpu, monkeypatch):
    import quantwm.core.methods.allocator as allocator

    monkeypatch.setattr(allocator, "gaussian_price", _gaussian_price_with_host_constants)
    cache = KVCache(_config("quantwm", "kv", True), 1)
    with pytest.raises(RuntimeError, match="device") as raised:  # FakeTensorDeviceMismatchError, or CUDA's own
        drive(cache, gpu)
    assert any(entry.name == "_gaussian_price_with_host_constants" for entry in raised.traceback)
    assert REAL or raised.traceback[-1].name == "_check_devices"


# ---- constructors name their device -----------------------------------------------------------------------------

CONSTRUCTORS = frozenset({"zeros", "ones", "empty", "full", "arange", "eye", "tensor", "as_tensor", "randn", "rand",
                          "randint", "randperm", "linspace", "logspace", "empty_strided", "normal"})
# (file, function, constructor) -> why it builds on the host without naming it; "to fix" where it should not
HOST_CONSTRUCTORS: dict = {}  # none left: every constructor in quantwm/core names its device


def _calls(node: ast.AST, scope: tuple[str, ...] = ()):
    """(call, the names of the functions and classes around it) of every call under node."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Call):
            yield child, scope
        named = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        yield from _calls(child, (*scope, child.name) if named else scope)


def host_constructors(root: Path) -> dict[tuple[str, str, str], int]:
    """(file, enclosing function, constructor) -> line of every torch.<constructor>(...) under quantwm/core without a
    device= keyword (`*_like` and `x.new_*` forms follow their tensor and are not listed)."""
    found = {}
    for path in sorted((root / "quantwm" / "core").rglob("*.py")):
        for call, scope in _calls(ast.parse(path.read_text())):
            f = call.func
            if (isinstance(f, ast.Attribute) and f.attr in CONSTRUCTORS and isinstance(f.value, ast.Name)
                    and f.value.id == "torch" and not any(k.arg in ("device", None) for k in call.keywords)):
                found[(path.relative_to(root).as_posix(), ".".join(scope) or "<module>", f.attr)] = call.lineno
    return found


def test_core_constructors_name_their_device():
    found = host_constructors(Path(__file__).resolve().parents[1])
    unnamed = {f"{k[0]}:{line} {k[1]}: torch.{k[2]}": line for k, line in found.items() if k not in HOST_CONSTRUCTORS}
    assert not unnamed, f"constructors without device= (name it, or list it in HOST_CONSTRUCTORS): {sorted(unnamed)}"
    stale = sorted(set(HOST_CONSTRUCTORS) - set(found))
    assert not stale, f"these name their device now: drop them from HOST_CONSTRUCTORS: {stale}"
