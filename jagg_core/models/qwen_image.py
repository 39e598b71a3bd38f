"""Qwen-Image (``QwenImagePipeline``): packed latents of a video-style VAE, masked text, true CFG.

Conditioning: Qwen2.5-VL hidden states of the prompt (template prefix dropped by the pipeline)
and their mask. The pipeline pads a batch to its longest prompt; here every prompt is padded to
``model.max_sequence_length`` (mask 0) so that the per-prompt cache concatenates, and each
transformer call trims the padding columns no sample uses. Text tokens take rotary positions
after the image grid in order, and padded keys are masked out, so padding changes nothing.

Guidance is the pipeline's "true CFG" (``true_cfg_scale = model.guidance_scale`` with
``model.negative_prompt``), including its per-token norm rescale, see :meth:`guide`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline
from diffusers import QwenImageTransformer2DModel

from ..errors import UserError
from .base import Conditioning, PackedFlowModel
from .family import Family
from .in_memory_parts import TINY_QWEN_TEXT_HIDDEN, tiny_qwen_tokenizer, tiny_qwen_vl_encoder
from .text_windows import MAX_SEQUENCE_LENGTH, TextWindow


class QwenImageModel(PackedFlowModel):
    family = "qwen-image"
    # default_lora_targets: the base class's to_q/to_k/to_v/to_out.0, as diffusers'
    # examples/dreambooth/train_dreambooth_lora_qwen_image.py.

    def encode_without_cfg(self, prompts: list[str]) -> Conditioning:
        embeds, mask = self.pipe.encode_prompt(prompt=prompts, device=self.device,
                                               max_sequence_length=self.config.max_sequence_length)
        return self.padded_text(embeds, mask)

    @property
    def text_length(self) -> int:
        """Text tokens every prompt is padded to: ``model.max_sequence_length``."""
        return self.config.max_sequence_length

    def text_windows(self) -> list[TextWindow]:
        """Qwen2.5-VL's states of ``model.max_sequence_length`` tokens are kept, counted after the template's
        opening tokens the pipeline drops (the pipeline cuts the rest)."""
        return [TextWindow("Qwen2.5-VL", self.config.max_sequence_length, self.text_tokens, MAX_SEQUENCE_LENGTH)]

    def text_tokens(self, texts: list[str]) -> list[int]:
        """Each text's tokens in the pipeline's template (``prompt_template_encode``) less the
        ``prompt_template_encode_start_idx`` it drops and the :meth:`image_placeholders`."""
        templated = [self.pipe.prompt_template_encode.format(self.text_with_images(text)) for text in texts]
        dropped = self.pipe.prompt_template_encode_start_idx + self.image_placeholders()
        return [len(ids) - dropped for ids in self.pipe.tokenizer(templated)["input_ids"]] if texts else []

    def text_with_images(self, text: str) -> str:
        """What the template frames: the prompt (an editing family puts its pictures before it)."""
        return text

    def image_placeholders(self) -> int:
        """Tokens of the template that stand for input images (the vision tokens come on top of the window)."""
        return 0

    def padded_text(self, embeds: torch.Tensor, mask: torch.Tensor | None) -> Conditioning:
        """The encoder's states and mask padded to :attr:`text_length` tokens (mask 0)."""
        if mask is None:  # the pipeline drops an all-ones mask
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        pad = self.text_length - embeds.shape[1]
        if pad < 0:
            raise UserError(f"a prompt takes {embeds.shape[1]} text tokens, more than the {self.text_length} this "
                            "model is given; raise model.max_sequence_length or shorten the prompt")
        return {"prompt_embeds": F.pad(embeds, (0, 0, 0, pad)), "prompt_embeds_mask": F.pad(mask, (0, pad))}

    def token_velocity(self, tokens: torch.Tensor, grid: tuple[int, int], sigma: torch.Tensor,
                       cond: Conditioning) -> torch.Tensor:
        return self.qwen_forward(tokens, sigma, cond, [(1, *grid)])

    def qwen_forward(self, z: torch.Tensor, sigma: torch.Tensor, cond: Conditioning,
                     img_shapes: list[tuple[int, int, int]]) -> torch.Tensor:
        """The transformer's output for the image tokens ``z``, laid out as ``img_shapes`` (frames, rows, cols of
        each image in the sequence). Without ``prompt_embeds_mask`` every text token is attended (the memory plan's
        upper bound)."""
        dtype = self.transformer.dtype
        embeds, mask = cond["prompt_embeds"], cond.get("prompt_embeds_mask")
        if mask is not None:
            mask = mask.bool()
            used = int(mask.any(dim=0).nonzero().max()) + 1
            embeds, mask = embeds[:, :used], mask[:, :used]
            mask = None if bool(mask.all()) else mask
        return self.transformer(hidden_states=z.to(dtype), timestep=sigma.to(dtype),
                                encoder_hidden_states=embeds.to(dtype), encoder_hidden_states_mask=mask,
                                img_shapes=[img_shapes] * z.shape[0], return_dict=False)[0].float()

    def conditioning_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"prompt_embeds": (self.text_length, self.transformer.config.joint_attention_dim)}

    def guide(self, v_neg: torch.Tensor, v_pos: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """QwenImagePipeline's true CFG: ``c = v_neg + g (v_pos - v_neg)``, rescaled per token to the
        conditional norm, ``v = c * ||v_pos|| / ||c||`` (norms over the channel axis)."""
        combined = super().guide(v_neg, v_pos, sigma)
        return combined * (v_pos.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """``x = vae.decode(unpack(z) * std + mean)[:, :, frame 0]`` (per-channel latent statistics),
        mapped from [-1, 1] to [0, 1]."""
        vae = self.pipe.vae
        latents = self.unpacked(z)  # [B, C, 1, h, w]
        stats = {"device": latents.device, "dtype": latents.dtype}
        mean = torch.tensor(vae.config.latents_mean, **stats).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std, **stats).view(1, -1, 1, 1, 1)
        images = vae.decode((latents * std + mean).to(vae.dtype), return_dict=False)[0][:, :, 0]
        return (images.float() / 2 + 0.5).clamp(0, 1)


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


FAMILY = Family(label="Qwen-Image", pipeline="QwenImagePipeline", model=QwenImageModel,
                tiny_builders={"tiny-qwen": build_tiny_qwen},
                archs={"qwen-image": "Qwen/Qwen-Image", "qwen-image-2512": "Qwen/Qwen-Image-2512"},
                cfg_argument="true_cfg_scale")
