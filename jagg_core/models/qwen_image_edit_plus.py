"""Qwen-Image-Edit-2509 and -2511 (``QwenImageEditPlusPipeline``): Qwen-Image-Edit's successors.

Everything is Qwen-Image-Edit's (:mod:`.qwen_image_edit`: the input image's latents after the noisy tokens,
``img_shapes`` listing both grids, the Qwen2.5-VL encoder reading the image with the instruction, true CFG), except
what the Plus pipeline changes:

* its text encoder reads the input image at about 384 x 384 pixels (the pipeline's ``CONDITION_IMAGE_SIZE`` area,
  the shape kept: ``calculate_dimensions``), whatever the size the VAE sees (``model.condition_resolution``; the
  pipeline's about 1024 x 1024), so a row's text holds the vision tokens of about a 384 px square (196 for a
  square) on top of ``model.max_sequence_length``;
* the instruction follows ``Picture 1: <vision tokens>`` (then ``Picture 2: ...`` for a row of several input
  images, ``model.input_images``, up to 3) in the template's user turn (its system prefix is dropped as before);
  the pipeline's image list is every prompt's, so each row is encoded on its own; the images' latents follow the
  noisy tokens one after the other, and ``img_shapes`` lists every grid;
* 2511's transformer config sets ``zero_cond_t``: the input image's tokens are modulated at timestep 0 while the
  generated ones follow sigma. diffusers' ``QwenImageTransformer2DModel`` does it from ``img_shapes``, so the same
  call serves both checkpoints.

"""

from __future__ import annotations

import torch
from diffusers import QwenImageEditPlusPipeline, QwenImageTransformer2DModel
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus
from PIL import Image

from ..edit_prompts import EditPrompt
from ..image_size import ImageSize
from .base import Conditioning
from .family import Family
from .qwen_image_edit import QwenImageEditModel, build_tiny_qwen_edit

#: what the Plus pipeline's ``_get_qwen_prompt_embeds`` puts before the instruction for picture ``i`` (from 1)
PICTURE_PROMPT = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"


class QwenImageEditPlusModel(QwenImageEditModel):
    family = "qwen-image-edit-plus"

    def encode_without_cfg(self, prompts: list[str]) -> Conditioning:
        rows = [super(QwenImageEditPlusModel, self).encode_without_cfg([row]) for row in prompts]
        return {key: torch.cat([row[key] for row in rows]) for key in rows[0]}

    def text_with_images(self, text: str) -> str:
        """``Picture 1: <image> ... Picture n: <image>`` then the instruction, as the pipeline frames it."""
        return "".join(PICTURE_PROMPT.format(i + 1) for i in range(self.input_images)) + text

    def text_images(self, rows: list[EditPrompt]) -> list[Image.Image]:
        """The row's input images (one row: :meth:`encode_without_cfg`), ``Picture 1`` first."""
        return [image for row in rows for image in row.images(self.vision_size)]

    @property
    def vision_size(self) -> ImageSize:
        """``model.condition_resolution``'s shape at the pipeline's ``CONDITION_IMAGE_SIZE`` area (384 x 384 for a
        square), as its ``calculate_dimensions`` makes it (sides rounded to multiples of 32)."""
        condition = self.config.condition_size
        width, height = pipeline_qwenimage_edit_plus.calculate_dimensions(
            pipeline_qwenimage_edit_plus.CONDITION_IMAGE_SIZE, condition.width / condition.height)
        return ImageSize(height, width)


def build_tiny_qwen_edit_plus() -> QwenImageEditPlusPipeline:
    """tiny-qwen-edit's parts as Qwen-Image-Edit-2511, whose transformer modulates the input image at timestep 0
    (``zero_cond_t``; 2509's transformer is Qwen-Image-Edit's, tested as tiny-qwen-edit)."""
    components = build_tiny_qwen_edit().components
    transformer = QwenImageTransformer2DModel.from_config({**components["transformer"].config, "zero_cond_t": True})
    return QwenImageEditPlusPipeline(**{**components, "transformer": transformer})


FAMILY = Family(label="Qwen-Image-Edit-2509/2511", pipeline="QwenImageEditPlusPipeline", model=QwenImageEditPlusModel,
                tiny_builders={"tiny-qwen-edit-plus": build_tiny_qwen_edit_plus},
                archs={"qwen-image-edit-2509": "Qwen/Qwen-Image-Edit-2509",
                       "qwen-image-edit-2511": "Qwen/Qwen-Image-Edit-2511"}, edits_images=True,
                max_input_images=3, requires=("torchvision",), cfg_argument="true_cfg_scale",
                pipeline_input_area=1_048_576)  # 1024²
