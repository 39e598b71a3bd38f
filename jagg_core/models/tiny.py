"""In-memory tiny pipelines of each family, for tests and the CPU presets; no Hub access.

Weights are random (seeded); tokenizers are built from an in-memory character vocabulary, so
every prompt tokenizes without any downloaded file.
"""

from __future__ import annotations

import string

import torch
from diffusers import (AutoencoderKL, AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, FluxPipeline,
                       FluxTransformer2DModel, QwenImagePipeline, QwenImageTransformer2DModel, SD3Transformer2DModel,
                       StableDiffusion3Pipeline)
from tokenizers import pre_tokenizers
from transformers import (CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer, Qwen2_5_VLConfig,
                          Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer, T5Config, T5EncoderModel, T5Tokenizer)

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


def tiny_clip_config(vocab_size: int, hidden: int = CLIP_HIDDEN) -> CLIPTextConfig:
    return CLIPTextConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                          num_hidden_layers=2, num_attention_heads=2, projection_dim=hidden,
                          max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1,
                          hidden_act="gelu")


def tiny_clip_text_encoder(vocab_size: int, hidden: int = CLIP_HIDDEN) -> CLIPTextModelWithProjection:
    return CLIPTextModelWithProjection(tiny_clip_config(vocab_size, hidden))


def tiny_vae(latent_channels: int) -> AutoencoderKL:
    return AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(8, 16),
                         down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                         layers_per_block=1, latent_channels=latent_channels, norm_num_groups=4,
                         sample_size=32, use_quant_conv=False, use_post_quant_conv=False,
                         shift_factor=0.0609, scaling_factor=1.5035)


def tiny_sd3_pipeline(num_layers: int, heads: int, head_dim: int, context_length: int = 77) -> StableDiffusion3Pipeline:
    """SD3 with two tiny CLIP encoders and no T5 (the pipeline pads CLIP states to the joint dim)."""
    tokenizer = tiny_clip_tokenizer(max_length=context_length)
    transformer = SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, out_channels=4,
                                        num_layers=num_layers, attention_head_dim=head_dim, num_attention_heads=heads,
                                        joint_attention_dim=2 * CLIP_HIDDEN, caption_projection_dim=heads * head_dim,
                                        pooled_projection_dim=2 * CLIP_HIDDEN, pos_embed_max_size=32)
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=tiny_vae(4),
        text_encoder=tiny_clip_text_encoder(len(tokenizer)), tokenizer=tokenizer,
        text_encoder_2=tiny_clip_text_encoder(len(tokenizer)), tokenizer_2=tokenizer,
        text_encoder_3=None, tokenizer_3=None)


def build_tiny_sd3() -> StableDiffusion3Pipeline:
    return tiny_sd3_pipeline(num_layers=2, heads=2, head_dim=16)


def tiny_t5_tokenizer() -> T5Tokenizer:
    """A Unigram (SentencePiece-style) T5 tokenizer over single characters; ``▁`` marks word starts."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -3.0) for c in string.ascii_letters + string.digits + string.punctuation]
    return T5Tokenizer(vocab=pieces, extra_ids=0)


def build_tiny_flux() -> FluxPipeline:
    """FLUX.1-dev-like: CLIP (pooled) + T5 encoders, guidance embedding, dynamic shift as in FLUX.1-dev."""
    clip_tokenizer, t5_tokenizer = tiny_clip_tokenizer(), tiny_t5_tokenizer()
    t5_hidden = 32
    t5 = T5EncoderModel(T5Config(vocab_size=len(t5_tokenizer), d_model=t5_hidden, d_kv=8, d_ff=64, num_layers=2,
                                 num_heads=4, relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1,
                                 decoder_start_token_id=0))
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2,
                                         attention_head_dim=16, num_attention_heads=2, joint_attention_dim=t5_hidden,
                                         pooled_projection_dim=CLIP_HIDDEN, guidance_embeds=True,
                                         axes_dims_rope=(4, 4, 8))
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    return FluxPipeline(scheduler=scheduler, vae=tiny_vae(4), transformer=transformer,
                        text_encoder=CLIPTextModel(tiny_clip_config(len(clip_tokenizer))), tokenizer=clip_tokenizer,
                        text_encoder_2=t5, tokenizer_2=t5_tokenizer)


#: The words of QwenImagePipeline's prompt template (its text outside the chat special tokens).
QWEN_TEMPLATE_TEXT = ("system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
                      "spatial relationships of the objects and background:\nuser\nassistant\n")


def tiny_qwen_tokenizer() -> Qwen2Tokenizer:
    """A byte-level BPE Qwen2 tokenizer: the 256 byte symbols, the chat specials, and merges that make
    each word of QwenImagePipeline's prompt template one token.

    With them the template's system prefix is 34 tokens, as with the real Qwen tokenizer, so the
    pipeline's ``prompt_template_encode_start_idx = 34`` drops exactly that prefix; user prompts
    are tokenized byte by byte (words of the template excepted).
    """
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()) + specials)}
    pre_tokenize = Qwen2Tokenizer(vocab=dict(vocab)).backend_tokenizer.pre_tokenizer.pre_tokenize_str
    merges: list[tuple[str, str]] = []
    for word, _ in pre_tokenize(QWEN_TEMPLATE_TEXT):
        for i in range(1, len(word)):  # join the word's symbols left to right
            if (word[:i], word[i]) not in merges:
                merges.append((word[:i], word[i]))
            vocab.setdefault(word[:i + 1], len(vocab))
    return Qwen2Tokenizer(vocab=vocab, merges=merges, extra_special_tokens=specials[1:])


def build_tiny_qwen() -> QwenImagePipeline:
    """Qwen-Image-like: a tiny Qwen2.5-VL text encoder, the Qwen-Image VAE (frame axis, per-channel
    latent mean/std) and the scheduler settings of Qwen/Qwen-Image (dynamic shift, terminal sigma 0.02)."""
    tokenizer = tiny_qwen_tokenizer()
    text_hidden, z_dim = 16, 4
    special_ids = {"bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
                   "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
                   "pad_token_id": tokenizer.pad_token_id}
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config={"vocab_size": len(tokenizer), "hidden_size": text_hidden, "intermediate_size": 32,
                     "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
                     "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default"}, **special_ids},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16}))
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=z_dim, dim_mult=[1, 2, 4], num_res_blocks=1,
                                 temperal_downsample=[False, True], latents_mean=[0.1, -0.2, 0.05, 0.0],
                                 latents_std=[1.5, 0.8, 1.2, 1.0])
    transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=4 * z_dim, out_channels=z_dim, num_layers=2,
                                              attention_head_dim=16, num_attention_heads=2,
                                              joint_attention_dim=text_hidden, axes_dims_rope=(8, 4, 4))
    scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                                                base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02)
    return QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                             transformer=transformer)


def build_bench_sd3() -> StableDiffusion3Pipeline:
    """A 31M-parameter SD3 transformer (6 joint blocks of width 384) with tiny-sd3's text encoders and
    VAE and a 16-token CLIP context: large enough that the benchmarks (``jagg_core.bench``) are
    compute-bound on a CPU. Pair it with ``model.max_sequence_length=16`` (the zero T5 padding)."""
    return tiny_sd3_pipeline(num_layers=6, heads=6, head_dim=64, context_length=16)


TINY_BUILDERS = {"tiny-sd3": build_tiny_sd3, "tiny-flux": build_tiny_flux, "tiny-qwen": build_tiny_qwen,
                 "bench-sd3-31m": build_bench_sd3}


def build_tiny_pipeline(name: str, seed: int = 0):
    """Build the tiny pipeline ``name`` (``tiny-sd3``, ...) with weights drawn from ``seed``."""
    if name not in TINY_BUILDERS:
        raise UserError(f"unknown tiny model '{name}'; available: {', '.join(TINY_BUILDERS)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TINY_BUILDERS[name]()
