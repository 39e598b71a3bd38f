"""Image tensors to pictures: the one conversion used by rewards, the run directory's samples and the bench."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image


def to_pil(images: torch.Tensor) -> list[Image.Image]:
    """``[N, 3, H, W]`` floats in ``[0, 1]`` -> ``N`` RGB PIL images (rounded to 8 bits)."""
    array = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)
    return [Image.fromarray(np.ascontiguousarray(a.permute(1, 2, 0).cpu().numpy())) for a in array]


def grid(images: list[Image.Image], columns: int = 8) -> Image.Image:
    """The images tiled row by row, ``columns`` to a row (all the size of the first)."""
    width, height = images[0].size
    rows = -(-len(images) // columns)
    tiled = Image.new("RGB", (width * min(columns, len(images)), height * rows), "white")
    for i, image in enumerate(images):
        tiled.paste(image, ((i % columns) * width, (i // columns) * height))
    return tiled
