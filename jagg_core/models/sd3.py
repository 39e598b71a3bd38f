"""Stable Diffusion 3 / 3.5 (``StableDiffusion3Pipeline``): latents [C, H/f, W/f], timestep = 1000 sigma."""

from __future__ import annotations

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

from ..image_size import ImageSize
from .base import NEGATIVE, Conditioning, FlowModel, decode_scaled
from .family import Family
from .in_memory_parts import CLIP_HIDDEN, tiny_clip_text_encoder, tiny_clip_tokenizer, tiny_vae
from .text_windows import MAX_SEQUENCE_LENGTH, TextWindow, tokens_of


class SD3Model(FlowModel):
    family = "sd3"
    default_lora_targets = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                            "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out")

    def encode_prompts(self, prompts: list[str]) -> Conditioning:
        embeds, neg_embeds, pooled, neg_pooled = self.pipe.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=self.device,
            do_classifier_free_guidance=self.use_cfg,
            negative_prompt=[self.config.negative_prompt] * len(prompts) if self.use_cfg else None,
            max_sequence_length=self.config.max_sequence_length)
        cond = {"prompt_embeds": embeds, "pooled_projections": pooled}
        if self.use_cfg:
            cond.update({NEGATIVE + "prompt_embeds": neg_embeds, NEGATIVE + "pooled_projections": neg_pooled})
        return cond

    def text_windows(self) -> list[TextWindow]:
        """CLIP-L and CLIP-G read the prompt's first 77 tokens (one tokenizer), T5, where the model has it,
        ``model.max_sequence_length``."""
        windows = [TextWindow("CLIP", self.pipe.tokenizer_max_length, tokens_of(self.pipe.tokenizer))]
        if self.pipe.tokenizer_3 is not None:
            windows.append(TextWindow("T5", self.config.max_sequence_length, tokens_of(self.pipe.tokenizer_3),
                                      MAX_SEQUENCE_LENGTH))
        return windows

    def conditioning_shapes(self) -> dict[str, tuple[int, ...]]:
        """CLIP states padded to the joint width (the CLIP context, 77 without a tokenizer) followed by the
        ``max_sequence_length`` T5 states (zeros without T5), and the pooled CLIP-L + CLIP-G projections."""
        config = self.transformer.config
        clip_tokens = self.pipe.tokenizer.model_max_length if self.pipe.tokenizer is not None else 77
        return {"prompt_embeds": (clip_tokens + self.config.max_sequence_length, config.joint_attention_dim),
                "pooled_projections": (config.pooled_projection_dim,)}

    def latent_shape(self, size: ImageSize) -> tuple[int, ...]:
        return (self.transformer.config.in_channels, *size.latent(self.pipe.vae_scale_factor))

    def largest_size(self) -> tuple[ImageSize, str] | None:
        """``pos_embed_max_size`` patches a side (SD3.5 Medium 384: 6144 px; the embedded shapes model 8: 32 px)."""
        config = self.transformer.config
        if config.pos_embed_max_size is None:
            return None
        side = config.pos_embed_max_size * config.patch_size * self.pipe.vae_scale_factor
        return (ImageSize.square(side), f"its position embedding covers {config.pos_embed_max_size} patches a side "
                "(pos_embed_max_size)")

    def image_seq_len(self, size: ImageSize) -> int:
        return size.tokens(self.pipe.vae_scale_factor * self.transformer.config.patch_size)

    def transformer_velocity(self, z: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        dtype = self.transformer.dtype
        return self.transformer(hidden_states=z.to(dtype), timestep=(sigma * 1000).to(dtype),
                                encoder_hidden_states=cond["prompt_embeds"].to(dtype),
                                pooled_projections=cond["pooled_projections"].to(dtype),
                                return_dict=False)[0].float()

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return decode_scaled(self.pipe.vae, z)


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


def build_bench_sd3() -> StableDiffusion3Pipeline:
    """A 31M-parameter SD3 transformer (6 joint blocks of width 384) with tiny-sd3's text encoders and
    VAE and a 16-token CLIP context: large enough that the benchmarks (``jagg_core.bench``) are
    compute-bound on a CPU. Pair it with ``model.max_sequence_length=16`` (the zero T5 padding)."""
    return tiny_sd3_pipeline(num_layers=6, heads=6, head_dim=64, context_length=16)


FAMILY = Family(label="SD3/SD3.5", pipeline="StableDiffusion3Pipeline", model=SD3Model,
                tiny_builders={"tiny-sd3": build_tiny_sd3, "bench-sd3-31m": build_bench_sd3},
                archs={"sd35-medium": "stabilityai/stable-diffusion-3.5-medium",
                       "sd35-large": "stabilityai/stable-diffusion-3.5-large"})
