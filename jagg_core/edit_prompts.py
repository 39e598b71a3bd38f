"""Image-editing prompt rows: an instruction and the input image(s) it applies to.

An editing model (FLUX.1 Kontext, Qwen-Image-Edit) is prompted by rows of (instruction, input image); Qwen-Image-Edit
-2509/2511 take up to three input images a row ('Picture 1', 'Picture 2', ...). Each row is an :class:`EditPrompt`,
a ``str`` whose text is ``"{instruction} [{label} {digest}]"`` (``label``: the image's file name or Hub row, the
names joined by ``+`` for several; ``digest``: the first 10 hex digits of the SHA-256 of the image's bytes, of its
images' digests for several), so the sampler, GRPO, the per-prompt conditioning cache,
``text_embeddings.safetensors``, the run's ``prompts.json`` and the eval grids' captions treat it as any prompt, while
two rows with the same instruction on different images stay apart. The row keeps the images' encoded bytes;
:meth:`EditPrompt.images` decodes them.

Geometry: an input image is centre-cropped to the shape of the size asked for and resized (bicubic) to it
(:class:`~jagg_core.image_size.ImageSize`): the model's ``model.condition_resolution`` before its VAE (and, for
Qwen-Image-Edit, its vision encoder) sees it, the output's size for the rewards' ``inputs`` (:func:`input_images`).
"""

from __future__ import annotations

import hashlib
import io
import re
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from .errors import UserError
from .family_names import EDITS_IMAGES
from .image_size import ImageSize

if TYPE_CHECKING:
    import torch


class EditPrompt(str):
    """One editing prompt row (see the module docstring): ``instruction``, its input images' encoded bytes
    (``images_bytes``, one or more, 'Picture 1' first) and its ``label`` (their file names joined by ``+``)."""

    def __new__(cls, instruction: str, images_bytes: bytes | tuple[bytes, ...], label: str):
        images_bytes = (images_bytes,) if isinstance(images_bytes, bytes) else tuple(images_bytes)
        row = super().__new__(cls, f"{instruction} [{label} {images_digest(images_bytes)}]")
        row.instruction, row.images_bytes, row.label = instruction, images_bytes, label
        return row

    def __getnewargs__(self):  # copies and pickles rebuild the row, not a bare string
        return self.instruction, self.images_bytes, self.label

    def image(self, size: ImageSize) -> Image.Image:
        """The (first) input image, RGB, centre-cropped to ``size``'s shape and resized to it."""
        return fitted_image(self.images_bytes[0], size)

    def images(self, size: ImageSize) -> list[Image.Image]:
        """Every input image, as :meth:`image`."""
        return [fitted_image(data, size) for data in self.images_bytes]


def upright_image(data: bytes) -> Image.Image:
    """The encoded image ``data``, RGB, turned as its EXIF orientation says it is seen (a phone's portrait photo is
    often stored landscape with an orientation tag), as diffusers' ``load_image`` turns it."""
    with Image.open(io.BytesIO(data)) as picture:
        return ImageOps.exif_transpose(picture).convert("RGB")


def fitted_image(data: bytes, size: ImageSize) -> Image.Image:
    """The encoded image ``data``, RGB and upright (:func:`upright_image`), centre-cropped to ``size``'s shape and
    resized (bicubic) to ``size``."""
    return ImageOps.fit(upright_image(data), (size.width, size.height), method=Image.Resampling.BICUBIC)


def images_digest(images_bytes: tuple[bytes, ...]) -> str:
    """The first 10 hex digits of the SHA-256 of the one image's bytes, or of its images' SHA-256 digests in order."""
    if len(images_bytes) == 1:
        return hashlib.sha256(images_bytes[0]).hexdigest()[:10]
    return hashlib.sha256(b"".join(hashlib.sha256(data).digest() for data in images_bytes)).hexdigest()[:10]


#: an :class:`EditPrompt`'s text: ``"{instruction} [{label} {digest}]"``
ROW_TEXT = re.compile(r"(?P<instruction>.*) \[(?P<label>.*) (?P<digest>[0-9a-f]{10})\]", re.DOTALL)


def instruction_of(text: str) -> str:
    """The instruction of an editing row's text (as written in a run's files); any other text as it is."""
    match = ROW_TEXT.fullmatch(text)
    return match["instruction"] if match else text


def checked_image_bytes(data: bytes, where: str) -> bytes:
    """``data`` if it decodes as an image, else a :class:`UserError` naming ``where`` it came from; so is an image of
    more pixels than PIL opens (twice ``Image.MAX_IMAGE_PIXELS``, its guard against decompression bombs: a 600 KB PNG
    can hold 200 million pixels)."""
    try:
        with Image.open(io.BytesIO(data)) as picture:
            picture.verify()
    except Image.DecompressionBombError:
        raise UserError(f"{where} has more pixels than an input image may have ({2 * Image.MAX_IMAGE_PIXELS:,}, PIL's "
                        "guard against decompression bombs); resize it") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        raise UserError(f"{where} is not a readable image ({type(err).__name__})") from None
    return data


def png_bytes(image: Image.Image) -> bytes:
    """``image`` encoded as PNG."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def edit_rows(prompts: list[str], family: str, input_images: int | None = None,
              generates_from_text_too: bool = False, does: str = EDITS_IMAGES) -> list[EditPrompt]:
    """``prompts`` as editing rows, each with ``input_images`` input images when given (``model.input_images``); a
    prompt without an input image, or with another number of them, is a :class:`UserError` (``family``: the editing
    model that needs them; ``generates_from_text_too``: it edits only because ``model.input_images`` says so, FLUX.2,
    and the message says how to generate from text instead; ``does``: what the model does with the images, as the
    message says it)."""
    for prompt in prompts:
        if not isinstance(prompt, EditPrompt):
            because = f" (model.input_images is {input_images})" if generates_from_text_too else ""
            or_text = "; or unset model.input_images to generate from text" if generates_from_text_too else ""
            raise UserError(f"the {family} model {does}{because}, but the prompt {str(prompt)[:80]!r} has no "
                            "input image; give prompts.source an image folder with prompts.csv/prompts.jsonl, or "
                            f"hf://DATASET:TEXT_COLUMN,IMAGE_COLUMN{or_text}")
        if input_images is not None and len(prompt.images_bytes) != input_images:
            raise UserError(f"the prompt {str(prompt)[:80]!r} has {len(prompt.images_bytes)} input image(s), but "
                            f"model.input_images is {input_images}; every row must have model.input_images images")
    return list(prompts)


def image_tensor(images: list[Image.Image]) -> torch.Tensor:
    """RGB PIL images of one size -> float32 ``[N, 3, H, W]`` in [0, 1]."""
    import torch  # imported here, so that loading a prompt set does not import torch

    arrays = np.stack([np.asarray(image, dtype=np.uint8) for image in images])
    return torch.from_numpy(arrays).permute(0, 3, 1, 2).float() / 255.0


def input_images(prompts: list[str], size: ImageSize) -> torch.Tensor | None:
    """The rows' input images as the rewards see them, float32 ``[N, 3, height, width]`` in [0, 1]; None when no
    prompt is an editing row (text-to-image)."""
    if not any(isinstance(prompt, EditPrompt) for prompt in prompts):
        return None
    return image_tensor([row.image(size) for row in edit_rows(prompts, "editing")])
