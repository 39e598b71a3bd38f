"""Qwen-Image-Edit (``QwenImageEditPipeline``): Qwen-Image editing an input image.

Everything is Qwen-Image's (:mod:`.qwen_image`: packed latents of the video-style VAE, true CFG with its norm
rescale), plus the input image (:mod:`.editing`):

* the Qwen2.5-VL text encoder reads the image with the instruction (the pipeline's edit template, its system prefix
  dropped), so the text states hold the image's vision tokens too: each row is padded to
  ``model.max_sequence_length + vision tokens`` (the instruction and the template's few closing tokens must fit in
  ``max_sequence_length``); CFG's negative prompt is encoded with the same image, as the pipeline does;
* the image's latents, normalised by the VAE's per-channel mean and std, follow the noisy tokens in the sequence,
  and ``img_shapes`` lists both grids: ``[(1, h, w), (1, h_in, w_in)]``.

The pipeline's own ``__call__`` resizes the input to about 1024 x 1024 (``calculate_dimensions(1024 * 1024, ratio)``)
for both the VAE and the text encoder, keeping its shape; here both see it at ``model.condition_resolution``.
"""

from __future__ import annotations

import torch
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from diffusers import QwenImageEditPipeline
from PIL import Image

from ..edit_prompts import EditPrompt
from ..image_size import ImageSize
from .base import Conditioning
from .editing import EditingFlowModel
from .family import Family
from .in_memory_parts import tiny_qwen_edit_tokenizer, tiny_qwen_processor, tiny_qwen_vl_encoder
from .qwen_image import QwenImageModel, build_tiny_qwen
from .text_windows import MAX_SEQUENCE_LENGTH, TextWindow

#: Qwen/Qwen-Image-Edit's ``processor/preprocessor_config.json`` (the vision token count when no processor is loaded,
#: e.g. in a memory plan): 14-pixel patches merged 2 x 2, images scaled into [min_pixels, max_pixels]
QWEN_EDIT_VISION = {"patch_size": 14, "merge_size": 2, "min_pixels": 3136, "max_pixels": 12845056}


class QwenImageEditModel(EditingFlowModel, QwenImageModel):
    family = "qwen-image-edit"

    def encode_without_cfg(self, prompts: list[str]) -> Conditioning:
        embeds, mask = self.pipe.encode_prompt(prompt=[row.instruction for row in prompts],
                                               image=self.text_images(prompts), device=self.device)
        return self.padded_text(embeds, mask)

    def text_windows(self) -> list[TextWindow]:
        """The instruction's tokens in the template, its pictures' vision tokens aside, must fit in
        ``model.max_sequence_length``: the pipeline keeps them all, so a longer one is refused
        (:meth:`padded_text`)."""
        return [TextWindow("Qwen2.5-VL", self.config.max_sequence_length, self.text_tokens, MAX_SEQUENCE_LENGTH,
                           refused=True)]

    def image_placeholders(self) -> int:
        """One ``<|image_pad|>`` token a picture, which the processor widens to its vision tokens."""
        return self.input_images

    @property
    def vision_size(self) -> ImageSize:
        """The size of the input image the text encoder reads: ``model.condition_resolution``, the VAE's."""
        return self.config.condition_size

    def text_images(self, rows: list[EditPrompt]) -> list[Image.Image]:
        """The rows' input images as the text encoder reads them, at :attr:`vision_size`."""
        return [row.image(self.vision_size) for row in rows]

    @property
    def text_length(self) -> int:
        """``model.max_sequence_length`` plus the vision tokens of the row's input images."""
        return self.config.max_sequence_length + self.input_images * self.vision_tokens()

    def vision_tokens(self) -> int:
        """Tokens of a :attr:`vision_size` image in the text encoder's sequence: Qwen2-VL scales it to a multiple of
        ``patch * merge`` pixels a side within ``[min_pixels, max_pixels]`` (``smart_resize``), one token per
        ``merge x merge`` patches."""
        processor = getattr(self.pipe, "processor", None)
        vision = QWEN_EDIT_VISION
        if processor is not None:
            images = processor.image_processor
            vision = {"patch_size": images.patch_size, "merge_size": images.merge_size,
                      "min_pixels": images.size["shortest_edge"], "max_pixels": images.size["longest_edge"]}
        size = self.vision_size
        height, width = smart_resize(size.height, size.width, factor=vision["patch_size"] * vision["merge_size"],
                                     min_pixels=vision["min_pixels"], max_pixels=vision["max_pixels"])
        return height * width // (vision["patch_size"] * vision["merge_size"]) ** 2

    def vae_input(self, pixels: torch.Tensor) -> torch.Tensor:
        return pixels.unsqueeze(2)  # one frame

    def joint_velocity(self, tokens: torch.Tensor, grid: tuple[int, int], sigma: torch.Tensor,
                       cond: Conditioning) -> torch.Tensor:
        condition = self.input_image_grid
        return self.qwen_forward(tokens, sigma, cond, [(1, *grid)] + [(1, *condition)] * self.input_images)


def build_tiny_qwen_edit() -> QwenImageEditPipeline:
    """tiny-qwen as Qwen-Image-Edit (whose transformer, VAE and scheduler are Qwen-Image's): its Qwen2.5-VL encoder
    reads the input image through the processor, the tokenizer knows the edit template and the vision tokens."""
    tokenizer = tiny_qwen_edit_tokenizer()
    return QwenImageEditPipeline(**{**build_tiny_qwen().components, "tokenizer": tokenizer,
                                    "text_encoder": tiny_qwen_vl_encoder(tokenizer),
                                    "processor": tiny_qwen_processor(tokenizer)})


FAMILY = Family(label="Qwen-Image-Edit", pipeline="QwenImageEditPipeline", model=QwenImageEditModel,
                tiny_builders={"tiny-qwen-edit": build_tiny_qwen_edit},
                archs={"qwen-image-edit": "Qwen/Qwen-Image-Edit"}, edits_images=True,
                requires=("torchvision",), cfg_argument="true_cfg_scale",
                pipeline_input_area=1_048_576)  # 1024²
