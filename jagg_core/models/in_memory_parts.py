"""Parts of in-memory pipelines that need no downloaded file: character tokenizers, small text encoders, a small
VAE. The tiny test models (each family file's ``tiny_builders``) are built from them, and the random-weight models
(:mod:`.random_weights`) take their tokenizers and some settings from them.

Weights are random (drawn by the caller's seed); the tokenizers are built from an in-memory character vocabulary,
so every prompt tokenizes without any downloaded file.
"""

from __future__ import annotations

import inspect
import string

import torch
from diffusers import AutoencoderKL
from tokenizers import pre_tokenizers
from transformers import (CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer, Mistral3Config,
                          Mistral3ForConditionalGeneration, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration,
                          Qwen2Tokenizer, Qwen2VLImageProcessorPil, Qwen2VLProcessor, Qwen3Config, T5Tokenizer)

#: width of the tiny CLIP text encoders
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


def tiny_t5_tokenizer() -> T5Tokenizer:
    """A Unigram (SentencePiece-style) T5 tokenizer over single characters; ``▁`` marks word starts."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -3.0) for c in string.ascii_letters + string.digits + string.punctuation]
    return T5Tokenizer(vocab=pieces, extra_ids=0)


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


#: Mistral's instruction format for the system and user turns of a conversation (what ``apply_chat_template`` needs
#: for Flux2Pipeline's text-only messages, whose contents are lists of text parts)
MISTRAL_CHAT_TEMPLATE = ("{% for message in messages %}{% for part in message['content'] %}"
                         "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{{ part['text'] }}[/SYSTEM_PROMPT]"
                         "{% else %}[INST]{{ part['text'] }}[/INST]{% endif %}{% endfor %}{% endfor %}")


def tiny_mistral_tokenizer(system_message: str) -> Qwen2Tokenizer:
    """A byte-level BPE tokenizer for Flux2Pipeline's Mistral encoder: :func:`tiny_qwen_tokenizer` with Mistral's
    turn markers, each word of ``system_message`` (the pipeline's) one token, and the chat template above."""
    tokenizer = tiny_qwen_tokenizer(system_message, ("[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[INST]", "[/INST]"))
    tokenizer.chat_template = MISTRAL_CHAT_TEMPLATE
    return tokenizer


#: a one-block Pixtral vision tower: Mistral3's, unused by text-only prompts (the tiny and the random-weight encoders)
TINY_PIXTRAL_VISION = {"model_type": "pixtral", "hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "head_dim": 8, "image_size": 56, "patch_size": 14}


def tiny_mistral3_encoder(tokenizer, hidden: int, layers: int) -> Mistral3ForConditionalGeneration:
    """A Mistral3 (Mistral Small 3.1's class) of ``layers`` tiny layers, for the tokenizer's vocabulary, with a
    one-block Pixtral vision tower (text-only prompts leave it unused)."""
    return Mistral3ForConditionalGeneration(Mistral3Config(
        text_config={"model_type": "mistral", "vocab_size": len(tokenizer), "hidden_size": hidden,
                     "intermediate_size": 2 * hidden, "num_hidden_layers": layers, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "head_dim": hidden // 2, "max_position_embeddings": 1024,
                     **qwen_special_ids(tokenizer)},
        vision_config=dict(TINY_PIXTRAL_VISION)))


def text_hidden_layers_read(pipeline_class) -> int:
    """How many hidden layers the pipeline reads from its text encoder: FLUX.2 [klein] stacks the hidden states of
    layers 9, 18 and 27 (its ``encode_prompt``'s default ``text_encoder_out_layers``), so 27; else 1."""
    parameter = inspect.signature(pipeline_class.encode_prompt).parameters.get("text_encoder_out_layers")
    return max(parameter.default) if parameter is not None else 1


def tiny_qwen3_config(tokenizer, hidden: int, layers: int) -> Qwen3Config:
    return Qwen3Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2, head_dim=hidden // 2,
                       max_position_embeddings=512, **qwen_special_ids(tokenizer))


def draw_pad_tokens(transformer: torch.nn.Module) -> None:
    """Draw from the random stream the learned pad tokens diffusers creates with ``torch.empty`` (Z-Image's
    ``x_pad_token`` and ``cap_pad_token``, whose memory may hold NaN); other transformers have none."""
    for name, param in transformer.named_parameters():
        if name.endswith("pad_token"):
            torch.nn.init.normal_(param)
