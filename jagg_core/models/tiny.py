"""In-memory tiny pipelines of each family, for tests and the CPU presets; no Hub access.

Weights are random (seeded); tokenizers are built from an in-memory character vocabulary, so
every prompt tokenizes without any downloaded file.
"""

from __future__ import annotations

import string

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer

from ..errors import UserError

CLIP_HIDDEN = 32


def character_vocab() -> dict[str, int]:
    """A BPE vocabulary of single characters, each also as a word end (``c</w>``), plus specials."""
    tokens = ["<|startoftext|>", "<|endoftext|>"]
    chars = string.ascii_lowercase + string.digits + string.punctuation
    tokens += list(chars) + [c + "</w>" for c in chars]
    return {token: i for i, token in enumerate(tokens)}


def tiny_clip_tokenizer(max_length: int = 77) -> CLIPTokenizer:
    return CLIPTokenizer(vocab=character_vocab(), merges=[], model_max_length=max_length)


def tiny_clip_text_encoder(vocab_size: int, hidden: int = CLIP_HIDDEN) -> CLIPTextModelWithProjection:
    config = CLIPTextConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                            num_hidden_layers=2, num_attention_heads=2, projection_dim=hidden,
                            max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1,
                            hidden_act="gelu")
    return CLIPTextModelWithProjection(config)


def tiny_vae(latent_channels: int) -> AutoencoderKL:
    return AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(8, 16),
                         down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                         layers_per_block=1, latent_channels=latent_channels, norm_num_groups=4,
                         sample_size=32, use_quant_conv=False, use_post_quant_conv=False,
                         shift_factor=0.0609, scaling_factor=1.5035)


def build_tiny_sd3() -> StableDiffusion3Pipeline:
    """SD3 with two tiny CLIP encoders and no T5 (the pipeline pads CLIP states to the joint dim)."""
    tokenizer = tiny_clip_tokenizer()
    transformer = SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=2,
                                        attention_head_dim=16, num_attention_heads=2,
                                        joint_attention_dim=2 * CLIP_HIDDEN, caption_projection_dim=32,
                                        pooled_projection_dim=2 * CLIP_HIDDEN, pos_embed_max_size=32)
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=tiny_vae(4),
        text_encoder=tiny_clip_text_encoder(len(tokenizer)), tokenizer=tokenizer,
        text_encoder_2=tiny_clip_text_encoder(len(tokenizer)), tokenizer_2=tokenizer,
        text_encoder_3=None, tokenizer_3=None)


TINY_BUILDERS = {"tiny-sd3": build_tiny_sd3}


def build_tiny_pipeline(name: str, seed: int = 0):
    """Build the tiny pipeline ``name`` (``tiny-sd3``, ...) with weights drawn from ``seed``."""
    if name not in TINY_BUILDERS:
        raise UserError(f"unknown tiny model '{name}'; available: {', '.join(TINY_BUILDERS)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TINY_BUILDERS[name]()
