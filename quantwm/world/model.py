"""The built-in world model: a small camera-conditioned, frame-block-causal flow-matching transformer.

Shaped like the Wan-based world models it stands in for: 8x8-pixel patch tokens, pre-norm blocks with
adaLN time conditioning, QK-RMSNorm with a learnable per-head temperature, head dim 64, 3-D RoPE over
(time, row, column). The camera pose enters through the positions: a token's row and column are its
*world* patch coordinates (the view's pose plus its place in the view), a camera-aware RoPE in the
spirit of geometry-aware attention (GTA, PRoPE), so a Query can find the cached tokens that saw the same
place. Generation goes through `quantwm.core.cache.KVCache` exactly as the Self-Forcing family does: each
chunk is denoised in a few flow-matching steps that attend to the cache plus the chunk itself, then a
clean pass (t = 1) writes its K/V and commits it. Training attends with an equivalent block mask.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.rope import apply_rope, rope_angles


@dataclass(frozen=True)
class WorldConfig:
    patch: int = 8
    view: int = 8  # frames are view x view patches
    world_patches: int = 32
    dim: int = 192
    heads: int = 3
    layers: int = 4
    mlp_ratio: int = 4
    chunk_frames: int = 2
    context_frames: int = 4
    rope_theta: float = 100.0

    def __post_init__(self):
        if self.dim % self.heads or self.dim // self.heads < 64:
            raise ValueError(f"dim/heads must be an integer >= 64 (head dim), got {self.dim}/{self.heads}")
        if self.context_frames % self.chunk_frames:
            raise ValueError("context_frames must be a multiple of chunk_frames")

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def tokens_per_frame(self) -> int:
        return self.view * self.view

    @property
    def patch_dim(self) -> int:
        return self.patch * self.patch * 3


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding of flow time t in [0, 1]: (...,) -> (..., dim)."""
    half = dim // 2
    freqs = torch.exp(-math.log(1000.0) * torch.arange(half, device=t.device) / half)
    args = t[..., None].float() * 1000.0 * freqs
    return torch.cat([args.cos(), args.sin()], -1)


class Attention(nn.Module):
    def __init__(self, cfg: WorldConfig):
        super().__init__()
        self.cfg = cfg
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.q_norm = nn.RMSNorm(cfg.head_dim)
        self.k_norm = nn.RMSNorm(cfg.head_dim)
        self.log_temp = nn.Parameter(torch.full((cfg.heads,), math.log(4.0)))  # learnable temperature

    def qkv_heads(self, x: torch.Tensor, angles: torch.Tensor):
        """x (B, L, dim) -> q, k, v (B, H, L, Dh); q carries the temperature, q and k are post-RoPE."""
        B, L, _ = x.shape
        q, k, v = self.qkv(x).reshape(B, L, 3, self.cfg.heads, self.cfg.head_dim).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(self.q_norm(q), angles), apply_rope(self.k_norm(k), angles)
        q = q * self.log_temp.exp()[None, :, None, None]
        return q, k, v

    def forward(self, x, angles, mask=None, cache=None, layer=0, chunk=0, commit=False):
        q, k, v = self.qkv_heads(x, angles)
        if cache is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
        else:
            out = cache.attend(layer, q, k, v, chunk=chunk, commit=commit, scale=1.0)
        return self.proj(out.transpose(1, 2).reshape(x.shape))


class Block(nn.Module):
    def __init__(self, cfg: WorldConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim, elementwise_affine=False)
        self.attn = Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.dim, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim), nn.GELU(),
                                 nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim))
        self.ada = nn.Linear(cfg.dim, 6 * cfg.dim)
        nn.init.zeros_(self.ada.weight), nn.init.zeros_(self.ada.bias)

    def forward(self, x, modulation, angles, **attn_kw):
        """modulation: `self.ada` of the time conditioning (`WorldModel.conditioning`)."""
        s1, b1, g1, s2, b2, g2 = modulation.chunk(6, -1)
        x = x + (1 + g1) * self.attn(self.norm1(x) * (1 + s1) + b1, angles, **attn_kw)
        return x + (1 + g2) * self.mlp(self.norm2(x) * (1 + s2) + b2)


class WorldModel(nn.Module):
    """Predicts the flow-matching velocity of noisy patch tokens given clean history."""

    def __init__(self, cfg: WorldConfig = WorldConfig()):
        super().__init__()
        self.cfg = cfg
        self.patch_in = nn.Linear(cfg.patch_dim, cfg.dim)
        self.time = nn.Sequential(nn.Linear(cfg.dim, cfg.dim), nn.SiLU(), nn.Linear(cfg.dim, cfg.dim))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm_out = nn.LayerNorm(cfg.dim, elementwise_affine=False)
        self.ada_out = nn.Linear(cfg.dim, 2 * cfg.dim)
        self.out = nn.Linear(cfg.dim, cfg.patch_dim)
        nn.init.zeros_(self.ada_out.weight), nn.init.zeros_(self.ada_out.bias)

    def config_dict(self) -> dict:
        return asdict(self.cfg)

    def conditioning(self, t: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The flow time's adaLN modulations: each block's (B, L, 6 dim) and the output's (B, L, 2 dim), of t (B, L).
        A rollout computes them once per denoising step and passes them to every chunk (`forward(conditioning=)`):
        the same t gives the same values, and computing them again was a third of a generated chunk's matmuls."""
        c = self.time(timestep_embedding(t, self.cfg.dim))
        return [blk.ada(c) for blk in self.blocks], self.ada_out(c)

    def forward(self, tokens: torch.Tensor, t: torch.Tensor, coords: torch.Tensor, mask=None, cache=None,
                chunk: int = 0, commit: bool = False, conditioning: tuple | None = None) -> torch.Tensor:
        """tokens (B, L, patch_dim) in [-1, 1] space, t (B, L) flow time, coords (L, 3) or (B, L, 3) -> velocity.

        With `cache`, the L tokens are one chunk attending to the cache plus themselves (`chunk` is its
        index; `commit` makes this the clean pass that commits it). Without, `mask` (L, L) is the
        block-causal training mask. `conditioning`: `self.conditioning(t)` when the caller already has it.
        """
        angles = rope_angles(coords, self.cfg.head_dim, self.cfg.rope_theta).float().to(tokens.device)
        blocks, out = conditioning if conditioning is not None else self.conditioning(t)
        x = self.patch_in(tokens)
        for i, blk in enumerate(self.blocks):
            x = blk(x, blocks[i], angles, mask=mask, cache=cache, layer=i, chunk=chunk, commit=commit)
        s, b = out.chunk(2, -1)
        return self.out(self.norm_out(x) * (1 + s) + b)


def training_mask(n_frames: int, cfg: WorldConfig) -> torch.Tensor:
    """Boolean (L, L) mask over [clean frames 0..T-1 | noisy frames context..T-1], True = may attend.

    A clean token of chunk c sees clean chunks <= c; a noisy token of chunk c sees clean chunks < c and
    the noisy tokens of its own chunk: exactly what generation through the cache sees.
    """
    n = cfg.tokens_per_frame
    clean_chunk = torch.arange(n_frames).repeat_interleave(n) // cfg.chunk_frames
    noisy_chunk = torch.arange(cfg.context_frames, n_frames).repeat_interleave(n) // cfg.chunk_frames
    cc, nc = clean_chunk, noisy_chunk
    top = torch.cat([cc[:, None] >= cc[None, :], torch.zeros(len(cc), len(nc), dtype=torch.bool)], 1)
    bottom = torch.cat([nc[:, None] > cc[None, :], nc[:, None] == nc[None, :]], 1)
    return torch.cat([top, bottom], 0)
