"""Real architectures with random weights, built in memory from the configs shipped in :mod:`jagg_core.archs`.

``model.name = random:<arch>`` (e.g. ``random:flux-dev``) or ``random:<arch>@<layers>`` gives a real diffusers
pipeline (``StableDiffusion3Pipeline``, ``FluxPipeline``, ``QwenImagePipeline``, ``Flux2KleinPipeline``,
``ZImagePipeline``, ``WanPipeline``, ...) in which

- the **transformer** is the arch's own (``transformer/config.json`` of the Hub repo) with seeded random
  weights, its depth optionally cut to ``layers`` blocks: SD3.5 keeps the same share of dual-attention
  blocks (the first ones, as in SD3.5-Medium), FLUX splits the blocks between double- and single-stream in
  the real model's proportion (19 : 38), at least one of each;
- the **VAE** and the **scheduler** are the arch's own (random VAE weights, the real scheduler config);
- the **text encoders** are width-true stand-ins: the real classes with the real hidden and projection
  sizes (CLIP-L 768, OpenCLIP-bigG 1280, T5-XXL and UMT5-XXL 4096, Qwen2.5-VL 3584, the real attention widths; Qwen3-4B
  2560 and Mistral Small 3.1 5120 with two query heads of the real head size), so the conditioning tensors have the
  real shapes, but one layer (Qwen3 and Mistral3: as many as the pipeline reads, FLUX.2 [klein] 27, [dev] 30), a small feed-forward, and the in-memory
  character tokenizers of :mod:`jagg_core.models.in_memory_parts` (nothing is downloaded; the token sequences are
  longer than real ones for the same prompt, the tensors' lengths are fixed by the pipeline's
  ``max_sequence_length`` padding as with real tokenizers);
- an **image encoder** (Wan 2.1 image-to-video's CLIP ViT-H/14) is a stand-in of the same kind, the real width,
  heads and patches with one layer, beside the arch's own image processor.

So the transformer's compute and memory, for any resolution and depth, are those of the real model, and its
LoRA targets are the real module names: what the benchmarks and memory plans of real models need, on any
machine, with no access to gated weights. The images are noise.
"""

from __future__ import annotations

import json
from contextlib import contextmanager

import diffusers
import torch
import transformers
from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE as FLUX2_SYSTEM_MESSAGE

from ..archs import arch_folder, parse_random_model, with_depth
from ..model_index import pipeline_settings
from ..rng import forked_rng
from .quantize import DENOISER_COMPONENTS
from .in_memory_parts import (TINY_PIXTRAL_VISION, draw_pad_tokens, qwen_special_ids, qwen_vision_ids,
                              text_hidden_layers_read, tiny_clip_tokenizer, tiny_mistral_tokenizer,
                              tiny_qwen3_tokenizer, tiny_qwen_edit_tokenizer, tiny_qwen_processor, tiny_qwen_tokenizer,
                              tiny_t5_tokenizer)

#: feed-forward width of the stand-in text encoders (their one layer)
STAND_IN_INTERMEDIATE = 256
#: attention heads of the T5 stand-in (T5-XXL: 64 heads of 64); the output width stays d_model
STAND_IN_T5_HEADS = 2
#: query heads of the Qwen3 stand-in (one key-value head); the real head dimension and output width stay
STAND_IN_QWEN3_HEADS = 2


def _component_class(library: str, name: str):
    return getattr(diffusers if library == "diffusers" else transformers, name)


def _real_config(folder, component: str) -> transformers.PretrainedConfig:
    """The shipped transformers config, without its ``torch_dtype`` (the stored weights' dtype, which transformers
    would otherwise create parts of the model in)."""
    config = transformers.AutoConfig.from_pretrained(folder / component)
    config.dtype = None
    return config


def clip_stand_in(folder, component: str, model_class, vocab_size: int):
    """The CLIP text encoder of ``component`` at its real width and head count, one layer, character vocab."""
    config = _real_config(folder, component)
    config.update({"num_hidden_layers": 1, "intermediate_size": STAND_IN_INTERMEDIATE, "vocab_size": vocab_size,
                   "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1})
    return model_class(config)


def t5_stand_in(folder, component: str, model_class, vocab_size: int):
    """T5 (or UMT5, Wan's) encoder of the real ``d_model`` (and ``d_kv``), one layer, two heads, a small gated
    feed-forward."""
    config = _real_config(folder, component)
    config.update({"num_layers": 1, "num_decoder_layers": 1, "num_heads": STAND_IN_T5_HEADS,
                   "d_ff": STAND_IN_INTERMEDIATE, "vocab_size": vocab_size, "pad_token_id": 0, "eos_token_id": 1,
                   "decoder_start_token_id": 0})
    return model_class(config)


def qwen_vl_stand_in(folder, component: str, tokenizer):
    """Qwen2.5-VL with the real text width, heads and multimodal rotary sections, one layer, a small
    feed-forward and a tiny vision tower (it reads Qwen-Image-Edit's input image; text-only prompts leave it unused)."""
    real = _real_config(folder, component)
    text = real.text_config.to_dict()
    hidden = text["hidden_size"]
    text.update({"dtype": None, "num_hidden_layers": 1, "max_window_layers": 1, "layer_types": None,
                 "intermediate_size": STAND_IN_INTERMEDIATE, "vocab_size": len(tokenizer),
                 **qwen_special_ids(tokenizer)})
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": hidden}
    return transformers.Qwen2_5_VLForConditionalGeneration(type(real)(text_config=text, vision_config=vision,
                                                                      **qwen_vision_ids(tokenizer)))


def qwen3_stand_in(folder, component: str, model_class, tokenizer, layers: int):
    """Qwen3 (causal LM or bare model) with the real hidden width and head dimension, as many layers as the
    pipeline reads hidden states from (FLUX.2 [klein]: 27), two query heads and one key-value head (the real
    4B: 32 and 8) and a small feed-forward."""
    config = _real_config(folder, component).to_dict()
    config.update({"dtype": None, "num_hidden_layers": layers, "max_window_layers": layers, "layer_types": None,
                   "num_attention_heads": STAND_IN_QWEN3_HEADS, "num_key_value_heads": 1,
                   "intermediate_size": STAND_IN_INTERMEDIATE, "vocab_size": len(tokenizer),
                   **qwen_special_ids(tokenizer)})
    return model_class(transformers.Qwen3Config.from_dict(config))


def mistral3_stand_in(folder, component: str, tokenizer, layers: int):
    """Mistral3 (FLUX.2 [dev]'s Mistral Small 3.1) with the real text width and head dimension, as many layers as the
    pipeline reads hidden states from (30), two query heads and one key-value head (the real: 32 and 8), a small
    feed-forward and a tiny vision tower (text-only prompts leave it unused)."""
    real = _real_config(folder, component)
    text = real.text_config.to_dict()
    text.update({"dtype": None, "num_hidden_layers": layers, "num_attention_heads": STAND_IN_QWEN3_HEADS,
                 "num_key_value_heads": 1, "intermediate_size": STAND_IN_INTERMEDIATE, "vocab_size": len(tokenizer),
                 **qwen_special_ids(tokenizer)})
    return transformers.Mistral3ForConditionalGeneration(type(real)(text_config=text,
                                                                     vision_config=dict(TINY_PIXTRAL_VISION)))


def text_stand_ins(folder, index: dict) -> dict:
    """The pipeline's text encoders (stand-ins) and tokenizers (character vocabularies), by component name."""
    encoders = {name: _component_class(*spec) for name, spec in index.items()
                if name.startswith("text_encoder") and spec[0]}
    parts = {}
    for name, model_class in encoders.items():
        suffix = name.removeprefix("text_encoder")
        if model_class.__name__.startswith("CLIP"):
            tokenizer = tiny_clip_tokenizer()
            encoder = clip_stand_in(folder, name, model_class, len(tokenizer))
        elif model_class in (transformers.T5EncoderModel, transformers.UMT5EncoderModel):
            tokenizer = tiny_t5_tokenizer()
            encoder = t5_stand_in(folder, name, model_class, len(tokenizer))
        elif model_class is transformers.Qwen2_5_VLForConditionalGeneration and "processor" in index:  # edit
            tokenizer = tiny_qwen_edit_tokenizer()
            encoder = qwen_vl_stand_in(folder, name, tokenizer)
            parts["processor"] = tiny_qwen_processor(tokenizer)
        elif model_class is transformers.Qwen2_5_VLForConditionalGeneration:
            tokenizer = tiny_qwen_tokenizer()
            encoder = qwen_vl_stand_in(folder, name, tokenizer)
        elif model_class is transformers.Mistral3ForConditionalGeneration:
            tokenizer = tiny_mistral_tokenizer(FLUX2_SYSTEM_MESSAGE)
            layers = text_hidden_layers_read(getattr(diffusers, index["_class_name"]))
            encoder = mistral3_stand_in(folder, name, tokenizer, layers)
        elif model_class in (transformers.Qwen3ForCausalLM, transformers.Qwen3Model):
            tokenizer = tiny_qwen3_tokenizer()
            layers = text_hidden_layers_read(getattr(diffusers, index["_class_name"]))
            encoder = qwen3_stand_in(folder, name, model_class, tokenizer, layers)
        else:
            raise ValueError(f"no stand-in for the text encoder {model_class.__name__} of {folder.name}")
        parts[name], parts["tokenizer" + suffix] = encoder, tokenizer
    return parts


def image_stand_ins(folder, index: dict) -> dict:
    """The pipeline's image encoder (Wan 2.1 image-to-video's CLIP vision tower), if it has one, at its real width,
    heads and patches (so its states have the real shape) with one layer and a small feed-forward, and its image
    processor from the arch's own config."""
    if (index.get("image_encoder") or [None])[0] is None:
        return {}
    config = _real_config(folder, "image_encoder")
    config.update({"num_hidden_layers": 1, "intermediate_size": STAND_IN_INTERMEDIATE})
    return {"image_encoder": _component_class(*index["image_encoder"])(config),
            "image_processor": _component_class(*index["image_processor"]).from_pretrained(folder / "image_processor")}


@contextmanager
def _creating(device: torch.device, dtype: torch.dtype):
    """New tensors on ``device`` in ``dtype`` (weights are created in their final precision: a 20B transformer
    never exists in float32)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def build_random_pipeline(arch: str, layers: int | None = None, seed: int = 0, *,
                          device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    """The diffusers pipeline of ``arch`` (see the module docstring) with weights drawn from ``seed``, created
    on ``device`` (``meta`` for sizes only) in ``dtype``; ``layers`` cuts the transformer's depth."""
    folder = arch_folder(arch)
    index = json.loads((folder / "model_index.json").read_text())
    pipeline_class = getattr(diffusers, index["_class_name"])
    vae_class = _component_class(*index["vae"])
    denoisers = [name for name in DENOISER_COMPONENTS if (index.get(name) or [None])[0] is not None]
    device = torch.device(device)
    with forked_rng(device):
        torch.manual_seed(seed)
        with _creating(device, dtype):
            components = {"transformer": _random_transformer(folder, "transformer", index, layers),
                          "vae": vae_class.from_config(vae_class.load_config(folder / "vae")),
                          **text_stand_ins(folder, index), **image_stand_ins(folder, index)}
            components.update({name: _random_transformer(folder, name, index, layers) for name in denoisers[1:]})
            for name in denoisers:
                draw_pad_tokens(components[name])
    for name in (*denoisers, "vae"):  # buffers made in float32 (SD3's position table) too, as from_pretrained
        components[name].to(dtype=dtype)
    scheduler = _component_class(*index["scheduler"]).from_pretrained(folder, subfolder="scheduler")
    return pipeline_class(scheduler=scheduler, **components, **pipeline_settings(index))


def _random_transformer(folder, name: str, index: dict, layers: int | None):
    """The pipeline's transformer ``name`` (a two-expert model's ``transformer_2`` too, drawn after the other parts)
    from its config, ``layers`` blocks deep when given."""
    transformer_class = _component_class(*index[name])
    config = transformer_class.load_config(folder / name)
    return transformer_class.from_config(with_depth(config, layers) if layers is not None else config)


def build_random_model_pipeline(name: str, seed: int = 0, **kwargs):
    """:func:`build_random_pipeline` for a ``model.name`` of the form ``random:<arch>[@<layers>]``."""
    arch, layers = parse_random_model(name)
    return build_random_pipeline(arch, layers, seed, **kwargs)

