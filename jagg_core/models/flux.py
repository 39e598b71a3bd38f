"""FLUX.1 dev and schnell (``FluxPipeline``): packed latents, timestep = sigma, guidance embedding.

Conditioning: T5 token states (``prompt_embeds`` [B, L, D]) and the pooled CLIP state
(``pooled_projections`` [B, D']). Text token ids are all zero and image token ids are the
(0, row, col) grid of the packed latent, both 2-D ([L, 3], [seq, 3]) as diffusers expects.
FLUX.1-dev is guidance-distilled: its transformer embeds ``guidance = model.flux_guidance``;
schnell has no guidance embedding. ``model.guidance_scale > 1`` adds the pipeline's "true CFG"
with ``model.negative_prompt`` (the base class's ``v_neg + g (v_pos - v_neg)``).
"""

from __future__ import annotations

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from transformers import CLIPTextModel, T5Config, T5EncoderModel

from ..config import ModelConfig
from ..errors import UserError
from .base import Conditioning, PackedFlowModel, decode_scaled
from .family import Family
from .in_memory_parts import CLIP_HIDDEN, tiny_clip_config, tiny_clip_tokenizer, tiny_t5_tokenizer, tiny_vae
from .text_windows import MAX_SEQUENCE_LENGTH, TextWindow, tokens_of

#: FluxPipeline.check_inputs rejects longer T5 sequences.
MAX_T5_TOKENS = 512


class FluxModel(PackedFlowModel):
    family = "flux"
    #: As diffusers' FLUX LoRA training script (examples/dreambooth/train_dreambooth_lora_flux.py).
    default_lora_targets = ("attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0",
                            "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
                            "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2")

    def __init__(self, pipe, config: ModelConfig, device: torch.device | str = "cpu", **placement):
        if config.max_sequence_length > MAX_T5_TOKENS:
            raise UserError(f"model.max_sequence_length is {config.max_sequence_length}; "
                            f"FLUX allows at most {MAX_T5_TOKENS}")
        super().__init__(pipe, config, device, **placement)

    def encode_without_cfg(self, prompts: list[str]) -> Conditioning:
        embeds, pooled, _text_ids = self.pipe.encode_prompt(prompt=prompts, prompt_2=None, device=self.device,
                                                            max_sequence_length=self.config.max_sequence_length)
        return {"prompt_embeds": embeds, "pooled_projections": pooled}

    def text_windows(self) -> list[TextWindow]:
        """CLIP's pooled state reads the prompt's first 77 tokens, T5 ``model.max_sequence_length``."""
        return [TextWindow("CLIP", self.pipe.tokenizer_max_length, tokens_of(self.pipe.tokenizer)),
                TextWindow("T5", self.config.max_sequence_length, tokens_of(self.pipe.tokenizer_2),
                           MAX_SEQUENCE_LENGTH)]

    def token_velocity(self, tokens: torch.Tensor, grid: tuple[int, int], sigma: torch.Tensor,
                       cond: Conditioning) -> torch.Tensor:
        return self.flux_forward(tokens, sigma, cond, self.image_ids(grid, tokens.device))

    def image_ids(self, grid: tuple[int, int], device: torch.device) -> torch.Tensor:
        """The ``(0, row, col)`` ids [rows cols, 3] of a ``grid`` of ``(rows, cols)`` tokens, row by row."""
        return self.pipe._prepare_latent_image_ids(1, *grid, device, self.transformer.dtype)

    def flux_forward(self, z: torch.Tensor, sigma: torch.Tensor, cond: Conditioning,
                     image_ids: torch.Tensor) -> torch.Tensor:
        """The transformer's output for the image tokens ``z`` at the positions ``image_ids``."""
        dtype = self.transformer.dtype
        embeds = cond["prompt_embeds"]
        text_ids = torch.zeros(embeds.shape[1], 3, device=z.device, dtype=dtype)
        return self.transformer(hidden_states=z.to(dtype), timestep=sigma.to(dtype), guidance=self.guidance(z),
                                pooled_projections=cond["pooled_projections"].to(dtype),
                                encoder_hidden_states=embeds.to(dtype), txt_ids=text_ids, img_ids=image_ids,
                                return_dict=False)[0].float()

    def conditioning_shapes(self) -> dict[str, tuple[int, ...]]:
        config = self.transformer.config
        return {"prompt_embeds": (self.config.max_sequence_length, config.joint_attention_dim),
                "pooled_projections": (config.pooled_projection_dim,)}

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """``x = vae.decode(unpack(z) / scaling_factor + shift_factor)``, mapped from [-1, 1] to [0, 1]."""
        return decode_scaled(self.pipe.vae, self.unpacked(z))


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


FAMILY = Family(label="FLUX.1", pipeline="FluxPipeline", model=FluxModel, tiny_builders={"tiny-flux": build_tiny_flux},
                archs={"flux-dev": "black-forest-labs/FLUX.1-dev",
                       "flux-schnell": "black-forest-labs/FLUX.1-schnell"},
                cfg_argument="true_cfg_scale", guidance_argument="guidance_scale")
