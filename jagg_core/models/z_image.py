"""Z-Image (``ZImagePipeline``): latents [C, H/f, W/f], captions of variable length, reversed time and velocity.

- **Conditioning.** The second-to-last Qwen3 hidden states of the chat-templated prompt, its padding dropped: the
  pipeline hands the transformer a list of [L_i, D] tensors. Here every prompt is padded to
  ``model.max_sequence_length`` with a mask (``prompt_embeds`` [B, L, D], ``prompt_embeds_mask`` [B, L]) so that
  the per-prompt cache concatenates; each transformer call gives the transformer the list of the unpadded
  captions again, so the padding changes nothing.
- **Batching.** The transformer takes lists: the batch of latents [B, C, h, w] is given as B tensors
  [C, 1, h, w] (one frame) and its output stacked back.
- **Time and sign.** The transformer is called with ``t = 1 - sigma`` (it scales by ``t_scale`` = 1000 itself)
  and predicts ``x0 - noise``, the negative of our velocity: ``v = -transformer(...)``.
- **Schedule.** ``sigmas = linspace(1, 1/n, n)``, shifted by the scheduler (Z-Image-Turbo: static shift 3).
- **Guidance.** The pipeline's CFG is ``pos + s (pos - neg)`` with its ``guidance_scale`` s (0 = off, Turbo's
  setting): our ``v_neg + g (v_pos - v_neg)`` with ``g = s + 1``, so ``model.guidance_scale = 1`` is Turbo's
  unguided sampling and ``model.guidance_scale = 5`` the pipeline's ``guidance_scale = 4``. The pipeline's
  optional ``cfg_normalization`` and ``cfg_truncation`` are off by default and not reproduced.
- **Decode.** ``vae.decode(z / scaling_factor + shift_factor)`` (the FLUX.1 VAE), mapped to [0, 1].
"""

from __future__ import annotations

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
from torch.nn.utils.rnn import pad_sequence
from transformers import Qwen3Model

from ..image_size import ImageSize
from .base import NEGATIVE, Conditioning, FlowModel, decode_scaled, linspace_sigmas
from .family import Family
from .in_memory_parts import draw_pad_tokens, tiny_qwen3_config, tiny_qwen3_tokenizer, tiny_vae
from .text_windows import MAX_SEQUENCE_LENGTH, TextWindow, chat_tokens


def padded_captions(captions: list[torch.Tensor], length: int) -> Conditioning:
    """Variable-length captions [L_i, D] -> ``prompt_embeds`` [B, length, D] and ``prompt_embeds_mask`` [B, length]
    (1 on each caption's tokens)."""
    embeds = pad_sequence(captions, batch_first=True)
    embeds = torch.nn.functional.pad(embeds, (0, 0, 0, length - embeds.shape[1]))
    lengths = torch.tensor([len(caption) for caption in captions], device=embeds.device)
    mask = (torch.arange(length, device=embeds.device)[None] < lengths[:, None]).long()
    return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}


class ZImageModel(FlowModel):
    family = "z-image"
    # default_lora_targets: the base class's to_q/to_k/to_v/to_out.0, as diffusers'
    # examples/dreambooth/train_dreambooth_lora_z_image.py.

    def encode_prompts(self, prompts: list[str]) -> Conditioning:
        length = self.config.max_sequence_length
        negative = [self.config.negative_prompt] * len(prompts) if self.use_cfg else None
        # the pipeline writes the chat-templated text into the lists it is given: pass copies
        positive, negative = self.pipe.encode_prompt(prompt=list(prompts), negative_prompt=negative,
                                                     do_classifier_free_guidance=self.use_cfg, device=self.device,
                                                     max_sequence_length=length)
        cond = padded_captions(positive, length)
        if self.use_cfg:
            cond.update({NEGATIVE + k: v for k, v in padded_captions(negative, length).items()})
        return cond

    def text_windows(self) -> list[TextWindow]:
        """Qwen3 reads ``model.max_sequence_length`` tokens of the prompt in its chat template, thinking on (as the
        pipeline's ``_encode_prompt``)."""
        return [TextWindow("Qwen3", self.config.max_sequence_length,
                           chat_tokens(self.pipe.tokenizer, enable_thinking=True), MAX_SEQUENCE_LENGTH)]

    def conditioning_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every caption at the full ``max_sequence_length`` (the memory plan's upper bound, no mask)."""
        return {"prompt_embeds": (self.config.max_sequence_length, self.transformer.config.cap_feat_dim)}

    def latent_shape(self, size: ImageSize) -> tuple[int, ...]:
        """``[C, h, w]``, each side a whole number of the transformer's 2x2 patches, as the pipeline rounds it."""
        rows, cols = size.latent(self.pipe.vae_scale_factor * 2)
        return (self.transformer.config.in_channels, 2 * rows, 2 * cols)

    def largest_size(self) -> tuple[ImageSize, str] | None:
        """The rotary positions' rows and columns (``axes_lens``; Z-Image 512: 8192 px)."""
        _, rows, cols = self.transformer.config.axes_lens
        factor = self.pipe.vae_scale_factor * 2
        return (ImageSize(rows * factor, cols * factor), f"its rotary positions cover {rows} x {cols} patches "
                "(axes_lens)")

    def image_seq_len(self, size: ImageSize) -> int:
        return size.tokens(self.pipe.vae_scale_factor * 2)

    def schedule_kwargs(self, num_steps: int) -> dict:
        return linspace_sigmas(num_steps)

    def transformer_velocity(self, z: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """Without ``prompt_embeds_mask`` every caption token is attended (the memory plan's upper bound)."""
        dtype = self.transformer.dtype
        embeds, mask = cond["prompt_embeds"].to(dtype), cond.get("prompt_embeds_mask")
        captions = list(embeds) if mask is None else [e[m.bool()] for e, m in zip(embeds, mask)]
        frames = list(z.to(dtype).unsqueeze(2).unbind(0))  # B x [C, 1, h, w]
        out = self.transformer(frames, 1 - sigma.float(), captions, return_dict=False)[0]
        return -torch.stack(out).squeeze(2).float()

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return decode_scaled(self.pipe.vae, z)


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


FAMILY = Family(label="Z-Image", pipeline="ZImagePipeline", model=ZImageModel,
                tiny_builders={"tiny-zimage": build_tiny_zimage},
                archs={"z-image-turbo": "Tongyi-MAI/Z-Image-Turbo"}, depth_key="n_layers", cfg_offset=-1.0)
