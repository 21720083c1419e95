"""A tiny randomly initialised Wan2.1 of the real diffusers classes, shared by the tests that need one."""
from __future__ import annotations


def tiny_wan(latents_mean: float = 0.0, latents_std: float = 1.0, seed: int = 0):
    """(WanTransformer3DModel, AutoencoderKLWan): 2 layers, 2 heads x 64, 4 latent channels, text dim 16, 2x2
    patches; the VAE 8x spatial and 4x temporal like Wan's, with the given latent normalisation."""
    import diffusers
    import torch

    torch.manual_seed(seed)
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=32, ffn_dim=128, num_layers=2, rope_max_seq_len=64).eval()
    vae = diffusers.AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                     temperal_downsample=[False, True, True], latents_mean=[latents_mean] * 4,
                                     latents_std=[latents_std] * 4).eval()
    return model, vae
