"""A tiny randomly initialised SANA-WM stage-2 refiner (`SanaWMLTX2Refiner`) of the real diffusers and transformers
classes: the LTX-2 refiner transformer, LTX-2 text connectors, a Gemma-3 text encoder and a word-level tokenizer."""
from __future__ import annotations

WORDS = "a cat walks on the beach at dusk red car drives through city night"


def tiny_sana_refiner(seed: int = 0, vae: bool = False):
    """The stock pipeline: 2 blocks, 2 heads x 64, 8 latent channels; Gemma-3 with 2 layers of width 32; with
    `vae`, an LTX-2 video VAE (32x spatial, 8x temporal, causal) to decode the refined latents."""
    import torch
    from diffusers import AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler, SanaWMLTX2Refiner, SanaWMLTX2RefinerTransformer3DModel
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, GemmaTokenizerFast

    torch.manual_seed(seed)
    transformer = SanaWMLTX2RefinerTransformer3DModel(
        in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=64, cross_attention_dim=128,
        num_layers=2, caption_channels=32, audio_in_channels=8, audio_out_channels=8, audio_num_attention_heads=2,
        audio_attention_head_dim=8, audio_cross_attention_dim=16, base_height=64, base_width=64).eval()
    config = Gemma3Config(
        text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, vocab_size=64),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14), mm_tokens_per_image=4)
    text_encoder = Gemma3ForConditionalGeneration(config).eval()
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, **{w: i + 4 for i, w in enumerate(WORDS.split())}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = GemmaTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>")
    connectors = LTX2TextConnectors(  # text_proj_in_factor: Gemma's layers + 1 (the embeddings)
        caption_channels=32, text_proj_in_factor=3, video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=16, video_connector_num_layers=1,
        video_connector_num_learnable_registers=None, audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=16, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None, video_hidden_dim=32, audio_hidden_dim=32).eval()
    decoder = AutoencoderKLLTX2Video(
        latent_channels=8, block_out_channels=(8, 16, 32, 64), decoder_block_out_channels=(8, 16, 32),
        layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1)).eval() if vae else None
    return SanaWMLTX2Refiner(transformer=transformer, connectors=connectors, tokenizer=tokenizer,
                             text_encoder=text_encoder, scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0),
                             vae=decoder, text_max_sequence_length=16)
