"""JPEG compressibility rewards (DDPO, Black et al. 2023).

The image is encoded as JPEG at quality 95 and its size measured in kilobytes:

* ``jpeg_compressibility``:   score = -size_kB
* ``jpeg_incompressibility``: score = +size_kB
"""

from __future__ import annotations

import io

import torch

from ..images import to_pil
from .base import Reward

QUALITY = 95


def jpeg_size_kb(images: torch.Tensor) -> torch.Tensor:
    """Size in kB (1000 bytes) of each image saved as JPEG at quality 95."""
    sizes = []
    for image in to_pil(images):
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=QUALITY)
        sizes.append(buffer.tell() / 1000.0)
    return torch.tensor(sizes, dtype=torch.float32)


class JpegCompressibility(Reward):
    """Smaller JPEG files score higher: ``-size_kB``."""

    name = "jpeg_compressibility"

    def __call__(self, images, prompts):
        return -jpeg_size_kb(images)


class JpegIncompressibility(Reward):
    """Larger JPEG files score higher: ``+size_kB``."""

    name = "jpeg_incompressibility"

    def __call__(self, images, prompts):
        return jpeg_size_kb(images)
