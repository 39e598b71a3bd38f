"""Image-editing prompt rows: an instruction and the input image it applies to.

An editing model (FLUX.1 Kontext, Qwen-Image-Edit) is prompted by rows of (instruction, input image). Each row is
an :class:`EditPrompt`, a ``str`` whose text is ``"{instruction} [{label} {digest}]"`` (``label``: the image's
file name or Hub row, ``digest``: the first 10 hex digits of the SHA-256 of its bytes), so the sampler, GRPO, the
per-prompt conditioning cache, ``text_embeddings.safetensors``, the run's ``prompts.json`` and the eval grids'
captions treat it as any prompt, while two rows with the same instruction on different images stay apart. The
row keeps the image's encoded bytes; :meth:`EditPrompt.image` decodes it.

Geometry: an input image is centre-cropped to a square and resized (bicubic) to the side asked for: the model's
``model.condition_resolution`` before its VAE (and, for Qwen-Image-Edit, its vision encoder) sees it, the output's
side for the rewards' ``inputs`` (:func:`input_images`).
"""

from __future__ import annotations

import hashlib
import io
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from .errors import UserError

if TYPE_CHECKING:
    import torch


class EditPrompt(str):
    """One editing prompt row (see the module docstring): ``instruction``, the image's bytes and its ``label``."""

    def __new__(cls, instruction: str, image_bytes: bytes, label: str):
        digest = hashlib.sha256(image_bytes).hexdigest()[:10]
        row = super().__new__(cls, f"{instruction} [{label} {digest}]")
        row.instruction, row.image_bytes, row.label = instruction, image_bytes, label
        return row

    def __getnewargs__(self):  # copies and pickles rebuild the row, not a bare string
        return self.instruction, self.image_bytes, self.label

    def image(self, size: int) -> Image.Image:
        """The input image, RGB, centre-cropped to a square and resized to ``size`` x ``size``."""
        with Image.open(io.BytesIO(self.image_bytes)) as picture:
            return ImageOps.fit(picture.convert("RGB"), (size, size), method=Image.Resampling.BICUBIC)


def checked_image_bytes(data: bytes, where: str) -> bytes:
    """``data`` if it decodes as an image, else a :class:`UserError` naming ``where`` it came from."""
    try:
        with Image.open(io.BytesIO(data)) as picture:
            picture.verify()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        raise UserError(f"{where} is not a readable image ({type(err).__name__})") from None
    return data


def png_bytes(image: Image.Image) -> bytes:
    """``image`` encoded as PNG."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def edit_rows(prompts: list[str], family: str) -> list[EditPrompt]:
    """``prompts`` as editing rows; a prompt without an input image is a :class:`UserError` (``family``: the
    editing model that needs them)."""
    for prompt in prompts:
        if not isinstance(prompt, EditPrompt):
            raise UserError(f"the {family} model edits images, but the prompt {str(prompt)[:80]!r} has no input image; "
                            "give prompts.source an image folder with prompts.csv/prompts.jsonl, or "
                            "hf://DATASET:TEXT_COLUMN,IMAGE_COLUMN")
    return list(prompts)


def image_tensor(images: list[Image.Image]) -> torch.Tensor:
    """RGB PIL images of one size -> float32 ``[N, 3, H, W]`` in [0, 1]."""
    import torch  # imported here, so that loading a prompt set does not import torch

    arrays = np.stack([np.asarray(image, dtype=np.uint8) for image in images])
    return torch.from_numpy(arrays).permute(0, 3, 1, 2).float() / 255.0


def input_images(prompts: list[str], size: int) -> torch.Tensor | None:
    """The rows' input images as the rewards see them, float32 ``[N, 3, size, size]`` in [0, 1]; None when no
    prompt is an editing row (text-to-image)."""
    if not any(isinstance(prompt, EditPrompt) for prompt in prompts):
        return None
    return image_tensor([row.image(size) for row in edit_rows(prompts, "editing")])
