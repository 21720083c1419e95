"""FastVideo as QuantWM drives it: the import check, one process as FastVideo's world of one, its checkpoint format,
and the CPU arrangements its CUDA-only code needs for the tiny checks.

* **Import.** `require()` imports FastVideo or raises one ValueError that says how to install it
  (`pip install 'quantwm[fastvideo]'`, docs/real-models.md) and, where FastVideo's own import failed on
  torchvision (the CPU build of torch 2.13 cannot load torchvision's compiled ops), says that.
* **Process group.** FastVideo's layers ask its parallel state for the sequence-parallel size; `init_single_process`
  starts a world of one (the usual MASTER_ADDR/PORT, RANK, WORLD_SIZE variables, set to a local default when absent).
* **Checkpoints.** A FastVideo transformer folder is diffusers' layout: `config.json` with `_class_name` and the
  architecture's fields, and `*.safetensors` in the checkpoint's parameter names, which FastVideo maps onto its own
  through the class's `param_names_mapping`. `save_transformer` writes that layout (names mapped back with the
  class's `reverse_param_names_mapping` where it has one); `load_transformer` loads through FastVideo's own
  `TransformerLoader`, so a real checkpoint and a tiny one take the same road.
* **CPU.** FastVideo's Wan-family code runs under `torch.amp.autocast("cuda", bf16)` with fp32 islands
  (`autocast("cuda", float32)`) and calls flash-attn directly in places. On a machine without CUDA `on_cpu` maps
  the model's CUDA autocast regions onto the CPU's (a float32 region runs with autocast off; parameters kept in
  float32, so every matmul still runs in bf16 under the outer region as it does on a GPU) and gives the named
  flash-attention functions an SDPA body. Both the FastVideo reference and QuantWM's path run inside the same
  arrangement; on a GPU nothing is patched.
"""
from __future__ import annotations

import importlib
import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

FASTVIDEO_VERSION = "0.2.1"  # the version these adapters were written and tested against
INSTALL_HINT = ("pip install 'quantwm[fastvideo]' (FastVideo " + FASTVIDEO_VERSION + ", installed with --no-deps as "
                "install.sh does; docs/real-models.md)")


def require():
    """The fastvideo package, or ValueError saying why it cannot be used."""
    try:
        return importlib.import_module("fastvideo")
    except ModuleNotFoundError as e:
        if e.name == "fastvideo":
            raise ValueError(f"FastVideo is not installed: {INSTALL_HINT}") from None
        if e.name and e.name.startswith("torchvision"):
            raise ValueError(f"FastVideo is installed but cannot import: {_TORCHVISION}") from None
        raise ValueError(f"FastVideo is installed but cannot import: it needs {e.name!r} ({INSTALL_HINT})") from None
    except (ImportError, RuntimeError) as e:
        msg = str(e).splitlines()[0][:160]
        raise ValueError(f"FastVideo cannot import here ({msg})" + (f". {_TORCHVISION}" if "torchvision" in msg
                                                                    else "")) from None


_TORCHVISION = ("it imports torchvision at the top of fastvideo/utils.py, and no torchvision that loads beside this "
                "torch is installed (install the one built for your torch; the CPU build of torch 2.13 has none: "
                "docs/real-models.md)")


def module(name: str):
    """A FastVideo module by dotted name (after `require`)."""
    require()
    return importlib.import_module(name)


def init_single_process() -> None:
    """FastVideo's distributed state as a world of one process (idempotent)."""
    parallel_state = module("fastvideo.distributed.parallel_state")
    if parallel_state.model_parallel_is_initialized():
        return
    if "MASTER_PORT" not in os.environ:  # a free port: two processes on one machine must not meet
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    if int(os.environ["WORLD_SIZE"]) != 1:
        raise ValueError(f"WORLD_SIZE={os.environ['WORLD_SIZE']}: the FastVideo adapters run one process "
                         "(sequence parallelism is not supported)")
    parallel_state.maybe_init_distributed_environment_and_model_parallel(1, 1)


SDPA_BACKEND = "fastvideo.attention.backends.sdpa.SDPABackend"


@contextmanager
def sdpa_backend_on_cpu() -> Iterator[None]:
    """FastVideo's CPU platform names no attention backend, so its `LocalAttention` layers cannot be built there
    (fastvideo/attention/selector.py: "Invalid attention backend for CPU"); while inside, the CPU platform answers
    with FastVideo's SDPA backend, as its MPS platform does. Nothing changes on a GPU."""
    platforms = module("fastvideo.platforms")
    cls = type(platforms.current_platform)
    if not platforms.current_platform.is_cpu():
        yield
        return
    saved = cls.__dict__.get("get_attn_backend_cls")
    cls.get_attn_backend_cls = classmethod(lambda c, selected, head_size, dtype: SDPA_BACKEND)
    try:
        yield
    finally:
        if saved is None:
            del cls.get_attn_backend_cls
        else:
            cls.get_attn_backend_cls = saved


class _CpuAutocast(torch.amp.autocast):
    """torch.amp.autocast with "cuda" read as "cpu": a bf16/fp16 region keeps its dtype, a float32 one turns autocast
    off (the CPU's autocast has no float32 mode)."""

    def __init__(self, device_type: str, dtype: torch.dtype | None = None, enabled: bool = True,
                 cache_enabled: bool | None = None):
        if device_type == "cuda":
            device_type = "cpu"
            if dtype == torch.float32:
                enabled, dtype = False, None
        super().__init__(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)


class _Fp32Linear(TorchFunctionMode):
    """On the CPU, a linear layer inside a float32 autocast region (`on_cpu` runs those with autocast off) gets its
    bf16 input, and a bias cast to it, in its weight's float32, as CUDA's float32 autocast would (e.g. LongCat's AdaLN
    modulation, fastvideo/models/dits/longcat.py:794)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and not torch.is_autocast_enabled("cpu") and args[0].dtype != args[1].dtype:
            w = args[1]
            args = tuple(a.to(w.dtype) if isinstance(a, torch.Tensor) else a for a in args)
            kwargs = {k: a.to(w.dtype) if isinstance(a, torch.Tensor) else a for k, a in kwargs.items()}
        return func(*args, **kwargs)


def sdpa_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args, softmax_scale=None,
                         causal: bool = False, dtype: torch.dtype = torch.bfloat16, **kwargs) -> torch.Tensor:
    """flash-attn's call (q, k, v as (B, L, H, D)) computed by SDPA in `dtype`, for CPU checks. Padding lengths
    (q_lens/k_lens) are refused: the tiny runs pass none."""
    if kwargs.get("q_lens") is not None or kwargs.get("k_lens") is not None:
        raise ValueError("the CPU stand-in for flash-attn takes no padding lengths")
    out = F.scaled_dot_product_attention(q.transpose(1, 2).to(dtype), k.transpose(1, 2).to(dtype),
                                         v.transpose(1, 2).to(dtype), is_causal=causal, scale=softmax_scale)
    return out.transpose(1, 2).contiguous()


@contextmanager
def on_cpu(model: torch.nn.Module, flash: tuple[tuple[str, str], ...] = ()) -> Iterator[None]:
    """The CPU arrangement for FastVideo's CUDA-only code (see the module docstring); nothing on a GPU.
    flash: (module, function) pairs whose flash-attn call gets an SDPA body while inside."""
    device = next(model.parameters()).device
    if device.type != "cpu":
        with torch.amp.autocast(device.type, dtype=torch.bfloat16):
            yield
        return
    if any(p.dtype != torch.float32 for p in model.parameters()):
        model.float()  # the CPU's layer norms and fp32 islands need fp32 parameters; matmuls still run in bf16
    saved = [(torch.amp, "autocast", torch.amp.autocast)]
    torch.amp.autocast = _CpuAutocast
    try:
        for mod_name, fn in flash:
            mod = importlib.import_module(mod_name)
            saved.append((mod, fn, getattr(mod, fn)))
            setattr(mod, fn, sdpa_flash_attention)
        with torch.autocast("cpu", dtype=torch.bfloat16), _Fp32Linear():
            yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def save_transformer(model: torch.nn.Module, folder: str | Path, class_name: str, arch: dict) -> Path:
    """`model` as a FastVideo transformer folder: config.json (`_class_name` and `arch`) and
    diffusion_pytorch_model.safetensors in the checkpoint's parameter names."""

    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    reverse = getattr(model, "reverse_param_names_mapping", None) or invert_mapping(
        getattr(model, "param_names_mapping", None) or {})  # classes without a reverse mapping: the forward turned around
    state = {}
    for name, t in model.state_dict().items():
        for pattern, target in reverse.items():
            if re.match(pattern, name):
                name = re.sub(pattern, target if isinstance(target, str) else target[0], name)
                break
        state[name] = t.detach().to("cpu").contiguous()
    save_file(state, str(folder / "diffusion_pytorch_model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"_class_name": class_name, **_jsonable(arch)}, indent=1))
    return folder


def invert_mapping(mapping: dict) -> dict:
    """FastVideo's checkpoint -> model name regexes turned around (model -> checkpoint), for the plain ones: a
    pattern `^a\\.(\\d+)\\.b\\.(.*)$` with target `a.\\1.c.\\2` gives `^a\\.(\\d+)\\.c\\.(.*)$` -> `a.\\1.b.\\2`."""
    out = {}
    for pattern, target in mapping.items():
        if not isinstance(target, str):
            continue
        groups = re.findall(r"\([^()]*\)", pattern)
        parts = re.split(r"\([^()]*\)", pattern.removeprefix("^").removesuffix("$"))
        pieces = re.split(r"\\(\d)", target)  # literal, group number, literal, ...
        order = [int(p) for p in pieces[1::2]]  # the inverse's groups, in the target's order
        if sorted(order) != list(range(1, len(groups) + 1)):
            continue
        regex = "".join(re.escape(p) if n % 2 == 0 else groups[int(p) - 1] for n, p in enumerate(pieces))
        back = "".join(p.replace("\\", "") + (f"\\{order.index(i + 1) + 1}" if i < len(groups) else "")
                       for i, p in enumerate(parts))
        out["^" + regex + "$"] = back
    return out


def _jsonable(arch: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in arch.items()}


def load_transformer(folder: str | Path, config_cls: type, class_name: str, device: str = "cpu",
                     precision: str = "bf16") -> torch.nn.Module:
    """A FastVideo transformer folder (or a model folder holding transformer/) loaded by FastVideo's own
    `TransformerLoader` onto `device`; ValueError naming what is wrong with the folder."""
    folder = Path(folder)
    if (folder / "transformer" / "config.json").is_file():
        folder = folder / "transformer"
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{folder}: not a FastVideo transformer folder (no config.json)")
    try:
        found = json.loads(cfg_file.read_text()).get("_class_name")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{cfg_file}: unreadable config ({e})") from None
    if found != class_name:
        raise ValueError(f"{folder}: holds a {found!r} checkpoint, not {class_name!r}")
    if not list(folder.glob("*.safetensors")):
        raise ValueError(f"{folder}: no *.safetensors weights")
    init_single_process()
    loader_mod = module("fastvideo.models.loader.component_loader")
    FastVideoArgs = module("fastvideo.fastvideo_args").FastVideoArgs
    PipelineConfig = module("fastvideo.configs.pipelines.base").PipelineConfig
    pc = PipelineConfig()
    pc.dit_config = config_cls()
    pc.dit_precision = precision
    args = FastVideoArgs(model_path=str(folder.parent), pipeline_config=pc, num_gpus=1)
    args.hsdp_shard_dim = args.hsdp_replicate_dim = 1
    saved = loader_mod.get_local_torch_device
    loader_mod.get_local_torch_device = lambda: torch.device(device)  # FastVideo reads a CPU-only host as "mps"
    try:
        with sdpa_backend_on_cpu():
            return loader_mod.TransformerLoader().load(str(folder), args)
    except Exception as e:  # noqa: BLE001 - a corrupt file, a missing or misshapen tensor: the same user error
        raise ValueError(f"{folder}: does not load into FastVideo's {class_name} ({str(e).splitlines()[0][:200]})"
                         ) from None
    finally:
        loader_mod.get_local_torch_device = saved
