"""Stable Diffusion 3 / 3.5 (``StableDiffusion3Pipeline``): latents [C, H/f, W/f], timestep = 1000 sigma."""

from __future__ import annotations

import torch

from .base import NEGATIVE, Conditioning, FlowModel, decode_scaled


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

    def conditioning_shapes(self) -> dict[str, tuple[int, ...]]:
        """CLIP states padded to the joint width (the CLIP context, 77 without a tokenizer) followed by the
        ``max_sequence_length`` T5 states (zeros without T5), and the pooled CLIP-L + CLIP-G projections."""
        config = self.transformer.config
        clip_tokens = self.pipe.tokenizer.model_max_length if self.pipe.tokenizer is not None else 77
        return {"prompt_embeds": (clip_tokens + self.config.max_sequence_length, config.joint_attention_dim),
                "pooled_projections": (config.pooled_projection_dim,)}

    def latent_shape(self, resolution: int) -> tuple[int, ...]:
        size = resolution // self.pipe.vae_scale_factor
        return (self.transformer.config.in_channels, size, size)

    def image_seq_len(self, resolution: int) -> int:
        return (resolution // self.pipe.vae_scale_factor // self.transformer.config.patch_size) ** 2

    def transformer_velocity(self, z: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        dtype = self.transformer.dtype
        return self.transformer(hidden_states=z.to(dtype), timestep=(sigma * 1000).to(dtype),
                                encoder_hidden_states=cond["prompt_embeds"].to(dtype),
                                pooled_projections=cond["pooled_projections"].to(dtype),
                                return_dict=False)[0].float()

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return decode_scaled(self.pipe.vae, z)
