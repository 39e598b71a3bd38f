"""What the image-editing runs share (FLUX.1 Kontext, Qwen-Image-Edit, FLUX.2 with reference images).

A prompt is an :class:`~jagg_core.edit_prompts.EditPrompt` row: an instruction and its input image. A row is
encoded once and cached like any prompt's text conditioning:

* its input image, centre-cropped to the shape of ``H x W = model.condition_resolution`` and resized to it, is
  preprocessed by the pipeline's image processor to [-1, 1], encoded by the pipeline's ``_encode_vae_image`` (the
  posterior's mode, normalised as the pipeline does: FLUX ``(x - shift) * scale``, Qwen-Image ``(x - mean) / std``,
  FLUX.2 patchified 2x2 then its batch-norm statistics) and packed by ``_pack_latents`` into the
  ``(H / 2f) x (W / 2f)`` grid's ``m`` tokens, row by row (``f``: the VAE's factor, 8 for the real models):
  ``image_latents`` [m, 4C]; a row of ``n = model.input_images`` images (Qwen-Image-Edit-2509/2511, FLUX.2) has
  each image's tokens one after the other, [n m, 4C], as those pipelines concatenate them;
* its instruction is encoded by the family (Qwen-Image-Edit's text encoder sees the image too).

With CFG the negative branch is the negative prompt on the same image (both pipelines condition both branches on
it), so ``negative/image_latents`` is ``image_latents``. Every transformer call sees ``[z ; image_latents]`` along
the token axis (``z``'s grid read row by row), the condition's tokens placed as the family's pipeline places them
(:meth:`joint_velocity`), and the velocity is the output's first ``rows x cols`` tokens: the generated image's.
The sampler, GRPO and JAGG see one more conditioning tensor and nothing else; the schedule's dynamic shift counts
the generated tokens only, as the pipelines do. The output may be of any ``sampling.resolution`` and the input
images of any ``model.condition_resolution``, each its own shape.
"""

from __future__ import annotations

from abc import abstractmethod

import torch
from PIL import Image

from ..edit_prompts import EditPrompt, edit_rows
from ..family_names import family_of_pipeline
from .base import NEGATIVE, Conditioning, PackedFlowModel

IMAGE_LATENTS = "image_latents"


class EditingFlowModel(PackedFlowModel):
    """An editing family's model: listed before its text-to-image family's, e.g. ``FluxKontextModel(EditingFlowModel,
    FluxModel)``, whose encoding and transformer call it extends (see the module docstring)."""

    encodes_input_images = True

    def __init__(self, pipe, config, device="cpu", **placement):
        #: input images of a prompt row (``model.input_images`` as the family's declaration reads it)
        self.input_images = family_of_pipeline(type(pipe).__name__).input_images(config.input_images)
        super().__init__(pipe, config, device, **placement)

    def encode_prompts(self, prompts: list[str]) -> Conditioning:
        rows = edit_rows(prompts, self.family, self.input_images)
        cond = super().encode_prompts(rows)
        latents = self.condition_latents(rows)
        cond[IMAGE_LATENTS] = latents
        if self.use_cfg:
            cond[NEGATIVE + IMAGE_LATENTS] = latents
        return cond

    def prompt_texts(self, prompts: list[str]) -> list[str]:
        return [row.instruction for row in edit_rows(prompts, self.family, self.input_images)]

    def negative_prompts(self, prompts: list[EditPrompt]) -> list[EditPrompt]:
        return [EditPrompt(self.config.negative_prompt, row.images_bytes, row.label) for row in prompts]

    def condition_latents(self, rows: list[EditPrompt]) -> torch.Tensor:
        """The rows' packed, normalised VAE latents [N, n m, 4C], image after image (module docstring)."""
        images = [row.images(self.config.condition_size) for row in rows]
        return torch.cat([self.image_latents([pictures[k] for pictures in images])
                          for k in range(self.input_images)], dim=1)

    def image_latents(self, images: list[Image.Image]) -> torch.Tensor:
        """Packed, normalised VAE latents [N, m, 4C] of one input image a row, at ``condition_resolution``."""
        size = self.config.condition_size
        return self.input_pixel_latents(self.pipe.image_processor.preprocess(images, size.height, size.width))

    def input_pixel_latents(self, pixels: torch.Tensor) -> torch.Tensor:
        """Preprocessed input images [N, 3, H, W] in [-1, 1] -> their packed, normalised VAE latents [N, m, 4C]."""
        vae = self.pipe.vae
        latents = self.pipe._encode_vae_image(self.vae_input(pixels).to(vae.device, vae.dtype), generator=None)
        return self.pack_latents(latents)

    def pack_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """The pipeline's packing of normalised VAE latents [N, C, h, w] into tokens [N, h w / 4, 4C]."""
        rows_, cols = latents.shape[-2:]
        return self.pipe._pack_latents(latents, latents.shape[0], latents.shape[1], rows_, cols)

    def vae_input(self, pixels: torch.Tensor) -> torch.Tensor:
        """Preprocessed images [N, 3, H, W] in the layout the VAE takes (a video VAE adds a frame axis)."""
        return pixels

    def conditioning_shapes(self) -> dict[str, tuple[int, ...]]:
        tokens = self.input_images * self.image_seq_len(self.config.condition_size)
        return {**super().conditioning_shapes(), IMAGE_LATENTS: (tokens, self.transformer.config.in_channels)}

    def token_velocity(self, tokens: torch.Tensor, grid: tuple[int, int], sigma: torch.Tensor,
                       cond: Conditioning) -> torch.Tensor:
        joint = torch.cat([tokens, cond[IMAGE_LATENTS].to(tokens.dtype)], dim=1)
        return self.joint_velocity(joint, grid, sigma, cond)[:, :tokens.shape[1]]

    @property
    def input_image_grid(self) -> tuple[int, int]:
        """``(rows, cols)`` of each input image's tokens, which follow the generated image's: the packed grid of
        ``model.condition_resolution``, as :meth:`latent_shape` makes a generated image's."""
        return self.latent_shape(self.config.condition_size)[:2]

    @abstractmethod
    def joint_velocity(self, tokens: torch.Tensor, grid: tuple[int, int], sigma: torch.Tensor,
                       cond: Conditioning) -> torch.Tensor:
        """The transformer's output for ``tokens``: the generated image's ``grid`` of ``(rows, cols)`` tokens first,
        then the input images' (each of :attr:`input_image_grid`)."""
