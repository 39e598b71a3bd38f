"""Wan 2.1 image-to-video (``WanImageToVideoPipeline``: Wan2.1-I2V-14B-480P and -720P): a video that starts from an
input image, prompted by rows of a text and that image (:class:`~jagg_core.edit_prompts.EditPrompt`).

A row is encoded once, at set-up, as the pipeline encodes it:

* its text by UMT5, as Wan's text-to-video (:class:`~jagg_core.models.wan.WanModel`);
* its image ``x`` (centre-cropped and resized to ``model.condition_resolution``, which is ``sampling.resolution``:
  it is the video's first frame) by the CLIP ViT-H/14 image encoder, the penultimate layer's states
  (``image_embeds`` [257, 1280]; the pipeline's ``encode_image``, whose processor resizes the image's shorter side to
  224 and centre-crops it);
* the video ``[x, 0, ..., 0]`` of ``sampling.num_frames`` frames by the VAE (the posterior's mode, normalised with its
  per-channel statistics), after ``m = 4`` mask channels, one per frame of a latent frame (the VAE's temporal factor),
  1 on the first latent frame and 0 after it: ``video_condition = [m ; (E(video) - latents_mean) / latents_std]``
  [4 + C, F', h, w], the pipeline's ``condition``.

Every transformer call sees ``[z ; video_condition]`` along the channels (C + 4 + C = 36 input channels for C = 16)
at timestep ``1000 sigma``, its cross-attention reading the image's states before the text's (Wan 2.1 I2V's
``added_kv_proj``), and the velocity is the whole latent's: unlike Wan 2.2 TI2V-5B's, the first latent frame is
generated too (the image conditions it, nothing overwrites it), so the sampler's latent is the video's every latent
frame and decoding is Wan's. Under CFG the negative prompt's branch sees the same image states and video condition,
as in the pipeline. The CLIP image encoder is a prompt encoder: it sits on the device at set-up beside UMT5 and is
released with it (:data:`~jagg_core.models.base.PROMPT_ENCODERS`).

Wan 2.2 I2V-A14B has the same pipeline class, the same video condition and two experts (``transformer_2``, switched
at ``boundary_ratio`` 0.9 as in :class:`~jagg_core.models.wan.WanModel`), and no image encoder: its transformers
have no image cross-attention (``image_dim`` null), so the conditioning has no image states and the LoRA no
``add_k_proj``/``add_v_proj``, as in the pipeline.
"""

from __future__ import annotations

import torch
from PIL import Image
from diffusers import WanImageToVideoPipeline
from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

from .base import NEGATIVE, Conditioning
from .family import Family
from .wan import IMAGE_STATES, FirstFrameModel, tiny_wan21_vae, tiny_wan_pipeline

#: the pipeline's ``condition``: the first-frame mask's channels, then the video ``[x, 0, ..., 0]``'s latents
VIDEO_CONDITION = "video_condition"


class Wan21ImageToVideoModel(FirstFrameModel):
    """Wan 2.1 image-to-video (see the module docstring)."""

    family = "wan-i2v"
    generates_from_text_too = False

    @property
    def reads_image_states(self) -> bool:
        """Whether the transformer's cross-attention reads the image encoder's states (Wan 2.1's; not Wan 2.2
        I2V-A14B's, whose ``image_dim`` is null), as the pipeline decides."""
        return self.pipe.transformer.config.image_dim is not None

    @property
    def default_lora_targets(self) -> tuple[str, ...]:
        """Wan's targets (every block's self-attention and cross-attention to the text), and the keys and values its
        cross-attention reads the image's states through where it has them: diffusers' Wan loader takes an adapter
        with them as an image-to-video LoRA (one without them it pads with zero weights its peft config does not
        name, and warns)."""
        return (*FirstFrameModel.default_lora_targets, *(("add_k_proj", "add_v_proj") if self.reads_image_states else ()))

    def encode_prompts(self, prompts: list[str]) -> Conditioning:
        rows = self.rows(prompts)
        cond = super().encode_prompts(self.prompt_texts(rows))
        frames = self.first_frames(rows)
        if self.reads_image_states:
            cond[IMAGE_STATES] = self.image_states(frames)
        cond[VIDEO_CONDITION] = self.input_pixel_latents(self.preprocessed(frames))
        if self.use_cfg:
            cond.update({NEGATIVE + key: cond[key] for key in (IMAGE_STATES, VIDEO_CONDITION) if key in cond})
        return cond

    def image_states(self, frames: list[Image.Image]) -> torch.Tensor:
        """The image encoder's penultimate hidden states of each first frame, [N, tokens, width] (``encode_image``)."""
        encoder = self.pipe.image_encoder
        pixels = self.pipe.image_processor(images=frames, return_tensors="pt").pixel_values
        return encoder(pixel_values=pixels.to(self.device, encoder.dtype), output_hidden_states=True).hidden_states[-2]

    def input_pixel_latents(self, pixels: torch.Tensor) -> torch.Tensor:
        """Preprocessed first frames [N, 3, H, W] in [-1, 1] -> ``video_condition`` [N, 4 + C, F', h, w]: the mask,
        then the normalised latents of each video ``[x, 0, ..., 0]`` (the module docstring)."""
        count, channels, height, width = pixels.shape
        black = pixels.new_zeros((count, channels, self.num_frames - 1, height, width))
        video = torch.cat([pixels.unsqueeze(2), black], dim=2)
        latents = self.normalised_latents(video)
        mask = latents.new_zeros((count, self.pipe.vae_scale_factor_temporal, *latents.shape[2:]))
        mask[:, :, 0] = 1
        return torch.cat([mask, latents], dim=1)

    def conditioning_shapes(self) -> dict[str, tuple[int, ...]]:
        """The text's states, the image's where the transformer reads them (from the image encoder's config: a token
        a patch and the class token) and the video condition (before the prompt encoders are released)."""
        channels, frames, rows, cols = self.latent_shape(self.config.condition_size)
        shapes = {**super().conditioning_shapes(),
                  VIDEO_CONDITION: (self.pipe.vae_scale_factor_temporal + channels, frames, rows, cols)}
        if self.reads_image_states:
            encoder = self.pipe.image_encoder.config
            shapes[IMAGE_STATES] = ((encoder.image_size // encoder.patch_size) ** 2 + 1, encoder.hidden_size)
        return shapes

    def transformer_velocity(self, z: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """``v = transformer([z ; video_condition], 1000 sigma, text, image states)``."""
        joint = torch.cat([z, cond[VIDEO_CONDITION].to(z.dtype)], dim=1)
        return self.transformer_output(joint, sigma.float() * 1000, cond)


def build_tiny_wan_i2v() -> WanImageToVideoPipeline:
    """Wan 2.1 I2V-like: the Wan 2.1 video VAE, a tiny CLIP vision encoder (32 px in 4 x 4 patches of 8 px: 17
    states) and its processor, the transformer's 4 + 2C input channels and image cross-attention, flow_shift 3."""
    vae = tiny_wan21_vae()
    encoder = CLIPVisionModelWithProjection(CLIPVisionConfig(hidden_size=8, projection_dim=8, num_hidden_layers=2,
                                                             num_attention_heads=2, intermediate_size=16,
                                                             image_size=32, patch_size=8))
    processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    z_dim = vae.config.z_dim
    return tiny_wan_pipeline(vae, 3.0, WanImageToVideoPipeline, image_encoder=encoder, image_processor=processor,
                             transformer_settings=dict(in_channels=4 + 2 * z_dim, image_dim=8, added_kv_proj_dim=24))


def build_tiny_wan_i2v_a14b() -> WanImageToVideoPipeline:
    """Wan 2.2 I2V-A14B-like: two tiny experts with the 4 + 2C input channels and no image cross-attention, no image
    encoder, switched at Wan-AI/Wan2.2-I2V-A14B-Diffusers' boundary_ratio 0.9, the Wan 2.1 video VAE, flow_shift 3."""
    vae = tiny_wan21_vae()
    settings = dict(in_channels=4 + 2 * vae.config.z_dim)
    pipe = tiny_wan_pipeline(vae, 3.0, WanImageToVideoPipeline, transformer_settings=settings, image_encoder=None,
                             image_processor=None, boundary_ratio=0.9)
    pipe.register_modules(transformer_2=type(pipe.transformer).from_config(pipe.transformer.config))
    return pipe


FAMILY = Family(label="Wan 2.1 / Wan 2.2 A14B image-to-video", pipeline="WanImageToVideoPipeline",
                model=Wan21ImageToVideoModel, edits_images=True, image_to_video=True,
                tiny_builders={"tiny-wan-i2v": build_tiny_wan_i2v, "tiny-wan-i2v-a14b": build_tiny_wan_i2v_a14b},
                archs={"wan21-i2v-14b-480p": "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
                       "wan22-i2v-a14b": "Wan-AI/Wan2.2-I2V-A14B-Diffusers"}, scheduler_shift_key="flow_shift")
