"""QuantWM as an SGLang diffusion plugin: causal denoising stages get a QuantWM KV cache, no fork needed.

SGLang (0.5.23) runs every callable in the entry-point group `sglang.multimodal_gen.plugins` in every worker;
quantwm registers `register` there (pyproject.toml). The plugin is off unless configured:

    QUANTWM_KV_METHOD=quantwm          # any quantwm method name (`quantwm methods`); unset: plugin inactive
    QUANTWM_KV_BITS=2                  # or QUANTWM_KV_K_BITS / QUANTWM_KV_V_BITS
    QUANTWM_KV_TARGET=kv               # k | v | kv
    QUANTWM_KV_SINK_CHUNKS=1           # chunks kept full precision at the start ...
    QUANTWM_KV_RECENT_CHUNKS=1         # ... and at the end of history
    QUANTWM_KV_QUERY_STATS=FILE        # optional calibration: safetensors with L{block}.S (H, D, D)
    QUANTWM_KV_CONFIG=FILE.json        # the same keys in a file ({"method": ..., "bits": ...}); env wins

Hooks (AROUND, through SGLang's HookRegistry):
* `_allocate_causal_kv_cache` of the covered stages (`COVERED_STAGES`) returns one `QuantWMCausalKVCache`
  per transformer block instead of SGLang's dense cache. Stages not covered keep their own caches.
* The causal self-attention forwards (`QUERY_HOOKS`) rotate the queries as the model does and hand them to
  the cache (`stash_queries`): the contract passes no queries, and QSAC/PSAC need them. On a single-device
  pass the hook also intercepts the forward's `self.attn(q, view.k, view.v)` so that, with the kernels on
  (CUDA), attention runs fused over the stored spans instead of over a decoded view.

A bad setting stops the worker with one line naming it (SGLang would otherwise log the error and serve the
dense cache while the user believes the cache is quantized).
"""
from __future__ import annotations

import inspect
import json
import logging
import os
from dataclasses import dataclass, fields

import torch

from ..core.backend import use_kernels
from ..core.cache import CacheConfig
from ..core.methods import get_method
from .sglang_cache import QuantWMCausalKVCache

log = logging.getLogger("quantwm.sglang")

_STAGES = "sglang.multimodal_gen.runtime.pipelines_core.stages"
COVERED_STAGES = {  # stage class -> where it defines (or inherits) _allocate_causal_kv_cache
    "CausalDMDDenoisingStage": f"{_STAGES}.causal_denoising.CausalDMDDenoisingStage",
    "LingBotWorldCausalDMDDenoisingStage":
        f"{_STAGES}.model_specific_stages.lingbot_world.lingbot_world_causal_denoising."
        "LingBotWorldCausalDMDDenoisingStage",
    "LongLive2CausalDenoisingStage": None,  # inherits CausalDMDDenoisingStage's allocation
}
ALLOCATION_HOOKS = [f"{path}._allocate_causal_kv_cache" for path in COVERED_STAGES.values() if path]
_DITS = "sglang.multimodal_gen.runtime.models.dits"
QUERY_HOOKS = [f"{_DITS}.lingbot_world.LingBotWorldCausalSelfAttention.forward",
               f"{_DITS}.causal_wanvideo.CausalWanSelfAttention.forward"]
ENV_PREFIX = "QUANTWM_KV_"


@dataclass(frozen=True)
class PluginConfig:
    """What the plugin runs; validated like every quantwm config (a bad value names the allowed ones)."""

    method: str = "quantwm"
    k_bits: int = 2
    v_bits: int = 2
    target: str = "kv"
    sink_chunks: int = 1
    recent_chunks: int = 1
    query_stats: str | None = None

    def __post_init__(self):
        config = self.cache_config()  # every check CacheConfig makes (method, bits, target, chunk counts)
        if get_method(self.method).pre_rope:
            raise ValueError(f"{self.method} quantizes keys before RoPE; SGLang's contract hands the cache post-RoPE "
                             "keys (choose a post-RoPE method)")
        if config.jensen:
            raise ValueError(f"{self.method} adds a logit bias that SGLang's attention backends do not apply; use "
                             f"{self.method.removesuffix('+jensen')}")
        if self.query_stats is not None and not os.path.isfile(self.query_stats):
            raise ValueError(f"query_stats file not found: {self.query_stats}")

    def cache_config(self) -> CacheConfig:
        return CacheConfig(method=self.method, target=self.target, k_bits=self.k_bits, v_bits=self.v_bits,
                           sink_chunks=self.sink_chunks, recent_chunks=self.recent_chunks, layout="BLHD")

    @property
    def needs_queries(self) -> bool:
        """Whether the method reads history-query statistics (QSAC / PSAC)."""
        return get_method(self.method).uses_queries

    def describe(self) -> str:
        return (f"{self.method} K{self.k_bits}/V{self.v_bits} bits on {self.target}, sink {self.sink_chunks} and "
                f"recent {self.recent_chunks} chunks full precision")


_INT_KEYS = {"bits", "k_bits", "v_bits", "sink_chunks", "recent_chunks"}


def _integer(key: str, value) -> int:
    if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, str) and value.strip().lstrip(
            "-").isdigit())):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    return int(value)


def read_config(environ: dict | None = None) -> PluginConfig | None:
    """The plugin's configuration from QUANTWM_KV_CONFIG (a JSON file) and QUANTWM_KV_* variables, env winning;
    None when neither names a method (the plugin stays inactive)."""
    environ = os.environ if environ is None else environ
    known = {f.name for f in fields(PluginConfig)} | {"bits"}
    values: dict = {}
    path = environ.get(ENV_PREFIX + "CONFIG")
    if path:
        try:
            with open(path) as f:
                values = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{ENV_PREFIX}CONFIG={path}: cannot read it as JSON ({e})") from e
        if not isinstance(values, dict):
            raise ValueError(f"{ENV_PREFIX}CONFIG={path}: expected a JSON object")
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{ENV_PREFIX}CONFIG={path}: unknown keys {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(known))}")
    for key in known:
        if ENV_PREFIX + key.upper() in environ:
            values[key] = environ[ENV_PREFIX + key.upper()]
    unknown_env = sorted(k for k in environ if k.startswith(ENV_PREFIX) and k[len(ENV_PREFIX):].lower()
                         not in known | {"config"})
    if unknown_env:
        raise ValueError(f"unknown setting {', '.join(unknown_env)}; known: "
                         f"{', '.join(ENV_PREFIX + k.upper() for k in sorted(known | {'config'}))}")
    if "method" not in values:
        return None
    for key in _INT_KEYS & set(values):
        values[key] = _integer(key, values[key])
    bits = values.pop("bits", None)
    if bits is not None:
        values.setdefault("k_bits", bits)
        values.setdefault("v_bits", bits)
    return PluginConfig(**values)


def load_query_stats(path: str) -> dict[int, torch.Tensor]:
    """Calibration S per transformer block from a safetensors file holding `L{block}.S` (H, D, D)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(path)
    except (OSError, SafetensorError) as e:
        raise ValueError(f"query_stats {path}: not a readable safetensors file ({e})") from e
    out = {}
    for name, t in tensors.items():
        layer = name[1:-2] if name.startswith("L") and name.endswith(".S") else ""
        if not layer.isdigit() or t.dim() != 3 or t.shape[1] != t.shape[2] or not torch.isfinite(t).all():
            raise ValueError(f"query_stats {path}: {name} {tuple(t.shape)} is not a finite L{{block}}.S (H, D, D)")
        out[int(layer)] = t.double()
    if not out:
        raise ValueError(f"query_stats {path}: no L{{block}}.S tensors")
    return out


def save_query_stats(trace_path: str, out: str) -> dict[int, tuple[int, ...]]:
    """Write the calibration file from a trace: per layer, S = E[q qᵀ] of its earlier queries (`q_hist`, else
    the traced queries), post-RoPE as the trace stores them. Returns {layer: shape of S}."""
    from safetensors.torch import save_file

    from ..evaluation.metrics import second_moment
    from ..evaluation.trace import read_trace

    trace = read_trace(trace_path)
    stats = {f"L{layer}.S": second_moment(t.get("q_hist", t["q"]).float()).contiguous()
             for layer, t in trace.layers.items()}
    save_file(stats, out, metadata={"quantwm_query_stats_version": "1", "trace": os.path.basename(trace_path)})
    return {int(name[1:-2]): tuple(t.shape) for name, t in stats.items()}


# ---- the hooks ----------------------------------------------------------------------------------------------
_state: dict = {"config": None, "stats": None, "warned": set()}


def _once(key: str, message: str, level: int = logging.WARNING) -> None:
    if key not in _state["warned"]:
        _state["warned"].add(key)
        log.log(level, message)


def make_caches(config: PluginConfig, n_blocks: int, *, batch_size: int, kv_cache_size: int,
                num_attention_heads: int, attention_head_dim: int, dtype, device, use_int_indices: bool = False,
                sink_tokens: int = 0, global_sink_tokens: int = 0, attention_window_size: int | None = None,
                allow_growth: bool = False, query_stats: dict | None = None,
                head_offset: int = 0) -> list[QuantWMCausalKVCache]:
    """One QuantWM cache per transformer block, with the arguments SGLang gives its dense cache."""
    stats = query_stats or {}
    if stats:
        bad = [b for b in range(n_blocks) if b not in stats or stats[b].shape[-1] != attention_head_dim]
        if bad:
            raise ValueError(f"the query statistics file lacks block {bad[0]} or has another head dim than "
                             f"{attention_head_dim} (it needs L0.S .. L{n_blocks - 1}.S)")
    return [QuantWMCausalKVCache(
        config=config.cache_config(), batch_size=batch_size, cache_size=kv_cache_size,
        num_heads=num_attention_heads, head_dim=attention_head_dim, dtype=dtype, device=device,
        use_int_indices=use_int_indices, sink_tokens=sink_tokens, global_sink_tokens=global_sink_tokens,
        attention_window_size=attention_window_size, allow_growth=allow_growth, layer=block,
        query_stats=stats.get(block), head_offset=head_offset) for block in range(n_blocks)]


def allocation_hook(original, stage, *args, **kwargs):
    """AROUND `_allocate_causal_kv_cache`: QuantWM caches for covered stages, the stage's own otherwise."""
    config = _state["config"]
    name = type(stage).__name__
    if config is None or name not in COVERED_STAGES:
        if config is not None:
            _once(name, f"quantwm: {name} is not a covered stage; it keeps its own KV cache")
        return original(stage, *args, **kwargs)
    quant = getattr(stage, "_kv_quant_args", None)
    if quant is not None and getattr(quant, "enabled", False):
        raise ValueError("both --kv-cache-quant (QVG) and QUANTWM_KV_METHOD are set: choose one KV cache")
    if args:
        raise TypeError("_allocate_causal_kv_cache takes keyword arguments only")
    if config.needs_queries and _state["stats"] is None and not all(_query_hook_applied(t) for t in QUERY_HOOKS):
        _once("queries", f"quantwm: {config.method} needs history queries, but the attention hook is not "
                              f"applied and no {ENV_PREFIX}QUERY_STATS file is given: S stays the identity")
    caches = make_caches(config, stage.num_transformer_blocks, query_stats=_state["stats"],
                         head_offset=_head_offset(stage, kwargs["num_attention_heads"]), **kwargs)
    _once("allocated", f"quantwm: {name} uses the QuantWM KV cache ({config.describe()})", logging.INFO)
    return caches


def _head_offset(stage, cache_heads: int) -> int:
    """The first model head a rank's cache holds: Ulysses gives each rank num_heads / n of them."""
    total = getattr(getattr(stage, "transformer", None), "num_attention_heads", None)
    if not isinstance(total, int) or cache_heads >= total:
        return 0
    from sglang.multimodal_gen.runtime.distributed.parallel_state import get_ulysses_parallel_rank

    return get_ulysses_parallel_rank() * cache_heads


def _query_hook_applied(target: str) -> bool:
    import pkgutil

    try:
        fn = pkgutil.resolve_name(target)
    except (ImportError, AttributeError):
        return False
    return any(getattr(c, "cell_contents", None) is query_hook for c in (getattr(fn, "__closure__", None) or ()))


def _sequence_sharded(globals_: dict) -> bool:
    """Whether this pass shards the sequence (Ulysses and friends): then the forward attends with other layers."""
    world = globals_.get("get_ulysses_parallel_world_size")
    context = globals_.get("get_forward_context")
    if world is None or context is None:
        return False
    batch = getattr(context(), "forward_batch", None)
    return bool(batch is not None and getattr(batch, "enable_sequence_shard", False) and world() > 1)


class _FusedAttention(torch.nn.Module):
    """Stands in for the forward's `self.attn` for one call: the cache's fused output for its placeholder view,
    the original attention for anything else (e.g. a pass that attends directly, without the cache)."""

    def __init__(self, inner, cache: QuantWMCausalKVCache):
        super().__init__()
        self.inner, self.cache = inner, cache

    def forward(self, q, k, v, *args, **kwargs):
        out = self.cache.fused_output(k)
        return self.inner(q, k, v, *args, **kwargs) if out is None else out


def query_hook(original, attn, *args, **kwargs):
    """AROUND a causal self-attention forward: the rotated queries go to a QuantWM cache before its write, and
    on a single-device pass its attention call may run fused."""
    bound = inspect.signature(original).bind(attn, *args, **kwargs)
    call = bound.arguments
    cache = call.get("kv_cache")
    if not isinstance(cache, QuantWMCausalKVCache) or call.get("update_cache_only", False):
        return original(attn, *args, **kwargs)
    inner = getattr(attn, "attn", None)
    fused = isinstance(inner, torch.nn.Module) and use_kernels(call["q"]) and \
        not _sequence_sharded(original.__globals__)
    if not (fused or cache.uses_queries):
        return original(attn, *args, **kwargs)  # rtn, kivi, qvg and bf16 need no queries
    rotate = original.__globals__.get("_apply_rotary_emb")  # the model module's own RoPE
    cos, sin = call["freqs_cis"][:2]
    q = call["q"]
    cache.stash_queries(rotate(q, cos, sin, is_neox_style=False).type_as(call["v"]))
    if fused:
        scale = getattr(inner, "softmax_scale", None) or q.shape[-1] ** -0.5
        cache.request_fused(scale)
        object.__setattr__(attn, "attn", _FusedAttention(inner, cache))  # an instance attribute, for this call
    try:
        return original(attn, *args, **kwargs)
    finally:
        cache.drop_stash()  # a direct-attention pass never reaches the cache
        if fused:
            del attn.__dict__["attn"]


def register(registry=None, around=None, environ: dict | None = None) -> bool:
    """The entry point SGLang calls in every worker: read the configuration and register the hooks.

    registry, around: SGLang's diffusion HookRegistry and HookType.AROUND (the defaults); tests pass the ones
    they load. Returns whether the plugin is active. A bad setting raises SystemExit with one line."""
    try:
        config = read_config(environ)
        stats = load_query_stats(config.query_stats) if config is not None and config.query_stats else None
    except ValueError as e:
        log.error("quantwm SGLang plugin: %s", e)
        raise SystemExit(f"quantwm SGLang plugin: {e}") from None
    if config is None:
        log.info("quantwm SGLang plugin inactive (set %sMETHOD to use the QuantWM KV cache)", ENV_PREFIX)
        return False
    if registry is None:
        from sglang.multimodal_gen.runtime.platforms.plugins import HookRegistry, HookType
        registry, around = HookRegistry, HookType.AROUND
    _state.update(config=config, stats=stats, warned=set())
    for target in ALLOCATION_HOOKS:
        registry.register(target, allocation_hook, around)
    for target in QUERY_HOOKS:
        registry.register(target, query_hook, around)
    source = f"{ENV_PREFIX}QUERY_STATS={config.query_stats}" if stats else "the attention hook"
    log.info("quantwm SGLang plugin: %s; queries from %s", config.describe(), source)
    return True
