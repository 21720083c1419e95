"""Record Self-Forcing's causal Wan2.1 generator into a run file: BF16 and a method from the same noise.

    run = record_self_forcing("self_forcing_dmd.pt", "Wan2.1-T2V-1.3B-Diffusers", "prompt.safetensors",
                              method="quantwm", latent_frames=21)
    write_run("sf.safetensors", run)     # python app.py --run sf.safetensors

* **Weights.** Self-Forcing releases its generator as a torch checkpoint in the original Wan parameter
  names (`blocks.0.self_attn.q.weight`, `head.modulation`, ...), under "generator_ema" or "generator" and
  with a "model." prefix. `load_self_forcing` unwraps it and loads it into diffusers'
  `WanTransformer3DModel` with diffusers' own conversion (`from_single_file`, the config read from
  `base/transformer`, nothing downloaded); the VAE is `AutoencoderKLWan` from `base/vae`.
* **Text.** The prompt's UMT5 embeddings come from the base model's own encoder (`encode_prompt`: `base/tokenizer`
  and `base/text_encoder`, run through diffusers' `WanPipeline._get_t5_prompt_embeds`, 512 tokens; needs
  `transformers`) or from a safetensors file holding `prompt_embeds` (1, tokens, text_dim).
* **Sampling** (Self-Forcing's inference): chunks of `chunk_frames` latent frames (3), each denoised with the
  few-step list (1000, 750, 500, 250) warped by the flow-matching shift (5.0): at step j the model predicts
  the flow v, x0 = x - sigma_j v, and the next step starts from (1 - sigma_{j+1}) x0 + sigma_{j+1} noise;
  then a clean pass at t = 0 writes the chunk's K/V and commits it (`quantwm.adapters.diffusers_wan`).
  Both runs draw the same noise. The latents are de-normalised with the VAE's latents_mean/std and decoded.
* **Probes** (`ProbeCapture`): on the last denoising pass of every chunk after the first, per layer and
  head, the top-1 cached token of each query under exact and under stored keys, and the logits for the
  layers/heads asked for (what the app's pixel trace draws).

What is verified here: tiny randomly initialised models of these classes, saved in these formats
(tests/test_self_forcing.py). Real weights need the released checkpoint and a GPU for useful speed.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from ..core.cache import CacheConfig
from ..evaluation.metrics import probe_logits
from .capture import TraceCapture
from .diffusers_wan import WanCacheAdapter, wan_kv_cache

DENOISING_STEPS = (1000, 750, 500, 250)
SHIFT = 5.0


def _generator_state(path: str | Path) -> dict[str, torch.Tensor]:
    """The generator's state dict in original Wan names from a Self-Forcing checkpoint (.pt) or a plain
    state dict (.pt / .safetensors)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{path}: no such checkpoint")
    try:
        if p.suffix == ".safetensors":
            from safetensors.torch import load_file
            state = load_file(str(p))
        else:
            state = torch.load(str(p), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same user error
        raise ValueError(f"{path}: unreadable checkpoint ({str(e).splitlines()[0][:100]})") from None
    for key in ("generator_ema", "generator", "model", "state_dict"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
            break
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path}: not a state dict of tensors")
    state = {k.removeprefix("model."): v for k, v in state.items()}
    if "head.modulation" not in state:
        raise ValueError(f"{path}: not a Wan generator in the original parameter names (no head.modulation)")
    return state


def load_self_forcing(checkpoint: str | Path, base: str | Path, device: str = "cpu",
                      dtype: torch.dtype = torch.float32):
    """(WanTransformer3DModel, AutoencoderKLWan) from Self-Forcing's checkpoint and a local diffusers Wan2.1
    folder (`base`: transformer/config.json and vae/), through diffusers' single-file conversion."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from safetensors.torch import save_file

    base = Path(base)
    for sub in ("transformer/config.json", "vae"):
        if not (base / sub).exists():
            raise ValueError(f"{base}: not a diffusers Wan folder (no {sub})")
    state = _generator_state(checkpoint)
    with tempfile.TemporaryDirectory() as tmp:
        single = os.path.join(tmp, "generator.safetensors")
        save_file({k: v.contiguous() for k, v in state.items()}, single)
        try:
            model = WanTransformer3DModel.from_single_file(single, config=str(base), subfolder="transformer",
                                                           local_files_only=True, torch_dtype=dtype)
        except Exception as e:  # noqa: BLE001 - a mismatch between checkpoint and config
            raise ValueError(f"{checkpoint}: does not load into {base}/transformer ({str(e).splitlines()[0][:160]})") \
                from None
    vae = AutoencoderKLWan.from_pretrained(str(base), subfolder="vae", torch_dtype=dtype)
    return model.to(device).eval(), vae.to(device).eval()


def load_prompt_embeddings(path: str | Path, text_dim: int) -> torch.Tensor:
    """`prompt_embeds` (1, tokens, text_dim) from a safetensors file."""
    from safetensors.torch import load_file

    try:
        e = load_file(str(path))["prompt_embeds"]
    except Exception as err:  # noqa: BLE001
        raise ValueError(f"{path}: no prompt_embeds in a safetensors file ({str(err).splitlines()[0][:100]})") from None
    if e.dim() == 2:
        e = e[None]
    if e.dim() != 3 or e.shape[-1] != text_dim or not torch.isfinite(e).all():
        raise ValueError(f"{path}: prompt_embeds must be finite (1, tokens, {text_dim}), got {tuple(e.shape)}")
    return e.float()


def load_text_encoder(base: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """(tokenizer, UMT5 encoder) from a diffusers Wan folder's tokenizer/ and text_encoder/ (needs transformers)."""
    base = Path(base)
    for sub in ("tokenizer", "text_encoder"):
        if not (base / sub).is_dir():
            raise ValueError(f"{base}: no {sub}/ folder (the base model's UMT5 encoder); give prompt embeddings instead")
    try:
        from transformers import AutoTokenizer, UMT5EncoderModel
    except ImportError as e:
        raise ValueError("encoding a prompt needs transformers (pip install 'quantwm[diffusers]'); or give prompt "
                         "embeddings") from e
    tokenizer = AutoTokenizer.from_pretrained(str(base / "tokenizer"), local_files_only=True)
    encoder = UMT5EncoderModel.from_pretrained(str(base / "text_encoder"), local_files_only=True, dtype=dtype)
    return tokenizer, encoder.to(device).eval()


def encode_prompt(base: str | Path | None, prompt: str, max_sequence_length: int = 512, device: str = "cpu",
                  text_encoder: tuple | None = None) -> torch.Tensor:
    """The prompt's UMT5 embeddings (1, max_sequence_length, text_dim) float32, as diffusers' WanPipeline makes
    them: its own `_get_t5_prompt_embeds` over the base folder's tokenizer and encoder (or `text_encoder`, a
    loaded (tokenizer, encoder) pair)."""
    from types import SimpleNamespace

    from diffusers import WanPipeline

    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("the prompt is empty")
    tokenizer, encoder = text_encoder or load_text_encoder(base, device)
    dev = next(encoder.parameters()).device
    owner = SimpleNamespace(tokenizer=tokenizer, text_encoder=encoder, _execution_device=dev)
    with torch.no_grad():
        embeds = WanPipeline._get_t5_prompt_embeds(owner, prompt, 1, max_sequence_length, dev, torch.float32)
    return embeds.cpu()


def sigmas(steps=DENOISING_STEPS, shift: float = SHIFT) -> list[float]:
    """The flow-matching noise level of each few-step timestep after the shift warp."""
    out = []
    for t in steps:
        s = t / 1000
        out.append(shift * s / (1 + (shift - 1) * s))
    return out


def check_logit_picks(layers: int, heads: int, logit_layers, logit_heads) -> None:
    """The layers and heads whose logits a run keeps must exist in the model (ValueError naming the first)."""
    for name, vals, n in (("logit layer", logit_layers, layers), ("logit head", logit_heads, heads)):
        bad = [v for v in vals if not 0 <= v < n]
        if bad:
            raise ValueError(f"{name} {bad[0]} out of range: the model has {n}")


class ProbeCapture(TraceCapture):
    """Top-1 cached sources (exact vs stored keys) of every query on the last denoising pass of each chunk,
    and logits for `logit_layers` x `logit_heads`; chunk -> tensors in `top1` / `logits`."""

    def __init__(self, n_layers: int, logit_layers=(), logit_heads=(), head_block: int = 1):
        super().__init__(chunks=[1], history=False)
        self.n_layers, self.logit_layers, self.logit_heads = n_layers, list(logit_layers), list(logit_heads)
        self.head_block = head_block
        self._top1: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._logits: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def observe(self, cache, layer: int, chunk: int, commit: bool, q: torch.Tensor, scale: float) -> None:
        if commit or chunk == 0:
            return
        qh = self._bhd(cache, q).detach().float()  # (H, N, D)
        n = qh.shape[1]
        k_exact = self._bhd(cache, cache.keys(layer, exact=True))[:, :-n].float()
        k_stored = self._bhd(cache, cache.keys(layer))[:, :-n].float()
        bias = cache.logit_bias(layer, qh[None], scale)  # +jensen methods: (1, H, N, L) over all held keys
        self.record(layer, chunk, qh, k_exact, k_stored, scale, None if bias is None else bias[0, :, :, :-n])

    def record(self, layer: int, chunk: int, qh: torch.Tensor, k_exact: torch.Tensor, k_stored: torch.Tensor,
               scale: float, bias: torch.Tensor | None = None) -> None:
        """Top-1 cached key of each query qh (H, N, D) under k_exact and k_stored (H, L, D), `bias` (H, N, L)
        added to the stored logits; logits kept for the chosen layers and heads."""
        tops_e, tops_q = [], []
        for h0 in range(0, qh.shape[0], self.head_block):  # bounded memory: a few heads' logits at a time
            hs = slice(h0, h0 + self.head_block)
            le, lq = probe_logits(qh[hs], k_exact[hs], k_stored[hs], scale, None if bias is None else bias[hs])
            tops_e.append(le.argmax(-1)), tops_q.append(lq.argmax(-1))
            if layer in self.logit_layers:
                for h in range(h0, min(h0 + self.head_block, qh.shape[0])):
                    if h in self.logit_heads:
                        self._logits.setdefault(chunk, {})[(layer, h)] = (le[h - h0].half().cpu(), lq[h - h0].half().cpu())
        self._top1.setdefault(chunk, {})[layer] = (torch.cat(tops_e).int().cpu(), torch.cat(tops_q).int().cpu())

    def top1(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        out = {}
        for c, per in sorted(self._top1.items()):
            if len(per) == self.n_layers:
                out[c] = tuple(torch.stack([per[l][i] for l in range(self.n_layers)]) for i in (0, 1))
        return out

    def logits(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        if not (self.logit_layers and self.logit_heads):
            return {}
        out = {}
        for c, per in sorted(self._logits.items()):
            out[c] = tuple(torch.stack([torch.stack([per[(l, h)][i] for h in self.logit_heads])
                                        for l in self.logit_layers]).float() for i in (0, 1))
        return out


def _rollout(model, vae, text, cache_config: CacheConfig, latent_frames: int, chunk_frames: int,
             latent_hw: tuple[int, int], seed: int, capture: ProbeCapture | None, progress: Callable | None):
    C = model.config.in_channels
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    text = text.to(device, dtype)
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(1, C, latent_frames, *latent_hw, generator=g)
    sig = sigmas()
    cache = wan_kv_cache(model, cache_config)
    out = torch.zeros_like(noise)
    n_chunks = latent_frames // chunk_frames
    with torch.no_grad(), WanCacheAdapter(model, cache, capture) as wan:
        for i in range(n_chunks):
            sl = slice(i * chunk_frames, (i + 1) * chunk_frames)
            x = noise[:, :, sl].to(device)  # the sampler's arithmetic in float32; the model in its own dtype
            for j, s in enumerate(sig):
                with wan.chunk(i):
                    v = model(x.to(dtype), torch.full((1,), s * 1000.0, device=device), text).sample.float()
                x0 = x - s * v
                if j + 1 < len(sig):
                    x = (1 - sig[j + 1]) * x0 + sig[j + 1] * torch.randn(x0.shape, generator=g).to(device)
            out[:, :, sl] = x0.cpu()
            with wan.chunk(i, commit=True):
                model(x0.to(dtype), torch.zeros(1, device=device), text)
            if progress:
                progress(i + 1, n_chunks)
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
        video = vae.decode((out * std + mean).to(device, next(vae.parameters()).dtype)).sample  # (1, 3, T, H, W)
    frames = ((video[0].permute(1, 2, 3, 0).float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu()
    return frames, cache


def record_self_forcing(checkpoint, base, embeddings, method: str = "quantwm", target: str = "kv", bits: int = 2,
                        latent_frames: int = 21, chunk_frames: int = 3, height: int = 480, width: int = 832,
                        seed: int = 0, logit_layers=(), logit_heads=(), device: str = "cpu",
                        progress: Callable | None = None, models=None):
    """The run file contents (`runfile.Run`) of Self-Forcing with `method`'s cache against BF16.
    `models`: an already loaded (transformer, vae) pair instead of checkpoint/base."""
    from ..evaluation.runfile import Run, RunFacts, memory_meta

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device on this machine")
    model, vae = models if models is not None else load_self_forcing(checkpoint, base, device)
    cfg_t = model.config
    spatial = 2 ** len(vae.temperal_downsample)
    temporal = 2 ** sum(vae.temperal_downsample)
    pt, ph, pw = cfg_t.patch_size
    if pt != 1 or ph != pw:
        raise ValueError(f"patch size {cfg_t.patch_size}: only (1, p, p) patches are supported")
    if height % (spatial * ph) or width % (spatial * pw):
        raise ValueError(f"height and width must be multiples of {spatial * ph}, got {height}x{width}")
    if latent_frames < 2 * chunk_frames or latent_frames % chunk_frames:
        raise ValueError(f"latent_frames must be a multiple of chunk_frames={chunk_frames}, at least two chunks")
    text = load_prompt_embeddings(embeddings, cfg_t.text_dim) if not torch.is_tensor(embeddings) else embeddings
    lat_hw = (height // spatial, width // spatial)
    layers, heads = cfg_t.num_layers, cfg_t.num_attention_heads
    check_logit_picks(layers, heads, logit_layers, logit_heads)
    step = (lambda a, n: progress(a, 2 * n)) if progress else None
    ref_frames, _ = _rollout(model, vae, text, CacheConfig(layout="BLHD"), latent_frames, chunk_frames, lat_hw, seed,
                             None, step)
    probe = ProbeCapture(layers, logit_layers, logit_heads)
    step2 = (lambda a, n: progress(n + a, 2 * n)) if progress else None
    frames, cache = _rollout(model, vae, text, CacheConfig(method=method, target=target, k_bits=bits, v_bits=bits,
                                                           layout="BLHD", keep_exact=True, track_queries=True),
                             latent_frames,
                             chunk_frames, lat_hw, seed, probe, step2)
    stats = torch.stack([cache.query_stats(l).float().cpu() for l in range(layers)])
    facts = RunFacts("Self-Forcing (Wan2.1 causal, diffusers WanTransformer3DModel)", layers, heads,
                     cfg_t.attention_head_dim, (lat_hw[0] // ph, lat_hw[1] // pw), chunk_frames, 0,
                     vae_spatial=spatial, patch=ph, vae_temporal=temporal)
    meta = {"method": method, "target": target, "bits": bits, **memory_meta(cache.memory()),
            "logit_layers": list(logit_layers), "logit_heads": list(logit_heads),
            "source": {"checkpoint": str(checkpoint), "base": str(base), "seed": seed, "latent_frames": latent_frames,
                       "steps": list(DENOISING_STEPS), "shift": SHIFT}}
    return Run(facts, meta, ref_frames, frames, stats, probe.top1(), probe.logits())


class SelfForcingLive:
    """A loaded Self-Forcing generator that makes BF16-vs-method run files on demand: the app's live backend
    (`python app.py --model self-forcing`). Prompts are encoded by the base folder's UMT5, loaded at the first
    prompt and kept beside the generator; a prompt-embeddings file needs no base folder.

        live = SelfForcingLive(load_self_forcing(ckpt, base, "cuda", torch.bfloat16), "cuda", 480, 832, base)
        run = live.generate(seed=3, method="quantwm", target="kv", bits=2, latent_frames=6, prompt="a red car")
    """

    kind = "Self-Forcing"
    LATENT_FRAMES = (6, 9, 12, 15, 18, 21)  # 21 latent frames: Self-Forcing's 81 video frames

    def __init__(self, models, device: str, height: int = 480, width: int = 832, base: str | Path | None = None,
                 device_name: str | None = None):
        self.models, self.device, self.height, self.width, self.base = models, device, height, width, base
        self.device_name = device_name or device
        self.text_encoder = None

    def check(self, seed: int, method: str, target: str, bits: int, latent_frames: int, prompt: str = "",
              embeddings=None) -> None:
        """Every request's settings, before any work (ValueError naming what is wrong)."""
        if prompt and embeddings:
            raise ValueError("give a prompt or a prompt embeddings file, not both")
        if not prompt and not embeddings:
            raise ValueError("no prompt and no prompt embeddings file given (a safetensors file with prompt_embeds)")
        if latent_frames not in self.LATENT_FRAMES:
            raise ValueError(f"latent frames must be one of {', '.join(map(str, self.LATENT_FRAMES))}, got {latent_frames}")
        if seed < 0:
            raise ValueError(f"noise seed must be >= 0, got {seed}")
        if prompt and not self.base:
            raise ValueError("this backend was started without a base folder: give a prompt embeddings file")
        CacheConfig(method=method, target=target, k_bits=bits, v_bits=bits)  # validates with the cache's messages

    def run_id(self, seed: int, method: str, target: str, bits: int, latent_frames: int) -> str:
        return f"live={self.kind} seed={seed} {method} {target} {bits}-bit {latent_frames}lf"

    def generate(self, seed: int, method: str, target: str, bits: int, latent_frames: int, prompt: str = "",
                 embeddings=None, progress: Callable | None = None):
        """The run file contents (`runfile.Run`) of BF16 and `method` from the same noise."""
        self.check(seed, method, target, bits, latent_frames, prompt, embeddings)
        if prompt:
            if self.text_encoder is None:
                param = next(self.models[0].parameters())
                self.text_encoder = load_text_encoder(self.base, param.device, param.dtype)
            embeddings = encode_prompt(None, prompt, text_encoder=self.text_encoder)
        return record_self_forcing(None, None, embeddings, method, target, bits, latent_frames, 3, self.height,
                                   self.width, seed, [1], [0], self.device, progress=progress, models=self.models)
