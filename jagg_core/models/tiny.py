"""In-memory tiny pipelines of each family, for tests and the CPU presets; no Hub access.

Weights are random (seeded); tokenizers are built from an in-memory character vocabulary, so
every prompt tokenizes without any downloaded file.
"""

from __future__ import annotations

import inspect
import string

import torch
from diffusers import (AutoencoderKL, AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, FluxPipeline,
                       FluxTransformer2DModel, QwenImagePipeline, QwenImageTransformer2DModel, SD3Transformer2DModel,
                       StableDiffusion3Pipeline)
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
from tokenizers import pre_tokenizers
from transformers import (CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer, Qwen2_5_VLConfig,
                          Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer, T5Config, T5EncoderModel, T5Tokenizer)
from transformers import UMT5Config, UMT5EncoderModel
from diffusers import AutoencoderKLFlux2, Flux2KleinPipeline, Flux2Transformer2DModel, ZImagePipeline
from diffusers import ZImageTransformer2DModel
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model
from diffusers import FluxKontextPipeline, QwenImageEditPipeline
from transformers import Qwen2VLImageProcessorPil, Qwen2VLProcessor

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


def tiny_qwen_tokenizer(template_text: str = QWEN_TEMPLATE_TEXT,
                        extra_specials: tuple[str, ...] = ()) -> Qwen2Tokenizer:
    """A byte-level BPE Qwen2 tokenizer: the 256 byte symbols, the chat specials (and ``extra_specials``), and merges
    that make each word of ``template_text`` (by default QwenImagePipeline's prompt template) one token.

    With them the template's system prefix is 34 tokens, as with the real Qwen tokenizer, so the
    pipeline's ``prompt_template_encode_start_idx = 34`` drops exactly that prefix; user prompts
    are tokenized byte by byte (words of the template excepted).
    """
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *extra_specials]
    vocab = {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()) + specials)}
    pre_tokenize = Qwen2Tokenizer(vocab=dict(vocab)).backend_tokenizer.pre_tokenizer.pre_tokenize_str
    merges: list[tuple[str, str]] = []
    for word, _ in pre_tokenize(template_text):
        for i in range(1, len(word)):  # join the word's symbols left to right
            if (word[:i], word[i]) not in merges:
                merges.append((word[:i], word[i]))
            vocab.setdefault(word[:i + 1], len(vocab))
    return Qwen2Tokenizer(vocab=vocab, merges=merges, extra_special_tokens=specials[1:])


def qwen_special_ids(tokenizer) -> dict[str, int]:
    """The bos / eos / pad token ids of a Qwen text config for :func:`tiny_qwen_tokenizer`'s vocabulary."""
    return {"bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
            "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"), "pad_token_id": tokenizer.pad_token_id}


#: width of the tiny Qwen2.5-VL text encoder (and of its vision tower's output)
TINY_QWEN_TEXT_HIDDEN = 16
#: config key -> the Qwen2.5-VL vision special token it names
QWEN_VISION_TOKENS = {"vision_start_token_id": "<|vision_start|>", "image_token_id": "<|image_pad|>",
                      "vision_end_token_id": "<|vision_end|>", "video_token_id": "<|video_pad|>"}


def qwen_vision_ids(tokenizer) -> dict[str, int]:
    """The vision token ids of a Qwen2.5-VL config for the tokenizer's vocabulary (none for a text-only one)."""
    vocab = tokenizer.get_vocab()
    return {key: vocab[token] for key, token in QWEN_VISION_TOKENS.items() if token in vocab}


def tiny_qwen_vl_encoder(tokenizer) -> Qwen2_5_VLForConditionalGeneration:
    """A two-layer Qwen2.5-VL text model with a one-block vision tower, for the tokenizer's vocabulary."""
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config={"vocab_size": len(tokenizer), "hidden_size": TINY_QWEN_TEXT_HIDDEN, "intermediate_size": 32,
                     "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
                     "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default"},
                     **qwen_special_ids(tokenizer)},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                       "out_hidden_size": TINY_QWEN_TEXT_HIDDEN},
        **qwen_vision_ids(tokenizer)))


def build_tiny_qwen() -> QwenImagePipeline:
    """Qwen-Image-like: a tiny Qwen2.5-VL text encoder, the Qwen-Image VAE (frame axis, per-channel
    latent mean/std) and the scheduler settings of Qwen/Qwen-Image (dynamic shift, terminal sigma 0.02)."""
    tokenizer = tiny_qwen_tokenizer()
    text_hidden, z_dim = TINY_QWEN_TEXT_HIDDEN, 4
    text_encoder = tiny_qwen_vl_encoder(tokenizer)
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


#: The words of QwenImageEditPipeline's prompt template (its text outside the chat and vision special tokens).
QWEN_EDIT_TEMPLATE_TEXT = ("system\nDescribe the key features of the input image (color, shape, size, texture, "
                           "objects, background), then explain how the user's text instruction should alter or "
                           "modify the image. Generate a new image that meets the user's requirements while "
                           "maintaining consistency with the original input where appropriate.\nuser\nassistant\n")


def tiny_qwen_edit_tokenizer() -> Qwen2Tokenizer:
    """:func:`tiny_qwen_tokenizer` for QwenImageEditPipeline: its template's words and the vision tokens. Its system
    prefix is 74 tokens, where the real tokenizer's is the 64 the pipeline drops, so 10 template tokens stay in the
    tiny model's text states (the pipeline and the model drop the same, so they agree)."""
    return tiny_qwen_tokenizer(QWEN_EDIT_TEMPLATE_TEXT, tuple(QWEN_VISION_TOKENS.values()))


class ImageQwenVLProcessor(Qwen2VLProcessor):
    """``Qwen2VLProcessor`` for text and images only: without its video processor, which needs torchvision."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, chat_template=chat_template, **kwargs)


def tiny_qwen_processor(tokenizer) -> ImageQwenVLProcessor:
    """The processor QwenImageEditPipeline calls: Qwen2-VL's image processing (14-pixel patches merged 2x2, at
    least 56x56 pixels) and ``tokenizer``."""
    return ImageQwenVLProcessor(image_processor=Qwen2VLImageProcessorPil(), tokenizer=tokenizer)


def build_tiny_qwen_edit() -> QwenImageEditPipeline:
    """tiny-qwen as Qwen-Image-Edit (whose transformer, VAE and scheduler are Qwen-Image's): its Qwen2.5-VL encoder
    reads the input image through the processor, the tokenizer knows the edit template and the vision tokens."""
    tokenizer = tiny_qwen_edit_tokenizer()
    return QwenImageEditPipeline(**{**build_tiny_qwen().components, "tokenizer": tokenizer,
                                    "text_encoder": tiny_qwen_vl_encoder(tokenizer),
                                    "processor": tiny_qwen_processor(tokenizer)})


def build_tiny_flux_kontext() -> FluxKontextPipeline:
    """tiny-flux's components in FluxKontextPipeline (FLUX.1 Kontext [dev] has FLUX.1 [dev]'s architecture)."""
    return FluxKontextPipeline(**build_tiny_flux().components)


def build_tiny_wan() -> WanPipeline:
    """Wan 2.1 T2V-like: a tiny UMT5 encoder, the Wan video VAE (4x frames, 8x pixels, per-channel latent
    mean/std) and the scheduler of Wan-AI/Wan2.1-T2V-1.3B-Diffusers (UniPC with flow sigmas, flow_shift 3)."""
    tokenizer, text_hidden, z_dim = tiny_t5_tokenizer(), 32, 4
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), d_model=text_hidden, d_kv=8, d_ff=64,
                                               num_layers=2, num_heads=4, relative_attention_num_buckets=8,
                                               pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    vae = AutoencoderKLWan(base_dim=4, z_dim=z_dim, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.05, 0.0],
                           latents_std=[1.5, 0.8, 1.2, 1.0])
    transformer = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                        in_channels=z_dim, out_channels=z_dim, text_dim=text_hidden, freq_dim=32,
                                        ffn_dim=32, num_layers=2, cross_attn_norm=True,
                                        qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                       transformer=transformer)


#: A Qwen3-style chat template (what ``apply_chat_template`` needs): user turns, then the assistant's turn, with
#: the empty thinking block Qwen3 writes when ``enable_thinking`` is false (FLUX.2 [klein] asks for that).
QWEN3_CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                       "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                       "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
                       "{% endif %}{% endif %}")


def tiny_qwen3_tokenizer() -> Qwen2Tokenizer:
    """:func:`tiny_qwen_tokenizer` with a Qwen3 chat template."""
    tokenizer = tiny_qwen_tokenizer()
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    return tokenizer


def text_hidden_layers_read(pipeline_class) -> int:
    """How many hidden layers the pipeline reads from its text encoder: FLUX.2 [klein] stacks the hidden states of
    layers 9, 18 and 27 (its ``encode_prompt``'s default ``text_encoder_out_layers``), so 27; else 1."""
    parameter = inspect.signature(pipeline_class.encode_prompt).parameters.get("text_encoder_out_layers")
    return max(parameter.default) if parameter is not None else 1


def tiny_qwen3_config(tokenizer, hidden: int, layers: int) -> Qwen3Config:
    return Qwen3Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2, head_dim=hidden // 2,
                       max_position_embeddings=512, **qwen_special_ids(tokenizer))


def build_tiny_flux2() -> Flux2KleinPipeline:
    """FLUX.2 [klein]-like, undistilled (CFG allowed): a tiny Qwen3 causal LM deep enough for the hidden layers the
    pipeline stacks, the FLUX.2 VAE (2x2 patchified latents, batch-norm statistics, set to non-trivial values
    here) and a dynamically shifted scheduler."""
    tokenizer, text_hidden, z_dim = tiny_qwen3_tokenizer(), 16, 4
    text_encoder = Qwen3ForCausalLM(tiny_qwen3_config(tokenizer, text_hidden,
                                                      text_hidden_layers_read(Flux2KleinPipeline)))
    vae = AutoencoderKLFlux2(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                             up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, latent_channels=z_dim,
                             norm_num_groups=4, sample_size=32, use_quant_conv=False, use_post_quant_conv=False)
    channels = vae.bn.num_features
    vae.bn.running_mean.copy_(torch.linspace(-0.3, 0.3, channels))
    vae.bn.running_var.copy_(torch.linspace(0.5, 2.0, channels))
    transformer = Flux2Transformer2DModel(patch_size=1, in_channels=channels, num_layers=1, num_single_layers=2,
                                          attention_head_dim=16, num_attention_heads=2,
                                          joint_attention_dim=3 * text_hidden, timestep_guidance_channels=32,
                                          axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True)
    return Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                              transformer=transformer, is_distilled=False)


def draw_pad_tokens(transformer: torch.nn.Module) -> None:
    """Draw from the random stream the learned pad tokens diffusers creates with ``torch.empty`` (Z-Image's
    ``x_pad_token`` and ``cap_pad_token``, whose memory may hold NaN); other transformers have none."""
    for name, param in transformer.named_parameters():
        if name.endswith("pad_token"):
            torch.nn.init.normal_(param)


def build_tiny_zimage() -> ZImagePipeline:
    """Z-Image-Turbo-like: a tiny Qwen3 encoder, a KL VAE with FLUX-style scaling and shift, the variable-length
    caption transformer (its pad tokens, ``torch.empty`` in diffusers, drawn from the seed) and Turbo's
    scheduler settings (static shift 3)."""
    tokenizer, text_hidden, z_dim = tiny_qwen3_tokenizer(), 16, 4
    transformer = ZImageTransformer2DModel(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=z_dim, dim=32,
                                           n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2,
                                           cap_feat_dim=text_hidden, axes_dims=[8, 4, 4], axes_lens=[256, 32, 32])
    draw_pad_tokens(transformer)
    return ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=tiny_vae(z_dim),
                          text_encoder=Qwen3Model(tiny_qwen3_config(tokenizer, text_hidden, 2)), tokenizer=tokenizer,
                          transformer=transformer)


def build_bench_sd3() -> StableDiffusion3Pipeline:
    """A 31M-parameter SD3 transformer (6 joint blocks of width 384) with tiny-sd3's text encoders and
    VAE and a 16-token CLIP context: large enough that the benchmarks (``jagg_core.bench``) are
    compute-bound on a CPU. Pair it with ``model.max_sequence_length=16`` (the zero T5 padding)."""
    return tiny_sd3_pipeline(num_layers=6, heads=6, head_dim=64, context_length=16)


TINY_BUILDERS = {"tiny-sd3": build_tiny_sd3, "tiny-flux": build_tiny_flux, "tiny-qwen": build_tiny_qwen,
                 "bench-sd3-31m": build_bench_sd3, "tiny-wan": build_tiny_wan,
                 "tiny-flux2": build_tiny_flux2, "tiny-zimage": build_tiny_zimage,
                 "tiny-flux-kontext": build_tiny_flux_kontext, "tiny-qwen-edit": build_tiny_qwen_edit}


def build_tiny_pipeline(name: str, seed: int = 0):
    """Build the tiny pipeline ``name`` (``tiny-sd3``, ...) with weights drawn from ``seed``."""
    if name not in TINY_BUILDERS:
        raise UserError(f"unknown tiny model '{name}'; available: {', '.join(TINY_BUILDERS)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TINY_BUILDERS[name]()
